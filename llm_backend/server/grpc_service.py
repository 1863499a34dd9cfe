"""The LLM worker's gRPC service: `mimo_epd.v1.Generator/Generate` (server streaming), on the same
`GenerationCore` as the HTTP API: media through the encoder (placeholders after BOS), deltas whose text
comes from the incremental detokenizer (a delta may carry a token and no text yet: the bytes of an
incomplete character, or text that could start a stop string, wait for the next token), then one final
message. A client that cancels the call (or goes away) aborts the request, which frees its KV.
"""

from __future__ import annotations

import grpc

from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

from .core import Final, GenerationCore, ServeError

SERVICE_NAME = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name


class GeneratorService(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, core: GenerationCore):
        self.core = core

    async def Generate(self, request: generator_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        core = self.core
        s = request.sampling
        gen = None
        try:
            if any(not x for x in s.stop):
                raise ServeError.invalid("sampling.stop: a stop string must not be empty", param="sampling.stop")
            prep = await core.prepare(
                text=request.prompt,
                token_ids=list(request.prompt_token_ids) or None,
                media_items=list(request.media),
                timeout=context.time_remaining(),
            )
            prep.prefill_address = request.prefill_address
            params = core.make_params(
                s.max_tokens or 16,
                len(prep.prompt),
                temperature=s.temperature,
                top_p=s.top_p or 1.0,
                top_k=s.top_k,
                seed=s.seed if s.has_seed else None,
                stop_token_ids=tuple(s.stop_token_ids),
                logprobs=s.logprobs,
                ignore_eos=s.ignore_eos,
            )
            gen = core.start(prep, params, tuple(s.stop))
            async for ev in gen.events():
                if isinstance(ev, Final):
                    yield generator_pb2.GenerateResponse(
                        final=generator_pb2.GenerateFinal(
                            prompt_tokens=ev.prompt_tokens,
                            cached_tokens=ev.cached_tokens,
                            completion_tokens=ev.completion_tokens,
                            ttft_ms=ev.ttft_s * 1e3,
                            finish_reason=ev.finish_reason,
                            media_tokens=ev.media_tokens,
                            accepted_prediction_tokens=ev.accepted_prediction_tokens,
                            rejected_prediction_tokens=ev.rejected_prediction_tokens,
                            kv_transfer_bytes=ev.kv_transfer_bytes,
                            kv_transfer_ms=ev.kv_transfer_s * 1e3,
                            prefill_address=ev.prefill_address,
                        )
                    )
                    break
                yield generator_pb2.GenerateResponse(
                    delta=generator_pb2.TokenDelta(token_ids=ev.token_ids, text=ev.text, logprobs=ev.logprobs)
                )
        except ServeError as e:
            await context.abort(e.code, e.message)
        finally:
            if gen is not None:
                gen.cancel()  # a no-op once finished; a cancelled call frees its KV
