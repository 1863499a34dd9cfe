"""Cross-request batcher: packs preprocessed items from any number of requests into one vision forward.

Policy:
- a batch closes when the next item would push it over the budget's token count (`max_batch_tokens`),
  or when its wait (`max_wait_ms`) has passed since the batch's first item arrived (while a forward
  runs, items queue up, so under load batches fill without waiting); a `QueueFollowingBudget`
  (batch_budget.py) grows both while the forward is behind its queue and shrinks them back after;
- strict arrival order: an item that does not fit is held and becomes the head of the next batch,
  so a large item is never starved by a stream of small ones; an item larger than the whole budget
  runs alone;
- the forward runs in a pool of forward threads, so the event loop keeps fetching, decoding and
  answering; they are the only threads that run the tower (`call_on_forward_thread` for other callers).
  `workers()` says how many forwards may run at once now (at most `max_workers`, the pool's size): with
  one, the next batch is collected when the forward ends (items queue up meanwhile, so batches fill);
  with two, a second batch starts on the second thread while the first runs (the tuner chooses);
- items whose requests were abandoned before their turn are dropped from the batch.

The tower packs variable-size items with block-diagonal attention, so batching never changes an
item's embedding (tests check that a batched item equals the item encoded alone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import torch

from .batch_budget import BatchBudget
from .errors import ItemError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BatchItem:
    pixel_values: torch.Tensor  # [num_patches, patch_dim]
    grid_thw: tuple[int, int, int]
    job: Any  # opaque to the batcher: must have `.wanted` and `.fail(ItemError)`
    enqueued_at: float = field(default_factory=time.perf_counter)

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])


@dataclass
class BatchStats:
    batches: int = 0
    items: int = 0
    patches: int = 0
    busy_s: float = 0.0  # forward seconds, summed over forwards


class Batcher:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        on_done: Callable[[BatchItem, torch.Tensor, float, float], None] | None = None,
        max_batch_tokens: int,
        max_wait_ms: float,
        queue_depth: int,
        merge_unit: int = 4,
        max_batch_items: int | None = None,
        on_batch: Callable[[int, int, float], None] | None = None,
        max_workers: int = 1,
        workers: Callable[[], int] | None = None,
        budget: BatchBudget | None = None,
    ):
        self.forward = forward
        self.on_done = on_done
        self.budget = budget or BatchBudget(max_batch_tokens, max_wait_ms)
        self.merge_unit = merge_unit
        self.max_batch_items = max_batch_items  # 1 = no batching (for comparisons)
        self.on_batch = on_batch
        self.queue: asyncio.Queue[BatchItem] = asyncio.Queue(queue_depth)
        self._next_get: asyncio.Task | None = None  # a pending get survives a timed-out wait: nothing is lost
        self._held: BatchItem | None = None  # did not fit the last batch: heads the next one
        self.max_workers = max(1, max_workers)
        self.workers = workers or (lambda: 1)
        self._executor = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="vision-forward")
        self.stats = BatchStats()

    async def submit(self, item: BatchItem) -> None:
        await self.queue.put(item)

    async def _get(self, timeout: float | None) -> BatchItem | None:
        if self._next_get is None:
            self._next_get = asyncio.ensure_future(self.queue.get())
        if timeout is not None and timeout <= 0 and not self._next_get.done():
            return None
        done, _ = await asyncio.wait({self._next_get}, timeout=timeout)
        if not done:
            return None
        task, self._next_get = self._next_get, None
        return task.result()

    async def collect(self) -> list[BatchItem]:
        """Waits for the next batch (see the policy above)."""
        first, self._held = self._held, None
        if first is None:
            first = await self._get(None)
        batch, tokens = [first], first.num_patches
        limit, deadline = self.budget.tokens, time.perf_counter() + self.budget.wait_s
        on_budget = tokens >= limit
        while not on_budget and (self.max_batch_items is None or len(batch) < self.max_batch_items):
            item = await self._get(deadline - time.perf_counter())
            if item is None:
                break
            if tokens + item.num_patches > limit:
                self._held, on_budget = item, True
                break
            batch.append(item)
            tokens += item.num_patches
            on_budget = tokens >= limit
        waiting = self._held is not None or (self._next_get is not None and self._next_get.done())
        backlog = self.queue.qsize() + waiting
        self.budget.closed(tokens, on_budget, backlog)
        return [b for b in batch if b.job.wanted]

    async def run(self) -> None:
        running: set[asyncio.Future] = set()
        try:
            while True:
                while len(running) >= max(1, min(self.max_workers, self.workers())):
                    done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                batch = await self.collect()
                if batch:
                    running.add(asyncio.ensure_future(self._run_batch(batch)))
        finally:
            for t in running:
                t.cancel()

    async def _run_batch(self, batch: list[BatchItem]) -> None:
        loop = asyncio.get_running_loop()
        pixel_values = torch.cat([b.pixel_values for b in batch]) if len(batch) > 1 else batch[0].pixel_values
        grid = torch.tensor([b.grid_thw for b in batch], dtype=torch.long)
        start = time.perf_counter()
        try:
            out = await loop.run_in_executor(self._executor, self._run_forward, pixel_values, grid)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - fail the batch's items, keep serving
            log.exception("vision forward failed for a batch of %d items", len(batch))
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(e, torch.OutOfMemoryError)
                else grpc.StatusCode.INTERNAL
            )
            for b in batch:
                b.job.fail(ItemError(code, f"vision forward failed: {type(e).__name__}: {e}"))
            return
        end = time.perf_counter()
        self.stats.batches += 1
        self.stats.items += len(batch)
        self.stats.patches += int(pixel_values.shape[0])
        self.stats.busy_s += end - start
        if self.on_batch is not None:
            self.on_batch(len(batch), int(pixel_values.shape[0]), end - start)
        encode_ms = (end - start) * 1e3
        for b, emb in zip(batch, out):
            if self.on_done is not None:
                self.on_done(b, emb, (start - b.enqueued_at) * 1e3, encode_ms)

    def call_on_forward_thread(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Runs `fn(*args)` on a forward thread, after the forwards already queued there. Thread-safe.

        The tower runs only on the forward threads: other users of it (the video path) submit their calls
        here instead of running the model on a thread of their own."""
        return self._executor.submit(fn, *args)

    def _run_forward(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        out = self.forward(pixel_values, grid)
        sizes = (grid.prod(-1) // self.merge_unit).tolist()
        # Each item gets its own CPU copy: a cached embedding must not pin the whole batch's tensor.
        return [t.to("cpu").clone() for t in out.split(sizes)]

    def shutdown(self) -> None:
        if self._next_get is not None:
            self._next_get.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
