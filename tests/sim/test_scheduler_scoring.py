"""The scheduler scores a long waiting queue read-only and within a bounded number of cache peeks per step."""

from llm_backend.engine.request import Request, SamplingParams
from llm_backend.engine.scheduler import REFRESH_PER_STEP, Scheduler
from llm_backend.kv import RequestKV, SlotPool, SWARadixCache


def _scheduler(max_running=4):
    full, swa = SlotPool("full", 1 << 16, 16), SlotPool("swa", 1 << 14)
    cache = SWARadixCache(full, swa, 128, 16)
    # A cached system prompt, so peeks walk a real path.
    kv = RequestKV(cache, [])
    system = list(range(1000, 1512))
    kv.extend(system)
    kv.finish(cache_result=True)
    now = [0.0]
    s = Scheduler(
        cache,
        full,
        swa,
        chunk_size=256,
        max_running=max_running,
        enable_prefix_cache=True,
        release_interval=16,
        fcfs=False,
        wait_penalty=2048.0,
        length_buckets=(),
        clock=lambda: now[0],
    )
    return s, cache, system, now


def test_one_step_with_3000_waiting_peeks_a_bounded_number_of_times():
    s, cache, system, now = _scheduler()
    for i in range(3000):
        prompt = (system if i % 2 else []) + [i % 256, (i // 256) % 256, 7, 8, 9]
        s.add(Request(i, prompt, SamplingParams(max_tokens=2, ignore_eos=True), arrival=i * 1e-3))
    calls = [0]
    inner = cache.peek_prefix_length

    def counted(tokens):
        calls[0] += 1
        return inner(tokens)

    cache.peek_prefix_length = counted
    for step in range(5):
        now[0] += 0.01
        calls[0] = 0
        admitted_before = len(s.admitted)
        segments = s.schedule()
        admitted = len(s.admitted) - admitted_before
        assert segments
        assert calls[0] <= REFRESH_PER_STEP + admitted, (step, calls[0], admitted)
        # finish everything that ran so the next step admits again
        for seg in segments:
            s.running.remove(seg.request)
            s.finish(seg.request, "abort")
    assert len(s.waiting) == 3000 - 5 * 4


def test_memos_are_refreshed_so_new_cache_content_changes_the_pick():
    """The bound is not a freeze: a waiting request whose prefix got cached later is seen as cheap within a few steps."""
    s, cache, system, now = _scheduler(max_running=1)
    late = list(range(5000, 5600)) + [1, 2, 3]
    for i in range(40):
        s.add(Request(i, [i + 1] * 300, SamplingParams(max_tokens=1, ignore_eos=True), arrival=0.0))
    target = Request(99, late, SamplingParams(max_tokens=1, ignore_eos=True), arrival=0.0)
    s.add(target)  # 603 uncached now: picked last
    kv = RequestKV(cache, [])
    kv.extend(late[:592])
    kv.finish(cache_result=True)  # now it is almost entirely cached
    s.schedule()
    assert s.admitted == [99]
