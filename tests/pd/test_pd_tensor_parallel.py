"""P/D with both sides tensor-parallel, real processes: a prefill worker and a decode worker each at TP 2 (two rank
processes each, gloo), every rank with its own Mooncake transfer engine over TCP, against a colocated worker on
one rank. Each prefill rank writes its own heads into the decode rank of its number (parallel/mirror.py
`MirroredTransfer`): greedy outputs equal the colocated worker's over two turns, the bytes moved are the transfer
rule's summed over the ranks' layouts (a full layer's single KV head is replicated, so both ranks send it), and a
decode worker at another size is refused by the prefill worker, naming both sizes, and prefills locally."""

from __future__ import annotations

import pytest

from llm_backend.kv.transfer import PoolLayout
from llm_backend.models import TINY_LLM_CONFIG
from llm_backend.paged_attention import KVPools
from llm_backend.parallel.shard import Shard
from mimo_epd.testing.servers import scrape
from tests.conftest import start_server
from tests.pd.test_pd_live import COMMON, ids_request, port, stream

pytestmark = pytest.mark.integration

TP2 = ["--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def fleet():
    both = start_server(COMMON, "llm")
    pre = start_server(COMMON + TP2 + ["--role", "prefill"], "llm")
    dec = start_server(
        COMMON + TP2 + ["--role", "decode", "--pd-prefill", pre.address, "--pd-local-prefill-tokens", "0"], "llm"
    )
    yield both, pre, dec
    for s in (dec, pre, both):
        assert s.stop() == 0


def rule_bytes(length: int, prefix: int, size: int = 2) -> int:
    """The transfer rule's bytes (page 1) summed over the ranks: each rank moves its own heads' rows."""
    w, total = TINY_LLM_CONFIG.window, 0
    for r in range(size):
        full_b, swa_b = PoolLayout.of(KVPools(Shard(r, size).attention_config(TINY_LLM_CONFIG), 1, 1)).token_bytes()
        total += (length - prefix) * full_b + (length - max(prefix, length - 1 - w)) * swa_b
    return total


def test_tp2_prefill_into_tp2_decode_equals_colocated_one_rank(fleet):
    both, pre, dec = fleet
    turn1 = [1] + [(7 * i) % 200 + 3 for i in range(300)]  # longer than the window: the SWA share is cut
    a1, _ = stream(both.address, ids_request(turn1, 10))
    b1, f1 = stream(dec.address, ids_request(turn1, 10))
    assert a1 == b1 and len(b1) == 10
    assert f1.prefill_address == pre.address and f1.cached_tokens == 0
    assert f1.kv_transfer_bytes == rule_bytes(len(turn1), 0)
    turn2 = turn1 + b1 + [(11 * i) % 200 + 3 for i in range(40)]
    a2, _ = stream(both.address, ids_request(turn2, 10))
    b2, f2 = stream(dec.address, ids_request(turn2, 10))
    assert a2 == b2
    assert f2.cached_tokens >= len(turn1) + len(b1) - 1  # the decode replica's tree holds turn 1
    assert f2.kv_transfer_bytes == rule_bytes(len(turn2), f2.cached_tokens)
    m = scrape(port(dec))
    assert m["llm_pd_remote_prefills"] >= 2 and m["llm_tensor_parallel_size"] == 2


def test_a_decode_worker_at_another_size_is_refused_by_name_and_prefills_locally(fleet):
    both, pre, _ = fleet
    one = start_server(
        COMMON + ["--role", "decode", "--pd-prefill", pre.address, "--pd-local-prefill-tokens", "0"], "llm"
    )
    try:
        prompt = [1] + [(3 * i) % 200 + 3 for i in range(80)]
        want, _ = stream(both.address, ids_request(prompt, 6))
        got, final = stream(one.address, ids_request(prompt, 6))
        assert got == want  # prefilled on the decode worker itself after the refusal
        assert final.prefill_failed_address == pre.address and final.kv_transfer_bytes == 0
        said = "".join(one.stderr_lines)
        assert "tensor-parallel size 1, this prefill worker at 2" in said, said[-3000:]
    finally:
        assert one.stop() == 0
