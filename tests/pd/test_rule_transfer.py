"""The transfer rule (which positions move) and the Mooncake engine wrapper moving exactly those rows."""

from __future__ import annotations

import pytest
import torch

from llm_backend.kv.transfer import KVTransferEngine, PoolLayout, TransferError, runs
from llm_backend.models import TINY_LLM_CONFIG
from llm_backend.paged_attention import KVPools
from llm_backend.pd.rule import TransferRule


def test_rule_ranges_and_bytes():
    r = TransferRule(length=100, decode_prefix=0, window=16)
    # the window before the last page boundary inside the prompt (99 with page 1), and what follows
    assert r.full_range == (0, 100) and r.swa_range == (83, 100)
    assert r.bytes(10, 3) == 100 * 10 + 17 * 3  # full tokens x full bytes + min(L, W + 1) x SWA bytes
    paged = TransferRule(length=100, decode_prefix=0, window=16, page=32)
    assert paged.swa_range == (96 - 16, 100)  # the last boundary below 100 is 96
    assert r.full_kv_bytes(10, 3) == 100 * 13
    short = TransferRule(length=5, decode_prefix=0, window=16)
    assert short.swa_range == (0, 5) and short.bytes(10, 3) == 5 * 13
    turn2 = TransferRule(length=100, decode_prefix=96, window=16)  # the decode side holds the first turn
    assert turn2.full_range == (96, 100) and turn2.swa_range == (96, 100) and turn2.bytes(10, 3) == 4 * 13
    assert turn2.full_pages(4) == 1 and TransferRule(10, 4, 2).full_pages(4) == 2
    assert r.clip("swa", 80, 90) == (83, 90) and r.clip("full", 80, 90) == (80, 90)
    for bad in ((10, 10, 4), (10, -1, 4), (10, 0, -1), (10, 0, 4, 0)):
        with pytest.raises(ValueError):
            TransferRule(*bad)


def test_runs_merge_only_when_both_sides_are_contiguous():
    assert runs([3, 4, 5, 9], [10, 11, 12, 13]) == [(3, 10, 3), (9, 13, 1)]
    assert runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    assert runs([], []) == []
    with pytest.raises(ValueError):
        runs([1], [])


def _pools(seed: int | None):
    pools = KVPools(TINY_LLM_CONFIG, 64, 32)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for d in (pools.k, pools.v):
            for t in d.values():
                t.copy_(torch.randn(t.shape, generator=g))
    return pools


def test_write_moves_exactly_the_rule_rows_between_two_engines():
    src, dst = _pools(0), _pools(None)
    a, b = KVTransferEngine(src), KVTransferEngine(dst)
    try:
        full_src, full_dst = [5, 6, 7, 20], [40, 41, 42, 43]
        swa_src, swa_dst = [3, 4], [10, 30]
        n = a.write(b.session, b.layout, (full_src, full_dst), (swa_src, swa_dst))
        full_b, swa_b = a.layout.token_bytes()
        assert n == 4 * full_b + 2 * swa_b == a.bytes_written
        for i in src.k:
            pairs = zip(swa_src, swa_dst) if src.sliding[i] else zip(full_src, full_dst)
            moved = set()
            for s, d in pairs:
                assert torch.equal(dst.k[i][d], src.k[i][s]) and torch.equal(dst.v[i][d], src.v[i][s])
                moved.add(d)
            others = [j for j in range(dst.k[i].shape[0]) if j not in moved]
            assert not dst.k[i][others].any() and not dst.v[i][others].any()  # nothing else was written
    finally:
        a.close()
        b.close()


def test_a_peer_that_is_gone_or_different_is_refused():
    src, dst = _pools(1), _pools(None)
    a = KVTransferEngine(src)
    try:
        with pytest.raises(TransferError):
            a.write("127.0.0.1:1", PoolLayout.of(dst), ([1], [2]), ([], []))
        other = KVPools(TINY_LLM_CONFIG, 64, 32, dtype=torch.float16)
        with pytest.raises(ValueError, match="not the same model or dtype"):
            a.layout.check_peer(PoolLayout.of(other))
        a.layout.check_peer(PoolLayout.of(dst))
    finally:
        a.close()
