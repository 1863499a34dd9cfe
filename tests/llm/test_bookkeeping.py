"""A request keeps counts, not copies: a decode step's bookkeeping (scheduler, request KV) does no work that grows
with the context. Checked on the real scheduler and KV classes with a runner that samples a fixed token, at a
1M-token context against a 1K-token one: Python lines executed (a loop over the context would add ~1M) and memory
allocated (a copy of the token list would add ~8 MB) during one decode step."""

from __future__ import annotations

import sys
import tracemalloc

import pytest

from llm_backend.engine.request import Request, SamplingParams
from llm_backend.engine.sampler import Sampled
from llm_backend.engine.scheduler import Scheduler, SegmentResult
from llm_backend.kv import SlotPool, SWARadixCache

WINDOW, PAGE, CHUNK = 128, 16, 1 << 16


def _scheduler(context: int, prefix_cache: bool, full_slots: int = 0) -> Scheduler:
    full = SlotPool("full", full_slots or context + 4 * CHUNK, PAGE)
    swa = SlotPool("swa", 2 * CHUNK + 4 * WINDOW)
    return Scheduler(
        SWARadixCache(full, swa, WINDOW, PAGE),
        full,
        swa,
        chunk_size=CHUNK,
        max_running=4,
        enable_prefix_cache=prefix_cache,
        release_interval=16,
        fcfs=True,
        wait_penalty=0.0,
        length_buckets=(),
    )


def _step(s: Scheduler) -> None:
    segments = s.schedule()
    results = [SegmentResult(Sampled(7, 0.0, []) if seg.samples else None, []) for seg in segments]
    s.complete(segments, results)


def _decode_step_cost(context: int, prefix_cache: bool) -> tuple[int, int]:
    """(lines executed in llm_backend, bytes allocated at peak) of one decode step of a request with `context`
    prompt tokens, after its prefill and a few decode steps."""
    s = _scheduler(context, prefix_cache)
    r = Request(0, [i % 251 for i in range(context)], SamplingParams(max_tokens=64, ignore_eos=True), 0.0)
    s.add(r)
    while len(r.output) < 20:  # the prefill (chunk by chunk), then decode steps
        _step(s)
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        if "llm_backend" not in frame.f_code.co_filename:
            return None
        if event == "line":
            lines += 1
        return tracer

    tracemalloc.start()
    sys.settrace(tracer)
    try:
        _step(s)
    finally:
        sys.settrace(None)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert len(r.output) == 21 and r.tokens == r.prompt + r.output
    return lines, peak


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_a_decode_step_does_not_grow_with_the_context(prefix_cache):
    """Without the prefix cache every position is the request's own (nothing moves into the tree)."""
    short_lines, short_peak = _decode_step_cost(1 << 10, prefix_cache)
    long_lines, long_peak = _decode_step_cost(1 << 20, prefix_cache)
    assert long_lines <= short_lines + 50, (short_lines, long_lines)
    assert long_peak < 256 * 1024, long_peak  # a copy of 1M token ids would be ~8 MB


def test_tokens_grow_in_place():
    r = Request(0, [1, 2, 3], SamplingParams(), 0.0)
    view = r.tokens
    r.append_token(9)
    assert r.tokens is view and view == [1, 2, 3, 9] and r.output == [9] and r.prompt == [1, 2, 3]


def test_admission_walks_the_tree_only_when_free_slots_are_not_enough(monkeypatch):
    """A cache holding many prompts: admitting a new one while free slots suffice walks no node (the evictable count
    is the only tree-wide figure admission needs, and only when the free slots are short); once the pool is full of
    cached prompts, admission counts the evictable slots at most once a step and still admits (by evicting)."""
    s = _scheduler(0, True, full_slots=64 * 40)
    walks = []
    real = s.cache.full_evictable
    monkeypatch.setattr(s.cache, "full_evictable", lambda: walks.append(1) or real())

    def run(i: int) -> None:
        r = Request(i, [(i * 7 + j) % 251 + 1000 * i for j in range(60)], SamplingParams(max_tokens=2), 0.0)
        s.add(r)
        keep = Request(10_000 + i, [5] * 40, SamplingParams(max_tokens=3), 0.0)  # running beside it
        s.add(keep)
        while s.has_work():
            _step(s)
        assert r.done and keep.done and r.finish_reason == "length"

    for i in range(8):  # 8 prompts of 60 tokens cached, the pool (2,560 slots) mostly free
        run(i)
    assert walks == []
    for i in range(8, 60):  # far more than the pool holds: admission needs the evictable slots
        run(i)
    assert 0 < len(walks) and s.cache.stats.full_evicted > 0
