"""The decode role: reserves a request's pages, has a prefill worker fill them, then decodes it.

SGLang's handshake shape, one room per attempt:
1. `DecodeScheduler.add` decides where the prompt is prefilled (conditional disaggregation): here when no prefill
   worker is named, or when its tokens not in this worker's prefix cache are at most `--pd-local-prefill-tokens`
   (the plain scheduler path); otherwise the request queues for a transfer.
2. At admission (while fewer than `--max-running` requests run or transfer) the request takes its prefix match
   from this worker's own SWA-aware radix cache (`decode_prefix`, locked) and allocates the rest of the prompt:
   full pages for `[decode_prefix, L)`, and SWA slots it keeps only for the window `[max(decode_prefix, L - W), L)`
   (allocated chunk by chunk, older ones released at once, so the SWA pool never holds more than a window and a
   chunk of it). The room (slot indices, this worker's pool layout and transfer session) goes to the prefill worker
   through the role's `TransferPort` (`KVTransfer/Prefill` over gRPC: server/kv_transfer.py's `PrefillClient`); the request waits in `transferring`, holding its pages.
3. The prefill worker writes the KV straight into those slots (Mooncake) and sends the first token last. The
   request then checkpoints its prompt pages into the tree (the next turn of the conversation matches them, so it
   transfers only its new tokens), appends the first token and decodes like any other. A seeded request takes the
   prefill side's generator state with the first token, so its samples are the ones a colocated worker draws.

Failure rules (docs/pd.md): a transfer fails when the stream to the prefill worker breaks (it died), when it sends
nothing for `--pd-transfer-timeout-s` (it hangs; it sends a keep-alive every second), or when the prefill worker
refuses the room. No token has reached the client then, so the request is prefilled here instead (the plain
scheduler path, from its prompt: the output is the colocated one), at most `--pd-retries` times; past that (or with
0) it ends with an error coded "unavailable" (gRPC UNAVAILABLE, HTTP 503), never as a normal finish. The failed
room is fenced as below either way: the retry takes fresh slots. An abort (the client went away) ends the request at
once. This worker's health never depends on a prefill worker: without one it prefills locally.

Fencing: the pages of a room given up on (failed, timed out, aborted) are never cached (they may be half written)
and are not freed at once either: they stay *fenced* (held, counted in `pd_fenced_rooms`) until the prefill
worker answers `KVTransfer/Release` (it closed the room: no write of it in flight, none to come) or turns out to be
gone (UNAVAILABLE: a dead process writes nothing), so a late write can never land in slots another request was
given. A prefill worker that answers neither for `--pd-fence-timeout-s` (it hangs) has them freed anyway, with a
warning (`pd_fence_expired`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from llm_backend.engine.interfaces import Ticket, TransferPort
from llm_backend.engine.request import Request
from llm_backend.engine.sampler import Sampled
from llm_backend.engine.scheduler import Scheduler
from llm_backend.kv import PoolExhausted, RequestKV

from .rule import TransferRule

log = logging.getLogger(__name__)


@dataclass
class PDTicket(Ticket):
    """A decode worker's request: where it may be prefilled and what the prefill worker needs besides its ids.
    Kept by the decode scheduler (keyed by request id) while the request lives; what the server reports goes to
    the request's `stats` (prefill worker used, KV bytes and seconds, the failed one)."""

    prefill: str = ""
    media_items: list = field(default_factory=list)
    room: DecodeRoom | None = None  # the transfer under way
    retries: int = 0  # failed transfers this request was prefilled here after


@dataclass
class DecodeRoom:
    name: str
    prefill: str
    rule: TransferRule
    full_slots: list[int]
    swa_slots: list[int]
    deadline: float
    media_items: list = field(default_factory=list)  # the request's media, for the prefill worker to encode
    call: Any = None  # the gRPC call, once started (the port's)
    cancelled: bool = False


