"""Read-your-writes for the page-hash index: a pick waits (briefly) for the index to know what a worker answered.

A worker caches a request's blocks before it sends the final response (the engine's finish() runs before the
response is built), and the response carries where its KV-event log stood then: `kv_events_position`,
"EPOCH:SEQ" (generator.proto; `usage.kv_events_position` over HTTP). The feed that brings those events into
the index is a long poll, usually a millisecond behind; on a loaded machine it can be a second behind. An agent
sends its next turn the moment the answer arrives, so without this the router would route that turn on an index
that does not yet hold the previous one (it falls back to `_remember`, which knows the previous prompt's blocks
but not the reply's).

    sync.expect(worker, position)     # from each final response
    await sync.wait(worker ids)       # in pick(), before the index lookup

`wait` returns when, for every listed worker with an expectation, the index has applied that worker's events up
to the position (same epoch, seq >= it), or after `--index-sync-ms` in all. Routers sharing a Redis share the
expectations too (`state.answered` writes a worker's latest answered position, `state.answered_positions` reads
them in one MGET per pick), so a session whose turns alternate between routers is routed on its previous turn
by either. Where the index stands: the router's
own feed (`WorkerFeed.epoch/seq`) when it runs one, else the member record the relay writes (`epoch`, `kv_seq`;
`state.progress`, which also returns the load written with that position: `loads`, for the router to use instead
of its older view of that worker's load). A worker's position moves one step at each final answer (the
worker's load marker, llm_backend/kv/events.py), so the load read with a position that met an answer's
expectation no longer counts the request answered. A worker that made a pick time out is not waited for again until its feed has caught up once
(a stalled feed costs one wait, not one per request). Invariants: an expectation is only ever dropped when met or
timed out; a newer one replaces an older one of the same worker; no wait exceeds `--index-sync-ms`.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)


def parse_position(text: str) -> tuple[str, int] | None:
    epoch, sep, seq = (text or "").rpartition(":")
    if not sep or not epoch or not seq.isdigit():
        return None
    return epoch, int(seq)


class IndexSync:
    def __init__(self, state, feeds: dict, wait_ms: int, ttl_s: float = 3.0):
        self.state, self.feeds, self.wait_s, self.ttl_s = state, feeds, wait_ms / 1e3, ttl_s
        self._writes: set[asyncio.Task] = set()
        self.wants: dict[str, tuple[str, int]] = {}  # worker -> (epoch, seq) its last answer reported
        self.lagging: set[str] = set()  # timed out: not waited for until met once
        self.met: dict[str, tuple[str, int]] = {}  # worker -> the last expectation met (a shared one is not re-read)
        # worker -> the load another router's feed wrote with the position read here ({load fields, "updated"}):
        # newer than this router's own view, which a registry read refreshes only every so often
        self.loads: dict[str, dict] = {}
        self.stats = {"waits": 0, "wait_seconds": 0.0, "timeouts": 0}

    def expect(self, worker: str, position: str) -> None:
        want = parse_position(position)
        if want is None or self.wait_s <= 0:
            return
        self._want(worker, want)
        try:
            task = asyncio.get_running_loop().create_task(self._share(worker, position))
        except RuntimeError:  # no loop (a synchronous caller): this router's own wait still applies
            return
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def shared(self, timeout_s: float | None = None) -> None:
        """Until the answered positions being written have landed in the shared state (at most `timeout_s`, by
        default --index-sync-ms: a write that slow on a loaded machine must still land first): called
        before a final answer goes to the client, so another router that gets the client's next turn the moment
        the answer arrives already sees what to wait for (without it a session alternating between routers could be
        routed on an index without its previous turn: a CI flake)."""
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=self.wait_s if timeout_s is None else timeout_s)

    def _want(self, worker: str, want: tuple[str, int]) -> None:
        done = self.met.get(worker)
        if done is not None and done[0] == want[0] and done[1] >= want[1]:
            return
        old = self.wants.get(worker)
        if old is None or old[0] != want[0] or old[1] < want[1]:
            self.wants[worker] = want

    async def _share(self, worker: str, position: str) -> None:
        try:
            await self.state.answered(worker, position, self.ttl_s)
        except Exception as e:  # StateUnavailable: the router degrades on its next read; never fatal here
            log.debug("sharing %s's answered position failed: %s", worker, e)

    async def _applied(self, worker: str) -> tuple[str, int] | None:
        feed = self.feeds.get(worker)
        if feed is not None and feed.ok:
            return feed.epoch, feed.seq
        position, load = await self.state.progress(worker)
        if load:
            self.loads[worker] = load
        return parse_position(position)

    async def _met(self, worker: str) -> bool:
        want = self.wants.get(worker)
        if want is None:
            return True
        got = await self._applied(worker)
        if got is not None and got[0] == want[0] and got[1] >= want[1]:
            self.met[worker] = got
            if self.wants.get(worker) == want:
                del self.wants[worker]
            self.lagging.discard(worker)
            return True
        return False

    async def wait(self, workers) -> None:
        """Until the index holds every listed worker's answered events, or --index-sync-ms (raises StateUnavailable
        from a state read, like a lookup)."""
        if self.wait_s <= 0:
            return
        for w, text in (await self.state.answered_positions(workers)).items():  # other routers' answers
            want = parse_position(text)
            if want is not None:
                self._want(w, want)
        pending = [w for w in workers if w in self.wants]
        if not pending:
            return
        for w in [w for w in pending if w in self.lagging]:
            if await self._met(w):
                continue
            pending.remove(w)  # known to lag: not waited for (its expectation stays, to be met later)
        pending = [w for w in pending if not await self._met(w)]
        if not pending:
            return
        t0 = time.monotonic()
        deadline = t0 + self.wait_s
        self.stats["waits"] += 1
        local = all(w in self.feeds and self.feeds[w].ok for w in pending)
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(0.002 if local else 0.005)
            pending = [w for w in pending if not await self._met(w)]
        self.stats["wait_seconds"] += time.monotonic() - t0
        for w in pending:
            self.stats["timeouts"] += 1
            self.lagging.add(w)
            log.warning(
                "LLM worker %s: the index had not reached its last answer after --index-sync-ms %d; routing on what "
                "it holds (not waiting for this worker again until its events catch up)",
                w,
                round(self.wait_s * 1e3),
            )
