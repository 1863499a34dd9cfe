"""Batcher policy: token budget, wait window, arrival order (no starvation), abandoned items."""

import asyncio

import torch

from encoder_server.batcher import Batcher, BatchItem


class FakeJob:
    def __init__(self, name, wanted=True):
        self.name, self._wanted, self.error = name, wanted, None

    @property
    def wanted(self):
        return self._wanted

    def fail(self, err):
        self.error = err


def item(name, patches, wanted=True):
    return BatchItem(torch.zeros(patches, 4), (1, 2, patches // 2), FakeJob(name, wanted))


def run(coro):
    return asyncio.run(coro)


def make(**kw):
    kw.setdefault("max_batch_tokens", 100)
    kw.setdefault("max_wait_ms", 20)
    kw.setdefault("queue_depth", 64)
    return Batcher(lambda pv, g: pv, **kw)


def test_budget_closes_batch_and_oversized_item_heads_next_batch():
    async def go():
        b = make()
        for name, n in [("a", 40), ("b", 40), ("c", 40), ("d", 8)]:
            await b.submit(item(name, n))
        first = [x.job.name for x in await b.collect()]
        second = [x.job.name for x in await b.collect()]
        return first, second

    first, second = run(go())
    assert first == ["a", "b"]  # c would exceed 100
    assert second == ["c", "d"]  # c is held and leads: arrival order kept


def test_item_larger_than_budget_runs_alone_and_is_not_starved():
    async def go():
        b = make(max_batch_tokens=50)
        await b.submit(item("huge", 400))
        for i in range(5):
            await b.submit(item(f"s{i}", 10))
        return [[x.job.name for x in await b.collect()] for _ in range(2)]

    batches = run(go())
    assert batches[0] == ["huge"]
    assert batches[1] == ["s0", "s1", "s2", "s3", "s4"]


def test_wait_window_closes_a_partial_batch():
    async def go():
        b = make(max_wait_ms=30)
        await b.submit(item("a", 10))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        batch = await b.collect()
        return [x.job.name for x in batch], loop.time() - t0

    names, waited = run(go())
    assert names == ["a"]
    assert waited >= 0.025


def test_late_item_within_window_joins_and_none_is_lost():
    async def go():
        b = make(max_wait_ms=200)
        await b.submit(item("a", 10))

        async def late():
            await asyncio.sleep(0.02)
            await b.submit(item("b", 10))

        asyncio.get_running_loop().create_task(late())
        first = [x.job.name for x in await b.collect()]
        b.budget.wait_s = 0.01
        await b.submit(item("c", 10))
        second = [x.job.name for x in await b.collect()]
        return first, second

    first, second = run(go())
    assert first == ["a", "b"] and second == ["c"]


def test_abandoned_items_are_dropped():
    async def go():
        b = make()
        await b.submit(item("a", 10, wanted=False))
        await b.submit(item("b", 10))
        return [x.job.name for x in await b.collect()]

    assert run(go()) == ["b"]


def test_run_splits_outputs_per_item_and_reports_timings():
    done = []

    def forward(pv, grid):
        # one "token" per 4 patches, value = patch row index
        return torch.arange(pv.shape[0] // 4, dtype=torch.float32)[:, None].expand(-1, 3)

    async def go():
        b = Batcher(
            forward,
            on_done=lambda it, emb, q, e: done.append((it.job.name, emb.shape[0], q, e)),
            max_batch_tokens=100,
            max_wait_ms=1,
            queue_depth=8,
            merge_unit=4,
        )
        task = asyncio.get_running_loop().create_task(b.run())
        await b.submit(item("a", 8))
        await b.submit(item("b", 16))
        for _ in range(100):
            if len(done) == 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        b.shutdown()
        return b.stats

    stats = run(go())
    assert [(n, k) for n, k, _, _ in done] == [("a", 2), ("b", 4)]
    assert all(q >= 0 and e >= 0 for _, _, q, e in done)
    assert stats.items == 2 and stats.patches == 24


def test_forward_error_fails_items_and_batcher_continues():
    calls = []

    def forward(pv, grid):
        calls.append(pv.shape[0])
        if len(calls) == 1:
            raise RuntimeError("boom")
        return torch.zeros(pv.shape[0] // 4, 2)

    async def go():
        ok = []
        b = Batcher(
            forward, on_done=lambda it, *_: ok.append(it.job.name), max_batch_tokens=10, max_wait_ms=1, queue_depth=8
        )
        task = asyncio.get_running_loop().create_task(b.run())
        bad = item("bad", 8)
        await b.submit(bad)
        await asyncio.sleep(0.05)
        await b.submit(item("good", 8))
        for _ in range(100):
            if ok:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        b.shutdown()
        return bad.job.error, ok

    err, ok = run(go())
    assert err is not None and "boom" in str(err)
    assert ok == ["good"]
