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

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import grpc

from llm_backend.engine import OverloadedError, SamplingParams
from llm_backend.engine.scheduler import Scheduler, Segment, SegmentResult
from mimo_epd.v1 import pd_pb2, pd_pb2_grpc

from .rule import TransferRule
from .transfer import KVTransferEngine, LayerAddr, PoolLayout, TransferError

log = logging.getLogger(__name__)

SERVICE_NAME = pd_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
# Seconds between keep-alive events on a room's stream while its request waits or runs (the decode side's
# --pd-transfer-timeout-s counts from the last event).
KEEPALIVE_S = 1.0
# Room names released before their Prefill call arrived, kept this long (and at most this many) to refuse it.
TOMBSTONE_S = 600.0
MAX_TOMBSTONES = 65536


@dataclass
class Room:
    """One decode worker's request here: where its KV goes, and how much of it was sent."""

    name: str
    session: str
    peer: PoolLayout
    rule: TransferRule
    dst_full: list[int]
    dst_swa: list[int]
    engine: KVTransferEngine
    sent: int = 0  # positions [0, sent) are written (starts at the decode prefix)
    bytes: int = 0
    transfer_s: float = 0.0
    error: str = ""
    closed: bool = False
    request: Any = None  # this worker's request computing the room, once added
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
        self.bytes += self.engine.write(
            self.session,
            self.peer,
            (kv.full[fa:fb] if fb > fa else [], self.dst_full[fa - d0 : fb - d0] if fb > fa else []),
            (src_swa, self.dst_swa[sa - s0 : sb - s0] if sb > sa else []),
        )
        self.transfer_s += time.perf_counter() - t0
        self.sent = end


class PrefillScheduler(Scheduler):
    """The scheduler of a prefill worker: each forward's KV goes to its room before the bookkeeping."""

    def configure(self, cfg) -> None:
        self.rooms_served = self.write_failures = self.bytes_written = self.rooms_released = 0

    def metrics(self) -> dict:
        return {
            "pd_rooms_served": self.rooms_served,
            "pd_write_failures": self.write_failures,
            "pd_bytes_written": self.bytes_written,
            "pd_rooms_released": self.rooms_released,
        }

    def complete(self, segments: list[Segment], results: list[SegmentResult]) -> None:
        keep_s, keep_r = [], []
        for seg, res in zip(segments, results):
            r, room = seg.request, seg.request.pd
            if isinstance(room, Room) and not (res.error or r.done or r.aborted or room.error):
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


def _layout(msg) -> PoolLayout:
    return PoolLayout(tuple(LayerAddr(x.k_ptr, x.v_ptr, x.k_row_bytes, x.v_row_bytes, x.sliding) for x in msg.layers))


