"""Prefill / decode disaggregation with real processes: a `both` worker, a prefill worker and a decode worker
(real gRPC on loopback, Mooncake's transfer engine over TCP, a real encoder for images). Greedy outputs equal the
colocated worker's, a second turn moves only its new tokens, and the bytes are the rule's."""

from __future__ import annotations

import grpc
import pytest

from llm_backend.kv.transfer import PoolLayout
from llm_backend.models import TINY_LLM_CONFIG
from llm_backend.paged_attention import KVPools
from mimo_epd.testing.servers import scrape
from mimo_epd.v1 import encoder_pb2, generator_pb2, generator_pb2_grpc
from tests.conftest import encode_image, start_server, textured

pytestmark = pytest.mark.integration

COMMON = [
    "--model",
    "tiny-random",
    "--torch-threads",
    "1",
    "--http-port",
    "0",
    "--kv-cache-tokens",
    "6000",
    "--swa-cache-tokens",
    "1500",
]


@pytest.fixture(scope="module")
def encoder():
    s = start_server(["--decode-workers", "1"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fleet(encoder):
    enc = ["--encoder", encoder.address]
    both = start_server(COMMON + enc, "llm")
    pre = start_server(COMMON + enc + ["--role", "prefill"], "llm")
    dec = start_server(
        COMMON + enc + ["--role", "decode", "--pd-prefill", pre.address, "--pd-local-prefill-tokens", "0"], "llm"
    )
    yield both, pre, dec
    for s in (dec, pre, both):
        assert s.stop() == 0


def stream(address, req, timeout=120):
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    tokens, final = [], None
    for msg in stub.Generate(req, timeout=timeout):
        if msg.HasField("delta"):
            tokens += list(msg.delta.token_ids)
        else:
            final = msg.final
    return tokens, final


def ids_request(ids, n, media=()):
    return generator_pb2.GenerateRequest(
        prompt_token_ids=ids, media=list(media), sampling=generator_pb2.SamplingOptions(max_tokens=n, ignore_eos=True)
    )


def rule_bytes(length: int, prefix: int) -> int:
    full_b, swa_b = PoolLayout.of(KVPools(TINY_LLM_CONFIG, 1, 1)).token_bytes()
    w = TINY_LLM_CONFIG.window  # page 1: SWA of [max(prefix, L - 1 - W), L)
    return (length - prefix) * full_b + (length - max(prefix, length - 1 - w)) * swa_b


def port(s) -> int:
    return int(s.http_address.rsplit(":", 1)[1])


def test_multi_turn_greedy_equals_colocated_and_turn_two_moves_only_new_tokens(fleet):
    both, pre, dec = fleet
    turn1 = [1] + [(7 * i) % 200 + 3 for i in range(300)]  # longer than the window: the SWA share is cut
    a1, _ = stream(both.address, ids_request(turn1, 10))
    b1, f1 = stream(dec.address, ids_request(turn1, 10))
    assert a1 == b1 and len(b1) == 10
    assert f1.prefill_address == pre.address and f1.cached_tokens == 0
    assert f1.kv_transfer_bytes == rule_bytes(len(turn1), 0)
    full_b, swa_b = PoolLayout.of(KVPools(TINY_LLM_CONFIG, 1, 1)).token_bytes()
    assert f1.kv_transfer_bytes < len(turn1) * (full_b + swa_b)  # less than a full-KV transfer
    again, fa = stream(dec.address, ids_request(turn1, 10))  # a re-sent prompt: the decode side's copy matches
    assert again == b1 and fa.cached_tokens == len(turn1) - 1
    assert fa.kv_transfer_bytes == rule_bytes(len(turn1), len(turn1) - 1)
    turn2 = turn1 + b1 + [(11 * i) % 200 + 3 for i in range(40)]
    a2, _ = stream(both.address, ids_request(turn2, 10))
    b2, f2 = stream(dec.address, ids_request(turn2, 10))
    assert a2 == b2
    # the decode worker's own tree holds turn 1 (prompt and answer): only the new tokens cross
    assert f2.cached_tokens >= len(turn1) + len(b1) - 1
    assert f2.kv_transfer_bytes == rule_bytes(len(turn2), f2.cached_tokens)
    assert f2.kv_transfer_bytes <= (len(turn2) - len(turn1) - len(b1) + 1) * (full_b + swa_b)
    m = scrape(port(dec))
    assert m["llm_pd_remote_prefills"] >= 2 and m["llm_pd_transfer_bytes"] >= f1.kv_transfer_bytes


def test_seeded_sampling_equals_colocated(fleet):
    """Temperature 1 with a seed: the prefill worker samples the first token, the decode worker the rest from the
    prefill side's generator state (PrefillDone.rng_state), so every token is the colocated worker's; another
    seed gives another output (the comparison can fail)."""
    both, pre, dec = fleet
    prompt = [1] + [(5 * i) % 200 + 3 for i in range(60)]

    def sampled(address, seed):
        req = generator_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=generator_pb2.SamplingOptions(
                max_tokens=24, ignore_eos=True, temperature=1.0, top_k=50, seed=seed, has_seed=True
            ),
        )
        toks, final = stream(address, req)
        return toks, final

    a, _ = sampled(both.address, 7)
    b, fb = sampled(dec.address, 7)
    assert fb.prefill_address == pre.address and len(b) == 24
    assert a == b
    assert sampled(dec.address, 8)[0] != b


def test_image_prompt_equals_colocated(fleet):
    both, pre, dec = fleet
    img = encode_image(textured(200, 300, seed=5), "JPEG")
    req = generator_pb2.GenerateRequest(
        prompt="Describe:",
        media=[encoder_pb2.MediaItem(data=img)],
        sampling=generator_pb2.SamplingOptions(max_tokens=8, ignore_eos=True),
    )
    a, fa = stream(both.address, req)
    b, fb = stream(dec.address, req)
    assert a == b and fb.media_tokens == fa.media_tokens == 77 and fb.prefill_address == pre.address


def test_idle_pools_and_local_prefill(fleet):
    both, pre, dec = fleet
    for s in (pre, dec):
        m = scrape(port(s))
        assert m["llm_kv_full_request_slots"] == 0 and m["llm_kv_swa_request_slots"] == 0
        assert m["llm_requests_running"] == 0
    assert scrape(port(dec))["llm_pd_transferring"] == 0
