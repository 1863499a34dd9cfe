"""Admission: how many items the server holds at once (`--max-pending`, the `--no-pipeline` lock), and
de-duplication of identical items in flight (same content key: encoded once, the rest attach)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from ..errors import ItemError, invalid
from .jobs import Job


class Admission:
    """Counts items admitted and not yet answered; refuses a request that would go over `max_pending`.

    With `serial` (`--no-pipeline`) requests run one at a time; those queued for the lock count against
    `max_pending` too, so a queue of waiting requests cannot grow without end either."""

    def __init__(self, max_pending: int, serial: bool = False):
        self.max_pending = max_pending
        self.pending = 0  # admitted, being worked on
        self.waiting = 0  # admitted, queued for the serial lock
        self._lock = asyncio.Lock() if serial else None

    @property
    def load(self) -> int:
        return self.pending + self.waiting

    def _check_capacity(self, n: int) -> None:
        if self.load + n > self.max_pending:
            raise ItemError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server is at capacity ({self.load} items pending, --max-pending {self.max_pending}); retry later",
            )

    @contextlib.asynccontextmanager
    async def admit(self, n: int):
        """Holds `n` items' worth of capacity for the body; raises RESOURCE_EXHAUSTED when there is none."""
        if n > self.max_pending:  # could never be admitted, however long the client waits
            raise invalid(
                f"request has {n} items, more than this server ever admits at once "
                f"(--max-pending {self.max_pending}); split it"
            )
        self._check_capacity(n)
        if self._lock is not None:
            self.waiting += n
            try:
                await self._lock.acquire()
            finally:
                self.waiting -= n
        self.pending += n
        try:
            yield
        finally:
            self.pending -= n
            if self._lock is not None:
                self._lock.release()


class InflightTable:
    """Identical items in flight at the same time: the first is the leader, later ones follow it."""

    def __init__(self):
        self._leaders: dict[str, Job] = {}

    def lead_or_follow(self, job: Job) -> bool:
        """True: `job` leads (encode it). False: it follows a leader and is answered with its result."""
        leader = self._leaders.get(job.key)
        if leader is not None and leader.wanted:
            leader.followers.append(job)
            return False
        self._leaders[job.key] = job
        job.future.add_done_callback(lambda _f, j=job: self._forget(j))
        return True

    def _forget(self, job: Job) -> None:
        if self._leaders.get(job.key) is job:
            del self._leaders[job.key]
