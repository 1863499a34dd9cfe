"""The LLM worker's gRPC service: `mimo_epd.v1.Generator/Generate` (server streaming), on the same
`GenerationCore` as the HTTP API: media through the encoder (placeholders after BOS), deltas whose text
comes from the incremental detokenizer (a delta may carry a token and no text yet: the bytes of an
incomplete character, or text that could start a stop string, wait for the next token), then one final
message (with `sampling.n` > 1: the samples' deltas interleaved, each marked with its index, and one final
each; the prompt prefilled once). A client that cancels the call (or goes away) aborts the request, which frees its KV. The request's
`constraint` (JSON schema, JSON object, regex, EBNF or a choice list) constrains the output as the HTTP API's
structured outputs do (llm_backend/agentic).
"""

from __future__ import annotations

import math

import grpc

from llm_backend.agentic.request import constraint_from_proto
from llm_backend.agentic.tools import ToolError
from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

from .core import Final, GenerationCore, ServeError, with_audio_tracks

SERVICE_NAME = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name


class GeneratorService(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, core: GenerationCore, max_samples: int = 16):
        self.core, self.max_samples = core, max_samples

    async def Generate(self, request: generator_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        gens: list = []
        try:
            prep, params, stop = await self._prepare(request, context)
            n = request.sampling.n or 1
            async for i, ev in self.core.sample_events(prep, params, stop, n, gens):
                if isinstance(ev, Final):
                    yield generator_pb2.GenerateResponse(
                        final=_final(ev, i, gens[i].r, request.sampling.prompt_logprobs)
                    )
                else:
                    delta = generator_pb2.TokenDelta(
                        token_ids=ev.token_ids, text=ev.text, logprobs=ev.logprobs, index=i
                    )
                    yield generator_pb2.GenerateResponse(delta=delta)
        except ServeError as e:
            await context.abort(e.code, e.message)
        finally:
            for gen in gens:
                gen.cancel()  # a no-op once finished; a cancelled call frees its KV

    async def _prepare(self, request, context):
        core, s = self.core, request.sampling
        if any(not x for x in s.stop):
            raise ServeError.invalid("sampling.stop: a stop string must not be empty", param="sampling.stop")
        if not 0 <= s.n <= self.max_samples:
            raise ServeError.invalid(
                f"sampling.n: {s.n} samples asked, at most {self.max_samples} (--max-samples-per-request)",
                param="sampling.n",
            )
        try:
            spec = constraint_from_proto(request.constraint)
        except ToolError as e:
            raise ServeError.invalid(str(e), param=e.param) from None
        media, names = with_audio_tracks(request.media) if request.use_audio_in_video else (request.media, None)
        prep = await core.prepare(
            text=request.prompt,
            token_ids=list(request.prompt_token_ids) or None,
            media_items=list(media),
            media_names=names,
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
            grammar=await core.grammar(spec),
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty or 1.0,
            logit_bias=tuple(sorted(s.logit_bias.items())),
            min_tokens=s.min_tokens,
            prompt_logprobs=s.prompt_logprobs,
        )
        return prep, params, tuple(s.stop)


def _final(ev: Final, index: int, r, prompt_logprobs: bool) -> generator_pb2.GenerateFinal:
    return generator_pb2.GenerateFinal(
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
        prefill_failed_address=ev.prefill_failed_address,
        kv_events_position=ev.kv_events_position,
        index=index,
        prompt_logprobs=[math.nan if x is None else x for x in (r.prompt_logprobs or [])] if prompt_logprobs else [],
    )