class PrefillService(pd_pb2_grpc.KVTransferServicer):
    def __init__(self, core, xfer: KVTransferEngine):
        self.core, self.xfer = core, xfer
        self.rooms: dict[str, Room] = {}  # open or closing; a room leaves only once closed
        self.tombstones: OrderedDict[str, float] = OrderedDict()  # released before they arrived -> when

    async def _close(self, room: Room) -> None:
        """Closes a room off the event loop (a write in flight is waited for) and forgets it."""
        await asyncio.get_running_loop().run_in_executor(None, room.close)
        if self.rooms.get(room.name) is room:
            del self.rooms[room.name]

    def _tombstone(self, name: str) -> None:
        now = time.monotonic()
        self.tombstones[name] = now
        while self.tombstones and (
            len(self.tombstones) > MAX_TOMBSTONES or next(iter(self.tombstones.values())) < now - TOMBSTONE_S
        ):
            self.tombstones.popitem(last=False)

    async def Release(self, request, context):
        """The decode side gave up on a room: it is closed (its request aborted) before this answers."""
        self.core.engine.scheduler.rooms_released += 1
        room = self.rooms.get(request.room)
        if room is None:
            self._tombstone(request.room)
            return pd_pb2.ReleaseReply(known=False)
        room.error = room.error or "released by the decode side"
        if room.request is not None and not room.request.done:
            self.core.engine.abort(room.request)
        await self._close(room)
        return pd_pb2.ReleaseReply(known=True, kv_bytes=room.bytes)

    def _room(self, request) -> Room:
        """The room of a request, checked field by field (ServeError INVALID_ARGUMENT naming the field)."""
        from llm_backend.server.core import ServeError

        engine = self.core.engine
        n = len(request.prompt_token_ids)
        if not request.room or not request.session:
            raise ServeError.invalid("room and session are required", param="room")
        if request.room in self.tombstones or request.room in self.rooms:
            raise ServeError(grpc.StatusCode.FAILED_PRECONDITION, f"room {request.room} was released or is open")
        try:
            rule = TransferRule(n, request.decode_prefix, engine.model.config.window, request.page_size or 1)
            peer = _layout(request)
            self.xfer.layout.check_peer(peer)
        except ValueError as e:
            raise ServeError.invalid(f"room {request.room}: {e}", param="layers") from None
        if len(request.full_slots) != rule.full_tokens or len(request.swa_slots) != rule.swa_tokens:
            raise ServeError.invalid(
                f"room {request.room}: {len(request.full_slots)} full / {len(request.swa_slots)} SWA slots for "
                f"{rule.full_tokens} / {rule.swa_tokens} positions (prompt {n}, decode prefix {rule.decode_prefix})",
                param="full_slots",
            )
        return Room(
            request.room,
            request.session,
            peer,
            rule,
            list(request.full_slots),
            list(request.swa_slots),
            self.xfer,
            sent=rule.decode_prefix,
        )

    async def _prompt(self, request, context):
        """The prompt ids and media rows; the media placeholders must be the ones this worker computes."""
        from llm_backend.server.core import ServeError

        media_ids, media = await self.core.encode_media(list(request.media), context.time_remaining())
        ids = self.core.check_token_ids(request.prompt_token_ids, "prompt_token_ids", range(1, 1 + len(media_ids)))
        if media_ids and ids[1 : 1 + len(media_ids)] != media_ids:
            raise ServeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"room {request.room}: the media placeholders differ from this worker's encoding of the media",
            )
        return ids, media

    async def Prefill(self, request, context):
        from llm_backend.server.core import ServeError

        core, engine = self.core, self.core.engine
        r = room = None
        try:
            core.check_serving()
            room = self._room(request)
            self.rooms[room.name] = room
            ids, media = await self._prompt(request, context)
            params = SamplingParams(
                max_tokens=1,
                temperature=request.temperature,
                top_p=request.top_p or 1.0,
                top_k=request.top_k,
                seed=request.seed if request.has_seed else None,
                logprobs=True,
                top_logprobs=request.top_logprobs,
                ignore_eos=True,
            )
            try:
                params.validate(engine.config.max_tokens_limit, engine.config.max_temperature)
            except ValueError as e:
                raise ServeError.invalid(str(e)) from None
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            first: list = []

            def on_token(req, t, lp):
                first.append((t, lp, list(req.top_logprobs[-1]) if req.top_logprobs else []))

            t0 = time.monotonic()
            try:
                r = engine.add_request(
                    ids,
                    params,
                    media,
                    on_token=on_token,
                    on_finish=lambda req: loop.call_soon_threadsafe(events.put_nowait, "end"),
                    pd=room,
                )
                room.request = r
                if room.closed:  # released while it was being added
                    engine.abort(r)
            except OverloadedError as e:
                raise ServeError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the prefill worker is overloaded: {e}") from None
            except ValueError as e:
                raise ServeError.invalid(str(e)) from None
            yield pd_pb2.PrefillEvent(accepted=pd_pb2.PrefillAccepted())
            while True:
                try:
                    await asyncio.wait_for(events.get(), KEEPALIVE_S)
                    break
                except asyncio.TimeoutError:
                    yield pd_pb2.PrefillEvent(accepted=pd_pb2.PrefillAccepted(cached_tokens=r.cached_tokens))
            if r.finish_reason not in ("stop", "length") or not first:
                why = room.error or r.error or f"the prefill request ended with {r.finish_reason or 'abort'}"
                raise ServeError(grpc.StatusCode.UNAVAILABLE, f"room {room.name}: {why}")
            engine.scheduler.rooms_served += 1
            tok, lp, top = first[0]
            yield pd_pb2.PrefillEvent(
                done=pd_pb2.PrefillDone(
                    first_token=tok,
                    logprob=lp if lp is not None else 0.0,
                    top_logprobs=[pd_pb2.TopLogprob(token_id=a, logprob=b) for a, b in top],
                    kv_bytes=room.bytes,
                    transfer_s=room.transfer_s,
                    prefill_s=time.monotonic() - t0,
                    rng_state=r.generator.get_state().numpy().tobytes() if r.generator is not None else b"",
                )
            )
        except ServeError as e:
            await context.abort(e.code, e.message)
        finally:
            if r is not None and not r.done:
                log.info("room %s: the decode side went away; aborting its prefill", request.room)
                engine.abort(r)
            if room is not None:  # closed off the loop; gone from the registry once no write can come
                asyncio.ensure_future(self._close(room))


def attach_prefill(engine, core, server, host: str, protocol: str = "tcp", device: str = "") -> KVTransferEngine:
    """Starts this worker's transfer engine on its pools and adds the KVTransfer service to `server` (a GrpcServer)."""
    xfer = KVTransferEngine(engine.pools, host, protocol, device)
    # Release is answered while the worker drains too: a decode worker waits for it to free the room's slots.
    server.add(
        pd_pb2_grpc.add_KVTransferServicer_to_server,
        PrefillService(core, xfer),
        SERVICE_NAME,
        always_answered=("Release",),
    )
    return xfer
