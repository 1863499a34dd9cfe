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


def _budgeted(order, fcfs=False):
    full, swa = SlotPool("full", 1 << 16, 16), SlotPool("swa", 1 << 14)
    cache = SWARadixCache(full, swa, 128, 16)
    now = [0.0]
    s = Scheduler(
        cache,
        full,
        swa,
        chunk_size=256,
        max_running=4,
        enable_prefix_cache=True,
        release_interval=16,
        fcfs=fcfs,
        wait_penalty=2048.0,
        length_buckets=(),
        clock=lambda: now[0],
        max_prefill_tokens=256,
        prefill_order=order,
    )
    return s, now


def test_prefill_budget_goes_to_the_fewest_tokens_left_first():
    """A 4000-token prompt running and a 300-token one admitted one step later: with one chunk of budget per
    step, `fewest_left` runs the short prompt's two chunks next (done at step 2), `oldest` and FCFS keep
    admission order (done after the long prompt's 16 chunks); slots are reserved oldest first either way."""
    done = {}
    for order, fcfs in (("fewest_left", False), ("oldest", False), ("fewest_left", True)):
        s, now = _budgeted(order, fcfs)
        s.add(Request(0, list(range(4000)), SamplingParams(max_tokens=1, ignore_eos=True), arrival=0.0))
        steps = []
        for step in range(40):
            now[0] += 0.01
            if step == 1:
                s.add(Request(1, list(range(5000, 5300)), SamplingParams(max_tokens=1, ignore_eos=True), now[0]))
            segs = s.schedule()
            if not segs:
                break
            assert sum(g.n for g in segs) <= 256
            assert [g.request.id for g in segs] == sorted(g.request.id for g in segs)  # reserved oldest first
            steps.append([g.request.id for g in segs])
            for g in segs:  # a prompt that reached its end is done (max_tokens 1)
                if g.samples:
                    s.running.remove(g.request)
                    s.finish(g.request, "length")
        done[(order, fcfs)] = max(i for i, ids in enumerate(steps) if 1 in ids)
    assert done[("fewest_left", False)] == 2
    assert done[("oldest", False)] == 16 == done[("fewest_left", True)]  # the long one's last chunk leaves 96
    try:
        _budgeted("newest")
    except ValueError as e:
        assert "prefill_order" in str(e)
    else:
        raise AssertionError("an unknown prefill_order is refused")


def test_prefill_order_changes_nothing_when_the_budget_covers_every_chunk():
    """The order only decides who gets a binding budget: with room for every running prompt's chunk the two
    orders schedule the same segments step by step (simulated worker, real Scheduler)."""
    from llm_backend.sim import CostModel, SimWorker, WorkerConfig, get_shape, load_profile, simulate
    from llm_backend.sim.calibrate import workload
    from llm_backend.sim.trace import SimRequest

    def run(order, budget):
        cfg = WorkerConfig(
            full_tokens=2400, swa_tokens=256, page_size=4, chunk_size=8, max_running=4, unit=1,
            max_prefill_tokens=budget, prefill_order=order,
        )  # fmt: skip
        w = SimWorker(CostModel(get_shape("tiny"), load_profile("cpu-measured")), cfg)
        log, inner = [], w.scheduler.schedule

        def logged():
            segs = inner()
            log.append([(g.request.id, g.start, g.n) for g in segs])
            return segs

        w.scheduler.schedule = logged
        waves = workload(4, waves=3, per_wave=8, max_prompt=300)
        specs = [
            SimRequest(8 * i + j, i * 1e6 + 1e-3 * j, p, len(p), m)
            for i, wv in enumerate(waves)
            for j, (p, m) in enumerate(wv)
        ]
        simulate(w, specs)
        return log

    assert run("oldest", 8192) == run("fewest_left", 8192)
    assert run("oldest", 16) != run("fewest_left", 16)
