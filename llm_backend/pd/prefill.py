"""The prefill role: computes a decode worker's prompt and writes its KV into the decode worker's pools.

The decode worker calls `KVTransfer/Prefill` (protos/mimo_epd/v1/pd.proto) with a *room*: the prompt, its media
items, the decode side's transfer session and pool layout, how many tokens it already holds (`decode_prefix`) and
the slots it reserved for the rest (full slots of `[decode_prefix, L)`, SWA slots of the window only; rule.py).
The prompt runs here as an ordinary request of one output token, through this worker's own SWA-aware prefix
cache. `PrefillScheduler.complete` writes, after every forward and before the step's bookkeeping can release
anything, the KV of the positions computed so far that the room wants (a cached prefix the first time, then each
chunk), as one batched Mooncake write per chunk; so the transfer overlaps the prefill chunk by chunk. The first
token (and its logprob) goes back on the stream last, after the last chunk's write returned. The request then
finishes as any other: its pages go into this worker's tree (cached, not held for the decode worker).

Failure rules (docs/pd.md): a failed write (the decode worker is gone) aborts the request here, which frees its
slots at the next step, and fails the stream with UNAVAILABLE; a cancelled stream (the decode side gave up, or
its client did) aborts it the same way. Nothing here waits for a peer: a room never outlives its stream.

Fencing: a room is *closed* before it leaves this worker (its stream ended, or the decode side called
`KVTransfer/Release`). `Room.write` runs under the room's lock and refuses a closed room, and closing takes the
lock, so once `close()` returns no write of the room is in flight and none can follow. `Release` answers only
then; the decode worker frees the slots it reserved for a room it gave up on only after that answer (or once this
process is gone), so a late write can never land in slots that were given to another request. A Release that
arrives before its room (the decode side gave up before the Prefill call got here) leaves a tombstone, and the
room is refused when it comes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from llm_backend.engine.interfaces import Ticket
from llm_backend.engine.request import Request
from llm_backend.engine.scheduler import Scheduler, Segment, SegmentResult

from ..kv.transfer import PoolLayout, TransferError
from .rule import TransferRule

log = logging.getLogger(__name__)


class KVWriter(Protocol):
    """What writes a room's KV: this worker's `KVTransferEngine` (kv/transfer.py), or on a tensor-parallel worker
    `MirroredTransfer` (parallel/mirror.py: each rank writes its own heads into the decode rank of its number)."""

    ranks: tuple[tuple[str, PoolLayout], ...]

    def write_ranks(self, targets, full, swa) -> int: ...


@dataclass(eq=False)
class Room(Ticket):
    """One decode worker's request here: where its KV goes, and how much of it was sent."""

    name: str
    targets: tuple[tuple[str, PoolLayout], ...]  # the decode worker's (session, layout) per rank, rank 0 first
    rule: TransferRule
    dst_full: list[int]
    dst_swa: list[int]
    engine: KVWriter
    sent: int = 0  # positions [0, sent) are written (starts at the decode prefix)
    bytes: int = 0
    transfer_s: float = 0.0
    error: str = ""
    closed: bool = False
    request: Request | None = None  # this worker's request computing the room, once added
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def close(self) -> None:
        """No write of this room is in flight after this returns, and none can start (blocks while one runs)."""
        with self.lock:
            self.closed = True

    def write(self, kv, end: int) -> None:
        """Writes the wanted KV of positions [sent, end) from the request's slots; raises TransferError (also when
        the room was closed: the decode side may have given its slots to another request)."""
        with self.lock:
            if self.closed:
                raise TransferError(f"room {self.name} was closed; its slots are not ours to write")
            self._write(kv, end)

    def _write(self, kv, end: int) -> None:
        if end <= self.sent:
            return
        rule = self.rule
        fa, fb = rule.clip("full", self.sent, end)
        sa, sb = rule.clip("swa", self.sent, end)
        d0, s0 = rule.full_range[0], rule.swa_range[0]
        src_swa = [kv.swa[p] for p in range(sa, sb)] if sb > sa else []
        if any(s is None for s in src_swa):
            raise TransferError(f"room {self.name}: an SWA slot of the window was released before its write")
        t0 = time.perf_counter()
        self.bytes += self.engine.write_ranks(
            self.targets,
            (kv.full[fa:fb] if fb > fa else [], self.dst_full[fa - d0 : fb - d0] if fb > fa else []),
            (src_swa, self.dst_swa[sa - s0 : sb - s0] if sb > sa else []),
        )
        self.transfer_s += time.perf_counter() - t0
        self.sent = end


@dataclass
class PrefillCounters:
    """What the KVTransfer service counts (server/kv_transfer.py); reported with the scheduler's metrics."""

    rooms_served: int = 0  # rooms whose first token went back
    rooms_released: int = 0  # KVTransfer/Release calls


@dataclass
class PrefillRole:
    """The prefill role as the engine sees it (`SchedulerRole`); `counters` are shared with its service."""

    counters: PrefillCounters = field(default_factory=PrefillCounters)

    def scheduler(self, cache, full_pool, swa_pool, wake: Callable[[], None], **parts) -> PrefillScheduler:
        return PrefillScheduler(cache, full_pool, swa_pool, counters=self.counters, **parts)


class PrefillScheduler(Scheduler):
    """The scheduler of a prefill worker: each forward's KV goes to its room before the bookkeeping."""

    def __init__(self, cache, full_pool, swa_pool, *, counters: PrefillCounters, **parts):
        super().__init__(cache, full_pool, swa_pool, **parts)
        self.counters = counters
        self.rooms: dict[int, Room] = {}  # request id -> the room it computes, while it lives
        self.write_failures = self.bytes_written = 0

    def metrics(self) -> dict:
        return {
            "pd_rooms_served": self.counters.rooms_served,
            "pd_write_failures": self.write_failures,
            "pd_bytes_written": self.bytes_written,
            "pd_rooms_released": self.counters.rooms_released,
        }

    def add(self, r: Request, ticket: Ticket | None = None) -> None:
        if ticket is not None and not isinstance(ticket, Room):
            raise ValueError(f"a prefill worker takes a Room, not a {type(ticket).__name__}")
        super().add(r)
        if ticket is not None:
            self.rooms[r.id] = ticket

    def finish(self, r: Request, reason: str, error: str = "", code: str = "", may_cache: bool | None = None) -> None:
        super().finish(r, reason, error, code, may_cache)
        self.rooms.pop(r.id, None)

    def complete(self, segments: list[Segment], results: list[SegmentResult]) -> None:
        keep_s, keep_r = [], []
        for seg, res in zip(segments, results):
            r = seg.request
            room = self.rooms.get(r.id)
            if room is not None and not (res.error or r.done or r.aborted or room.error):
                try:
                    before = room.bytes
                    room.write(r.kv, seg.start + seg.n)
                    self.bytes_written += room.bytes - before
                except TransferError as e:
                    room.error = str(e)
                    if room.closed:  # released by the decode side between the check and the write
                        log.info("room %s: %s", room.name, e)
                    else:
                        self.write_failures += 1
                        log.warning("room %s: %s; dropping it", room.name, e)
                    r.aborted = "abort"  # freed at the next step, nothing of it sampled
                    continue
            keep_s.append(seg)
            keep_r.append(res)
        super().complete(keep_s, keep_r)
