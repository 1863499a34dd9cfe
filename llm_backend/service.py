"""The LLM worker's gRPC service: `mimo_epd.v1.Generator/Generate` (server streaming).

Media items are sent to the encoder service (`--encoder`); each item's embedding rows take prompt positions
right after BOS, in order, with placeholder token ids derived from the item's content key (ids >= the
vocabulary size), so the same image gives the same placeholder ids (a shared prefix in the radix cache) and
different images never do. The engine runs in its own thread; tokens stream back as they are sampled.
A client that cancels the call (or goes away) aborts the request, which frees its KV at the next step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import torch

from mimo_epd.common.grpc_server import add_health_and_reflection, new_server, set_serving, stop_on_signals
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc, generator_pb2, generator_pb2_grpc

from .engine import LLM, SamplingParams

log = logging.getLogger(__name__)
SERVICE_NAME = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name


def placeholder_ids(content_key: str, n: int, vocab: int) -> list[int]:
    base = int(content_key[:15], 16)
    return [vocab + (base + j) % (1 << 40) for j in range(n)]


def sampling_from_proto(s: generator_pb2.SamplingOptions) -> SamplingParams:
    return SamplingParams(max_tokens=s.max_tokens or 16, temperature=s.temperature, top_p=s.top_p or 1.0,
                          top_k=s.top_k, seed=s.seed if s.has_seed else None, stop_token_ids=tuple(s.stop_token_ids),
                          logprobs=s.logprobs)


class GeneratorService(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, engine: LLM, encoder_address: str | None):
        self.engine = engine
        self.encoder = None
        if encoder_address:
            ch = grpc.aio.insecure_channel(encoder_address, options=[("grpc.max_receive_message_length", 512 << 20)])
            self.encoder = encoder_pb2_grpc.EncoderStub(ch)

    async def _media(self, items, context) -> tuple[list[int], dict[int, torch.Tensor]]:
        if not items:
            return [], {}
        if self.encoder is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "media items need an encoder: start the worker with --encoder ADDR")
        try:
            resp = await self.encoder.Encode(encoder_pb2.EncodeRequest(items=list(items)), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"encoder: {e.details()}")
        cfg = self.engine.model.config
        ids, rows = [], []
        for i, it in enumerate(resp.items):
            emb = torch.frombuffer(bytearray(it.embedding.data), dtype=getattr(torch, it.embedding.dtype)).view(
                *it.embedding.shape)
            if emb.shape[-1] != cfg.hidden_size:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"media item {i}: embedding size {emb.shape[-1]} != the model's hidden size {cfg.hidden_size}")
            ids += placeholder_ids(it.content_key, emb.shape[0], cfg.vocab_size)
            rows.append(emb)
        table = torch.cat(rows)
        return ids, {1 + j: table[j] for j in range(table.shape[0])}  # positions after BOS

    async def Generate(self, request: generator_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        t0 = time.monotonic()
        try:
            params = sampling_from_proto(request.sampling)
            params.validate()
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        tok = self.engine.tokenizer
        media_ids, media = await self._media(request.media, context)
        if request.prompt_token_ids:
            text_ids = list(request.prompt_token_ids)
            prompt = text_ids[:1] + media_ids + text_ids[1:] if media_ids else text_ids
        else:
            text_ids = tok.encode(request.prompt)  # [BOS, ...]
            prompt = text_ids[:1] + media_ids + text_ids[1:]
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            r = self.engine.add_request(
                prompt, params, media,
                on_token=lambda _r, t, lp: loop.call_soon_threadsafe(queue.put_nowait, ("token", t, lp)),
                on_finish=lambda _r: loop.call_soon_threadsafe(queue.put_nowait, ("end", None, None)))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            while True:
                kind, t, lp = await queue.get()
                if kind == "end":
                    break
                yield generator_pb2.GenerateResponse(delta=generator_pb2.TokenDelta(
                    token_ids=[t], text=tok.decode([t]), logprobs=[lp] if lp is not None else []))
            if r.finish_reason.startswith("error"):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, r.finish_reason.removeprefix("error: "))
            ttft = ((r.first_token_at or time.monotonic()) - t0) * 1e3
            yield generator_pb2.GenerateResponse(final=generator_pb2.GenerateFinal(
                prompt_tokens=len(prompt), cached_tokens=r.cached_tokens, completion_tokens=len(r.output),
                ttft_ms=ttft, finish_reason=r.finish_reason, media_tokens=len(media_ids)))
        finally:
            if not r.finish_reason:  # the client went away or cancelled
                log.info("request %d cancelled by the client; freeing its KV", r.id)
                self.engine.abort(r)


async def serve_llm(engine: LLM, host: str, port: int, encoder_address: str | None, grace_s: float = 10.0) -> int:
    stop_engine = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop_engine,), name="llm-engine", daemon=True)
    thread.start()
    server, drain = new_server(256)
    generator_pb2_grpc.add_GeneratorServicer_to_server(GeneratorService(engine, encoder_address), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    await set_serving(health, [SERVICE_NAME])
    print(f"ready {host}:{bound}", flush=True)
    stop = asyncio.Event()
    stop_on_signals(stop)
    await stop.wait()
    await drain.stop(server, health, grace_s)
    stop_engine.set()
    thread.join(5)
    return 0
