"""KV events: what a worker's radix cache holds, page by page, for the routers' page-hash index.

A *block* is `block_size` consecutive prompt tokens starting at a multiple of `block_size` (the engine's page
size, or 16 tokens when pages are single tokens). A block is named by a chained hash of everything before it:

    hash(block k) = xxh3_64(hash(block k-1) as 8 little-endian bytes || its tokens as int64 little-endian)

with hash(block -1) = 0, so equal hashes mean equal token prefixes (media placeholder ids, which are >= the
vocabulary, hash like any other token). The router hashes a new prompt the same way and walks its blocks in
order: the blocks a worker holds, from the first, are the prefix it would reuse.

Each block is in one of three states on a worker: absent, stored, or stored *and usable as a match end*. The
second exists because of hybrid SWA (docs/caches.md): a prefix ending at token n is reusable only when the SWA
slots of the W tokens before n are live; once SWA eviction trims or tombstones them, the block's full KV is still
there (a path to deeper blocks) but a match cannot end on it.

`KVEventPublisher` hooks a `SWARadixCache` (`cache.on_event`), turns the tree's changes (a leaf stored, a leaf
removed, a node's SWA slots released or repaired) into block state changes in the engine thread, and keeps a
mirror of the current states plus a numbered log of changes. `poll(epoch, since)` answers a reader with the
changes after `since`, or with the whole mirror (`reset`) when the reader is new, too far behind, or saw another
process (`epoch`). The transport is `mimo_epd.v1.KVEvents/Poll` (`KVEventsService` below), a long poll that the
router (memory state) or the node's relay into Redis (shared state) calls in a loop; the reply also carries the
worker's load (queued and running tokens) for the routing policies.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import numpy as np
import xxhash

from .swa_radix_cache import window_safe_end

ABSENT, STORED, USABLE = 0, 1, 2
DEFAULT_BLOCK = 16
_ZERO = (0).to_bytes(8, "little")


def event_block_size(page_size: int, block: int = DEFAULT_BLOCK) -> int:
    """Blocks are the engine's pages, or `block` tokens when pages are single tokens."""
    return page_size if page_size > 1 else block


