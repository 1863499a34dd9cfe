"""A turn whose media KV the worker's prefix cache holds skips the encoder (--media-memo-items): the next turn of a
chat with an image sends nothing to the encoder and generates what a worker that always encodes generates; a
request that cannot use the cache (prompt_logprobs computes every position) is encoded after all, transparently."""

from __future__ import annotations

import math

import grpc
import pytest

from mimo_epd.testing.redis_server import free_port
from mimo_epd.testing.servers import scrape, start_server
from mimo_epd.v1 import encoder_pb2, generator_pb2, generator_pb2_grpc
from tests.conftest import encode_image, textured

pytestmark = pytest.mark.integration


def _generate(address: str, prompt: str, img: bytes, **sampling):
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    req = generator_pb2.GenerateRequest(
        prompt=prompt,
        media=[encoder_pb2.MediaItem(data=img)],
        sampling=generator_pb2.SamplingOptions(max_tokens=6, ignore_eos=True, **sampling),
    )
    msgs = list(stub.Generate(req, timeout=120))
    return [t for m in msgs if m.HasField("delta") for t in m.delta.token_ids], msgs[-1].final


def test_a_cached_image_skips_the_encoder():
    port = free_port()
    enc = start_server(["--decode-workers", "1", "--metrics-port", str(port)])
    base = ["--model", "tiny-random", "--encoder", enc.address, "--kv-cache-tokens", "4096"]
    base += ["--swa-cache-tokens", "1024", "--torch-threads", "1"]
    memo, plain = start_server(base, "llm"), start_server([*base, "--media-memo-items", "0"], "llm")
    encodes = lambda: scrape(port)["encoder_requests_total"]  # noqa: E731
    try:
        img = encode_image(textured(160, 128, seed=5), "JPEG")
        first = "Look at this picture and tell me what you see in it."
        second = first + " Now describe its colours in detail, please."
        for w in (memo, plain):
            _generate(w.address, first, img)
        before = encodes()
        got, final = _generate(memo.address, second, img)
        assert encodes() == before, "the memo worker called the encoder for a cached image"
        want, _ = _generate(plain.address, second, img)
        assert encodes() == before + 1 and got == want
        assert final.media_tokens == 30 and final.cached_tokens >= 31
        m = scrape(int(memo.http_address.rsplit(":", 1)[1]))
        assert m["llm_media_encodes_skipped_total"] == 1 and m["llm_media_skip_misses_total"] == 0

        # prompt_logprobs matches no cache: sent without rows, it comes back MEDIA_NEEDED and is encoded after all
        got, final = _generate(memo.address, second, img, prompt_logprobs=True)
        want, _ = _generate(plain.address, second, img, prompt_logprobs=True)
        assert got == want and len(final.prompt_logprobs) == final.prompt_tokens - 1
        # a media row has no logprob (NaN on gRPC, null over HTTP); it used to fail the forward (INTERNAL)
        assert sum(math.isnan(x) for x in final.prompt_logprobs) == 30
        m = scrape(int(memo.http_address.rsplit(":", 1)[1]))
        assert m["llm_media_skip_misses_total"] == 1
    finally:
        for s in (memo, plain, enc):
            s.stop()
