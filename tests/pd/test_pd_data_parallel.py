"""P/D with data-parallel attention on both sides, real processes: two prefill workers that are one DP group and
two decode workers that are another (`--dp 2 --enable-expert-parallel`, each group sharing its experts over gloo),
each decode rank asking the prefill rank of its number, every worker with its own Mooncake transfer engine over
TCP. Greedy outputs equal a colocated one-rank worker's over two turns on both decode ranks at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from llm_backend.parallel.replica import free_init_method
from tests.conftest import start_server
from tests.pd.test_pd_live import COMMON, ids_request, stream

pytestmark = pytest.mark.integration


def _group(extra_of) -> list:
    """Two DP workers started together (each waits for the other to join)."""
    addr = free_init_method().removeprefix("tcp://")
    dp = ["--dp", "2", "--enable-expert-parallel", "--dist-init-addr", addr]
    with ThreadPoolExecutor(2) as pool:
        return list(
            pool.map(
                lambda r: start_server([*COMMON, *dp, "--data-parallel-rank", str(r), *extra_of(r)], "llm"), [0, 1]
            )
        )


def test_dp2_prefill_into_dp2_decode_equals_colocated_one_rank():
    both = start_server(COMMON, "llm")
    pre = _group(lambda r: ["--role", "prefill"])
    dec = _group(lambda r: ["--role", "decode", "--pd-prefill", pre[r].address, "--pd-local-prefill-tokens", "0"])
    try:
        turns = [[1] + [(7 * i + r) % 200 + 3 for i in range(300)] for r in range(2)]  # past the window
        want = [stream(both.address, ids_request(t, 10))[0] for t in turns]
        with ThreadPoolExecutor(2) as pool:  # both decode ranks at once: their steps and rounds interleave
            got = list(pool.map(lambda r: stream(dec[r].address, ids_request(turns[r], 10)), [0, 1]))
        assert [g[0] for g in got] == want
        for r, (_, final) in enumerate(got):
            assert final.prefill_address == pre[r].address and final.kv_transfer_bytes > 0
        nxt = [t + w + [(11 * i) % 200 + 3 for i in range(40)] for t, w in zip(turns, want)]
        want2 = [stream(both.address, ids_request(t, 10))[0] for t in nxt]
        with ThreadPoolExecutor(2) as pool:
            got2 = list(pool.map(lambda r: stream(dec[r].address, ids_request(nxt[r], 10)), [0, 1]))
        assert [g[0] for g in got2] == want2
        assert all(final.cached_tokens >= len(turns[r]) for r, (_, final) in enumerate(got2))  # each rank's own tree
    finally:
        for s in (*dec, *pre, both):
            s.proc.terminate()
        for s in (*dec, *pre, both):
            s.proc.wait(timeout=30)