def block_hashes(tokens, block: int, known: list[int] | None = None) -> list[int]:
    """The chained hash of every complete block of `tokens`; `known` = the hashes of its first blocks, if computed."""
    out = list(known or [])
    start = len(out) * block
    raw = np.asarray(tokens[start:], dtype="<i8").tobytes()
    step = block * 8
    prev = out[-1].to_bytes(8, "little") if out else _ZERO
    for k in range(len(raw) // step):
        h = xxhash.xxh3_64_intdigest(prev + raw[k * step : (k + 1) * step])
        out.append(h)
        prev = h.to_bytes(8, "little")
    return out


class KVEventPublisher:
    def __init__(self, cache, block_size: int, max_log: int = 200_000):
        if block_size < 1 or block_size % cache.page_size:
            raise ValueError(f"the event block ({block_size}) must be a multiple of the page size ({cache.page_size})")
        self.cache, self.block, self.window = cache, block_size, cache.window
        self.epoch = uuid.uuid4().hex
        self.blocks: dict[int, int] = {}  # hash -> STORED | USABLE: what readers are told the cache holds
        self.seq = 0
        self._log: deque[tuple[int, int, int]] = deque()  # (seq, hash, state)
        self._max_log = max_log
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.load_fn: Callable[[], dict] | None = None  # () -> dict(queued_tokens, running_tokens, waiting, running)
        cache.on_event = self._on_cache_event

    # ----------------------------------------------------------------------------------- engine thread
    def _path(self, node) -> tuple[list[int], list]:
        """Tokens and SWA slots from the root to the end of `node`."""
        chain = []
        while node is not None and node.parent is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        return [t for n in chain for t in n.key], [s for n in chain for s in n.swa]

    def _on_cache_event(self, kind: str, node) -> None:
        tokens, swa = self._path(node)
        end = len(tokens)
        start = end - len(node.key)
        B = self.block
        changes: list[tuple[int, int]] = []
        if kind in ("stored", "removed"):
            first = start // B  # blocks whose last token lies in (start, end]
            ends = range((first + 1) * B, end + 1, B)
            if not ends:
                return
            hashes = block_hashes(tokens[: ends[-1]], B)
            for e in ends:
                h = hashes[e // B - 1]
                state = (USABLE if window_safe_end(swa, e, self.window) else STORED) if kind == "stored" else ABSENT
                changes.append((h, state))
        elif kind == "swa":
            # The node's own blocks, and those of descendants whose window reaches back into it, may have changed.
            limit = end + self.window
            hashes = block_hashes(tokens, B)
            self._swa_changes(node, tokens, swa, start, hashes, limit, changes)
        else:
            raise ValueError(f"unknown cache event {kind!r}")
        self._publish(changes)

    def _swa_changes(self, node, tokens, swa, start, hashes, limit, changes) -> None:
        B, end = self.block, len(tokens)
        for e in range((start // B + 1) * B, end + 1, B):
            h = hashes[e // B - 1]
            if h in self.blocks:
                state = USABLE if window_safe_end(swa, e, self.window) else STORED
                if state != self.blocks[h]:
                    changes.append((h, state))
        if end >= limit:
            return
        for child in node.children.values():
            ctoks, cswa = tokens + child.key, swa + child.swa
            self._swa_changes(child, ctoks, cswa, end, block_hashes(ctoks, B, hashes), limit, changes)

    def _publish(self, changes: list[tuple[int, int]]) -> None:
        if not changes:
            return
        with self._lock:
            for h, state in changes:
                if state == ABSENT:
                    if self.blocks.pop(h, None) is None:
                        continue
                elif self.blocks.get(h) == state:
                    continue
                else:
                    self.blocks[h] = state
                self.seq += 1
                self._log.append((self.seq, h, state))
            while len(self._log) > self._max_log:
                self._log.popleft()
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that loop is closed
                pass

    def answered(self) -> str:
        """The position a final answer reports: the log moves one step with no block in it (a load marker), and
        long polls wake, so the reply that brings a reader to this position carries the load without the request
        just answered. A router that waits for this position (read-your-writes) thus sees the worker's blocks and
        its load as they stand after the answer: without the marker a turn's blocks could arrive with the load
        read while it still ran, and the session's next turn be steered away from its cache by a stale load."""
        with self._lock:
            self.seq += 1
            position = f"{self.epoch}:{self.seq}"
        self._wake()
        return position

    # ----------------------------------------------------------------------------------- readers
    def position(self) -> str:
        """ "EPOCH:SEQ": where the log stands now (a response carries it; kv_events.proto)."""
        with self._lock:
            return f"{self.epoch}:{self.seq}"

    def changes_since(self, epoch: str, since: int) -> tuple[bool, int, list[int], list[int]]:
        """(reset, seq, hashes, states): the changes after `since`, or the whole mirror when `reset`."""
        with self._lock:
            oldest = self._log[0][0] if self._log else self.seq + 1
            if epoch != self.epoch or since > self.seq or since + 1 < oldest:
                items = list(self.blocks.items())
                return True, self.seq, [h for h, _ in items], [s for _, s in items]
            tail = [x for x in self._log if x[0] > since] if since < self.seq else []
            return False, self.seq, [h for _, h, _ in tail], [s for _, _, s in tail]

    async def wait_for_change(self, since: int, timeout_s: float) -> None:
        if self.seq > since or timeout_s <= 0:
            return
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.append(entry)
        try:
            if self.seq <= since:
                await asyncio.wait_for(entry[1].wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.remove(entry)

    def load(self) -> dict:
        if self.load_fn is None:
            return {"queued_tokens": 0, "running_tokens": 0, "waiting": 0, "running": 0}
        return self.load_fn()


def engine_load(engine) -> dict:
    """Queued tokens (prompts not started yet) and running tokens (the KV of running requests) of an LLM engine."""
    waiting, running = engine.scheduler.load_views()
    return {
        "queued_tokens": sum(len(r.prompt) for r in waiting),
        "running_tokens": sum(len(r.prompt) + len(r.output) for r in running),
        "waiting": len(waiting),
        "running": len(running),
    }


class KVEventsService:
    """`mimo_epd.v1.KVEvents/Poll`: long poll of a worker's block states and load (see the module docstring)."""

    def __init__(self, publisher: KVEventPublisher, model: str = "", max_wait_ms: int = 1000, role: str = "both"):
        self.publisher, self.model, self.max_wait_ms, self.role = publisher, model, max_wait_ms, role

    async def Poll(self, request, context):
        from mimo_epd.v1 import kv_events_pb2

        pub = self.publisher
        if request.epoch == pub.epoch:
            await pub.wait_for_change(request.since_seq, min(request.wait_ms, self.max_wait_ms) / 1e3)
        reset, seq, hashes, states = pub.changes_since(request.epoch, request.since_seq)
        load = pub.load()
        return kv_events_pb2.PollReply(
            epoch=pub.epoch,
            seq=seq,
            reset=reset,
            hashes=hashes,
            states=states,
            block_size=pub.block,
            model=self.model,
            load=kv_events_pb2.WorkerLoad(**load),
            time_s=time.time(),
            role=self.role,
        )