@dataclass(frozen=True)
class DecodeSettings:
    """The decode role's flags (docs/pd.md)."""

    local_prefill_tokens: int = 0  # --pd-local-prefill-tokens (-1: never local)
    transfer_timeout_s: float = 30.0  # --pd-transfer-timeout-s
    fence_timeout_s: float = 60.0  # --pd-fence-timeout-s
    retries: int = 1  # --pd-retries

    @classmethod
    def from_config(cls, cfg) -> DecodeSettings:
        return cls(cfg.pd_local_prefill_tokens, cfg.pd_transfer_timeout_s, cfg.pd_fence_timeout_s, cfg.pd_retries)


@dataclass
class DecodeRole:
    """The decode role as the engine sees it (`SchedulerRole`): its settings and its transfer port (None: every
    prompt is prefilled here)."""

    settings: DecodeSettings
    port: TransferPort | None = None

    def scheduler(self, cache, full_pool, swa_pool, wake: Callable[[], None], **parts) -> DecodeScheduler:
        return DecodeScheduler(cache, full_pool, swa_pool, wake=wake, settings=self.settings, port=self.port, **parts)


_rooms = itertools.count()


class DecodeScheduler(Scheduler):
    """The scheduler of a decode worker: requests wait for their KV in `transferring` before they run."""

    def __init__(
        self,
        cache,
        full_pool,
        swa_pool,
        *,
        wake: Callable[[], None],
        settings: DecodeSettings,
        port: TransferPort | None = None,
        **parts,
    ):
        super().__init__(cache, full_pool, swa_pool, **parts)
        self.settings, self.port, self.wake = settings, port, wake
        self.local_prefill_tokens = settings.local_prefill_tokens
        self.transfer_timeout_s = settings.transfer_timeout_s
        self.fence_timeout_s = settings.fence_timeout_s
        self.retries = settings.retries
        self.tickets: dict[int, PDTicket] = {}  # request id -> its ticket, while it lives
        self.pd_waiting: list[Request] = []
        self.transferring: list[Request] = []
        self.fenced: dict[str, tuple[RequestKV, float]] = {}  # room -> (its pages, when they are freed anyway)
        self.inbox: deque = deque()  # (request, room name, kind, payload) from the port's threads
        self._blocked = False
        self.remote = self.local = self.failed = self.timeouts = self.aborted_transfers = self.fence_expired = 0
        self.retried = 0
        self.bytes_received = 0
        self.transfer_s = 0.0

    def metrics(self) -> dict:
        return {
            "pd_remote_prefills": self.remote,
            "pd_local_prefills": self.local,
            "pd_transfer_failures": self.failed,
            "pd_transfer_timeouts": self.timeouts,
            "pd_transfer_aborts": self.aborted_transfers,
            "pd_transfer_bytes": self.bytes_received,
            "pd_transfer_seconds": self.transfer_s,
            "pd_transferring": len(self.transferring),
            "pd_waiting_for_transfer": len(self.pd_waiting),
            "pd_fenced_rooms": len(self.fenced),
            "pd_fence_expired": self.fence_expired,
            "pd_retried_locally": self.retried,
        }

    def load_views(self):
        """Requests waiting for a transfer count as queued, those receiving their KV as running (they hold it)."""
        waiting, running = super().load_views()
        return waiting + list(self.pd_waiting), running + list(self.transferring)

    # ----------------------------------------------------------------------------------- where it is prefilled
    def add(self, r: Request, ticket: Ticket | None = None) -> None:
        if ticket is not None and not isinstance(ticket, PDTicket):
            raise ValueError(f"a decode worker takes a PDTicket, not a {type(ticket).__name__}")
        if ticket is None or not ticket.prefill or self.port is None:
            self.local += 1
            return super().add(r)
        self.check_fits(len(r.prompt))
        self.tickets[r.id] = ticket
        hit = self.cache.peek_prefix_length(r.prompt[:-1]) if self.enable_prefix_cache else 0
        if self.local_prefill_tokens >= 0 and len(r.prompt) - hit <= self.local_prefill_tokens:
            self.local += 1
            return super().add(r)
        self.pd_waiting.append(r)

    def has_work(self) -> bool:
        if super().has_work() or self.inbox:
            return True
        if self.pd_waiting and not self._blocked and len(self.transferring) < self.max_running:
            return True
        now = self.clock()
        return any(r.aborted or now > self._room(r).deadline for r in self.transferring) or any(
            now > deadline for _, deadline in self.fenced.values()
        )

    def post(self, r: Request | None, room: str, kind: str, payload: Any = None) -> None:
        """News of a room (any thread): read by the engine loop, which this wakes."""
        self.inbox.append((r, room, kind, payload))
        self.wake()

    def _room(self, r: Request) -> DecodeRoom:
        room = self.tickets[r.id].room
        assert room is not None, "a transferring request has its room"
        return room

    def finish(self, r: Request, reason: str, error: str = "", code: str = "", may_cache: bool | None = None) -> None:
        super().finish(r, reason, error, code, may_cache)
        self.tickets.pop(r.id, None)

    # ----------------------------------------------------------------------------------- one step
    def schedule(self):
        self._read_inbox()
        self._expire()
        self._start_transfers()
        return super().schedule()

    def _read_inbox(self) -> None:
        while self.inbox:
            r, name, kind, payload = self.inbox.popleft()
            if kind == "released":
                self._unfence(name, payload)
                continue
            ticket = self.tickets.get(r.id)
            room = ticket.room if ticket is not None else None
            if r not in self.transferring or room is None or room.name != name:
                continue  # a room that already ended (timed out, aborted)
            if kind == "alive":
                room.deadline = self.clock() + self.transfer_timeout_s
            elif kind == "done":
                self.transferring.remove(r)
                self._activate(r, payload)
            else:
                self.transferring.remove(r)
                self.failed += 1
                self._fence(r)
                self._retry_or_fail(r, payload)

    def _expire(self) -> None:
        now = self.clock()
        for r in list(self.transferring):
            room = self._room(r)
            if r.aborted:
                self.transferring.remove(r)
                self.aborted_transfers += 1
                self._fence(r)
                self.finish(r, r.aborted)
            elif now > room.deadline:
                self.transferring.remove(r)
                self.timeouts += 1
                self._fence(r)
                self._retry_or_fail(r, f"no news from prefill worker {room.prefill} for {self.transfer_timeout_s:g} s")
        for r in [r for r in self.pd_waiting if r.aborted]:
            self.pd_waiting.remove(r)
            self.finish(r, r.aborted)
        for name in [n for n, (_, deadline) in self.fenced.items() if now > deadline]:
            self.fence_expired += 1
            log.warning(
                "room %s: its prefill worker confirmed neither that it stopped writing nor that it is gone in %g s "
                "(--pd-fence-timeout-s); freeing its slots anyway",
                name,
                self.fence_timeout_s,
            )
            self._unfence(name, "expired")

    def _fence(self, r) -> None:
        """A room given up on: its pages leave the request (never cached) and wait for the prefill worker's
        Release before they are freed (module docstring, "Fencing")."""
        room = self._room(r)
        room.cancelled = True
        if r.kv is not None:
            self.fenced[room.name] = (r.kv, self.clock() + self.fence_timeout_s)
            r.kv = None
        if self.port is None:
            self.post(None, room.name, "released")
        else:
            self.port.release(room, functools.partial(self.post, None, room.name, "released"))

    def _unfence(self, name: str, why: Any = None) -> None:
        entry = self.fenced.pop(name, None)
        if entry is not None:
            log.info("room %s: its slots are freed (%s)", name, why or "released")
            entry[0].finish(cache_result=False)

    def _retry_or_fail(self, r, why: str) -> None:
        """A transfer that failed before the first token: prefilled here instead while retries are left, else
        the request ends "unavailable" (module docstring, failure rules)."""
        ticket = self.tickets[r.id]
        if r.aborted:  # the client went away meanwhile: nothing to retry for
            self._blocked = False
            return self.finish(r, r.aborted)
        if ticket.retries >= self.retries or r.output:
            return self._end_transfer(r, "error", why)
        ticket.retries += 1
        self.retried += 1
        self._blocked = False
        log.warning(
            "request %d: KV transfer failed (%s); prefilling it here instead (retry %d of %d)",
            r.id,
            why,
            ticket.retries,
            self.retries,
        )
        r.stats.prefill_failed, ticket.prefill, ticket.room = ticket.prefill, "", None
        r.cached_tokens = 0
        self.prompt_tokens -= len(r.prompt)  # counted again when the plain path admits it
        Scheduler.add(self, r)  # counted in pd_retried_locally (and in pd_remote_prefills, as the transfer it began)

    def _end_transfer(self, r, reason: str, why: str) -> None:
        self._blocked = False
        self.finish(r, reason, f"KV transfer failed ({why}); the request can be retried", "unavailable")

    def _start_transfers(self) -> None:
        while self.pd_waiting and len(self.running) + len(self.transferring) < self.max_running:
            r = self.pd_waiting[0]
            room = self._reserve(r)
            if room is None:
                self._blocked = True
                return
            self._blocked = False
            self.pd_waiting.pop(0)
            self.transferring.append(r)
            self.remote += 1
            self.tickets[r.id].room = room
            assert self.port is not None
            self.port.start(r, room, functools.partial(self.post, r, room.name))

    def _reserve(self, r) -> DecodeRoom | None:
        """Step 2 of the module docstring: the prefix match and the pages for the rest; None if they do not fit."""
        kv = RequestKV(self.cache, r.prompt[:-1] if self.enable_prefix_cache else [], self.release_interval)
        n, dp, w = len(r.prompt), kv.cached_tokens, self.cache.window
        rule = TransferRule(n, dp, w, self.full_pool.page_size)
        if not self.cache.make_room(rule.full_tokens + self.full_pool.page_size, rule.swa_tokens + self.chunk_size):
            kv.finish(cache_result=False)
            return None
        try:
            keep = n - rule.swa_range[0]  # SWA slots kept: the rule's window, not just the last W
            for start in range(dp, n, self.chunk_size):
                end = min(n, start + self.chunk_size)
                kv.extend(r.prompt[start:end])
                kv.release_out_of_window(end - keep + w)
        except PoolExhausted:
            kv.finish(cache_result=False)
            return None
        r.kv = kv
        r.cached_tokens = dp
        self.prompt_tokens += n
        a, b = rule.swa_range
        swa = [kv.swa[p] for p in range(a, b)]
        assert all(s is not None for s in swa), "the window's SWA slots are live"
        return DecodeRoom(
            f"{os.getpid()}-{next(_rooms)}",
            self.tickets[r.id].prefill,
            rule,
            kv.full[dp:n],
            swa,  # type: ignore[arg-type]
            self.clock() + self.transfer_timeout_s,
            self.tickets[r.id].media_items,
        )

    @staticmethod
    def _continue_rng(r, state: bytes) -> None:
        """A seeded request goes on from the prefill side's generator state, so its samples are the colocated ones
        (a state of another device's generator does not fit: logged, the request keeps its own seeded one)."""
        if r.generator is None or not state:
            return
        try:
            r.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except (RuntimeError, ValueError) as e:
            log.warning("request %d: the prefill side's random state does not fit this generator (%s)", r.id, e)

    def _activate(self, r, done) -> None:
        """Step 3: the KV is in; the prompt's pages go into the tree and the first token is appended."""
        kv, st = r.kv, r.stats
        assert kv is not None
        st.prefill_used, st.kv_bytes, st.transfer_s = self._room(r).prefill, int(done.kv_bytes), float(done.transfer_s)
        self.bytes_received += st.kv_bytes
        self.transfer_s += st.transfer_s
        self._blocked = False
        if self.enable_prefix_cache:
            kv.checkpoint()
        self._append(r, Sampled(done.first_token, done.logprob, [(t.token_id, t.logprob) for t in done.top_logprobs]))
        self._continue_rng(r, done.rng_state)
        stop = r.aborted or self._stopped(r)
        if stop:
            self.finish(r, stop)
            return
        self.running.append(r)
        self.admitted.append(r.id)
        r.admitted_at = self.clock()
