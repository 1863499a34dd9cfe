"""Fair scheduling of URL fetches: at most `concurrency` fetches at once in all, at most `per_host` of
them to one host, hosts served round-robin. One slow host (or one client sending many URLs of one host)
therefore holds at most `per_host` fetch slots; fetches from every other host keep flowing.

Only network fetches come here: inline bytes, `data:` URIs and local paths never wait behind a URL."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)


class FairFetchScheduler:
    def __init__(self, run: Callable[[Any], Awaitable[None]], concurrency: int, per_host: int):
        if concurrency <= 0 or per_host <= 0:
            raise ValueError(f"fetch concurrency and per-host cap must be positive, got {concurrency}, {per_host}")
        self._run = run  # fetches one job and hands it on; failures are the callee's to report
        self.concurrency = concurrency
        self.per_host = per_host
        self._queued: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()  # round-robin order
        self._active: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def qsize(self) -> int:
        return sum(len(q) for q in self._queued.values())

    @property
    def active(self) -> int:
        return len(self._tasks)

    def submit(self, job, host: str) -> None:
        if self._closed:
            raise RuntimeError("fetch scheduler is closed")
        self._queued.setdefault(host, collections.deque()).append(job)
        self._dispatch()

    def _dispatch(self) -> None:
        while len(self._tasks) < self.concurrency:
            host = next((h for h, q in self._queued.items() if q and self._active[h] < self.per_host), None)
            if host is None:
                return
            queue = self._queued.pop(host)
            job = queue.popleft()
            if queue:
                self._queued[host] = queue  # to the back: the other hosts go first next time
            if not getattr(job, "wanted", True):  # its request already failed: never fetch it
                continue
            self._active[host] += 1
            task = asyncio.get_running_loop().create_task(self._run(job), name=f"fetch:{host}")
            self._tasks.add(task)
            task.add_done_callback(lambda t, h=host: self._done(t, h))

    def _done(self, task: asyncio.Task, host: str) -> None:
        self._tasks.discard(task)
        self._active[host] -= 1
        if self._active[host] <= 0:
            del self._active[host]
        if not task.cancelled() and task.exception() is not None:  # pragma: no cover - _run reports its own
            log.error("fetch task failed", exc_info=task.exception())
        if not self._closed:
            self._dispatch()

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._queued.clear()
