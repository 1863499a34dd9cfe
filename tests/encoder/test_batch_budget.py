"""The batch budget follows the queue: it grows while the forward is behind (batches close on the budget with
items left queued) and returns to the base when the forward keeps up; the batcher closes batches on it."""

import asyncio

import torch

from encoder_server.batch_budget import BatchBudget, QueueFollowingBudget
from encoder_server.batcher import Batcher, BatchItem
from tests.encoder.test_batcher import FakeJob


def test_fixed_budget_never_moves():
    b = BatchBudget(1000, 5.0)
    for _ in range(10):
        b.closed(1000, True, 50)
    assert (b.tokens, b.wait_s) == (1000, 0.005)


def test_grows_under_backlog_up_to_the_peak_and_back_when_the_forward_keeps_up():
    b = QueueFollowingBudget(1000, 5.0, 8000, 20.0)
    sizes = []
    for _ in range(10):
        b.closed(b.tokens, True, 7)
        sizes.append(b.tokens)
        assert 1000 <= b.tokens <= 8000 and 0.005 <= b.wait_s <= 0.020
    assert sizes == sorted(sizes) and b.tokens == 8000 and b.wait_s == 0.020
    b.closed(3000, False, 3)  # closed on time with items queued: no change
    assert b.tokens == 8000
    for _ in range(30):
        b.closed(500, False, 0)  # nothing left queued: shrink
    assert (b.tokens, b.wait_s) == (1000, 0.005)


def test_backlog_after_a_batch_that_was_not_full_does_not_grow_it():
    b = QueueFollowingBudget(1000, 5.0, 8000, 20.0)
    b.closed(400, False, 5)
    assert b.tokens == 1000


def test_batcher_takes_bigger_batches_while_items_stay_queued():
    async def go():
        # waits far longer than the test: every batch closes on its budget, none on time
        budget = QueueFollowingBudget(100, 5000.0, 400, 10000.0)
        b = Batcher(lambda pv, g: pv, max_batch_tokens=100, max_wait_ms=5000.0, queue_depth=256, budget=budget)
        for i in range(59):
            await b.submit(BatchItem(torch.zeros(20, 4), (1, 2, 10), FakeJob(str(i))))
        sizes = []
        while not b.queue.empty() or b._held is not None:
            sizes.append(len(await b.collect()))
        return sizes, budget

    sizes, budget = asyncio.run(go())
    assert sizes == [5, 7, 11, 16, 20]  # 100 patches, x1.5 per backlogged batch, up to the 400-patch peak
    assert budget.tokens == 320  # the last batch left nothing queued: shrinking back
