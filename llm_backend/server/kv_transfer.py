"""The KVTransfer control channel of prefill / decode disaggregation (protos/mimo_epd/v1/pd.proto), both ends.

The engine-side roles live in llm_backend/pd (`PrefillScheduler`, `DecodeScheduler`: what runs, which slots, the
failure and fencing rules, documented there); this module is their gRPC: `PrefillService` on a prefill worker
(one `KVTransfer/Prefill` stream per room: the room checked field by field, the prompt run as a one-token
request with the room as its ticket, keep-alives every second, the first token last; `KVTransfer/Release` closes
a room before it answers), and on a decode worker `PrefillClient`, the decode scheduler's `TransferPort` (one
stream per room, its events reported as the port's news; Release asked until the prefill worker answers or is
gone), with `DecodeTicketing`, the ticket each request gets.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

import grpc

from llm_backend.agentic.grammar import ConstraintSpec, Grammar
from llm_backend.engine import OverloadedError, SamplingParams
from llm_backend.engine.request import Request
from llm_backend.kv.transfer import KVTransferEngine, LayerAddr, PoolLayout
from llm_backend.parallel.mirror import MirroredTransfer
from llm_backend.pd.decode import DecodeRoom, PDTicket
from llm_backend.pd.prefill import KVWriter, PrefillCounters, Room
from llm_backend.pd.rule import TransferRule
from mimo_epd.common.auth import client_interceptors
from mimo_epd.v1 import pd_pb2, pd_pb2_grpc

from .core import ServeError

log = logging.getLogger(__name__)

SERVICE_NAME = pd_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
# Seconds between keep-alive events on a room's stream while its request waits or runs (the decode side's
# --pd-transfer-timeout-s counts from the last event).
KEEPALIVE_S = 1.0
# Room names released before their Prefill call arrived, kept this long (and at most this many) to refuse it.
TOMBSTONE_S = 600.0
MAX_TOMBSTONES = 65536
# One KVTransfer/Release call's deadline, and the pause before it is asked again (a prefill worker that hangs).
RELEASE_RPC_S = 2.0
RELEASE_RETRY_S = 0.5


def transfer_engine(engine, host: str, protocol: str, device: str):
    """This worker's KV transfer engine on its pools; on a tensor-parallel worker every rank starts its own and
    rank 0's handle writes through all of them (`MirroredTransfer`). Called before the worker serves."""
    xfer = KVTransferEngine(engine.pools, host, protocol, device)
    if engine.replica is None:
        return xfer
    try:
        return MirroredTransfer(xfer, engine.replica, host, protocol, device)
    except BaseException:
        xfer.close()
        raise


# ---------------------------------------------------------------------------------------- the prefill side
def _layout(msg) -> PoolLayout:
    return PoolLayout(tuple(LayerAddr(x.k_ptr, x.v_ptr, x.k_row_bytes, x.v_row_bytes, x.sliding) for x in msg.layers))


class PrefillService(pd_pb2_grpc.KVTransferServicer):
    def __init__(self, core, xfer: KVWriter, counters: PrefillCounters):
        self.core, self.xfer, self.counters = core, xfer, counters
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
        self.counters.rooms_released += 1
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
        engine = self.core.engine
        n = len(request.prompt_token_ids)
        if not request.room or not request.session:
            raise ServeError.invalid("room and session are required", param="room")
        if request.room in self.tombstones or request.room in self.rooms:
            raise ServeError(grpc.StatusCode.FAILED_PRECONDITION, f"room {request.room} was released or is open")
        try:
            rule = TransferRule(n, request.decode_prefix, engine.model.config.window, request.page_size or 1)
            targets = ((request.session, _layout(request)),) + tuple(
                (p.session, _layout(p)) for p in request.rank_pools
            )
            if len(targets) != len(self.xfer.ranks):
                raise ValueError(
                    f"the decode worker runs at tensor-parallel size {len(targets)}, this prefill worker at "
                    f"{len(self.xfer.ranks)}: each rank writes its own heads into the decode rank of its number, so "
                    "the sizes must be equal"
                )
            for r, ((_, mine), (_, peer)) in enumerate(zip(self.xfer.ranks, targets)):
                try:
                    mine.check_peer(peer)
                except ValueError as e:
                    raise ValueError(f"rank {r}: {e}" if len(targets) > 1 else str(e)) from None
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
            targets,
            rule,
            list(request.full_slots),
            list(request.swa_slots),
            self.xfer,
            sent=rule.decode_prefix,
        )

    async def _prompt(self, request, context):
        """The prompt ids and media rows; the media placeholders must be the ones this worker computes."""
        enc = await self.core.encode_media(list(request.media), context.time_remaining())
        placeholders = {i for i, t in enumerate(request.prompt_token_ids) if t >= self.core.vocab_size}
        ids = self.core.check_token_ids(request.prompt_token_ids, "prompt_token_ids", placeholders if enc.items else ())
        media = self.core.place_media(ids, enc, f"room {request.room}")
        return ids, media

    async def _grammar(self, request):
        """The room's output constraint, compiled here (the first token is sampled under it); None without one."""
        if not request.constraint:
            return None
        try:
            d = json.loads(request.constraint)
            spec = ConstraintSpec(str(d["kind"]), d["value"], str(d["param"]), bool(d.get("thinking", False)))
        except (ValueError, KeyError, TypeError) as e:
            raise ServeError.invalid(
                f"room {request.room}: the constraint is unreadable: {e}", param="constraint"
            ) from None
        return await self.core.grammar(spec)

    async def _params(self, request) -> SamplingParams:
        """The first token's sampling: the decode side's settings, controls and constraint (one token, no EOS stop)."""
        engine = self.core.engine
        params = SamplingParams(
            max_tokens=1,
            temperature=request.temperature,
            top_p=request.top_p or 1.0,
            top_k=request.top_k,
            seed=request.seed if request.has_seed else None,
            logprobs=True,
            top_logprobs=request.top_logprobs,
            ignore_eos=True,
            grammar=await self._grammar(request),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty or 1.0,
            logit_bias=tuple((b.token_id, b.bias) for b in request.logit_bias),
            min_tokens=min(request.min_tokens, 1),
            stop_token_ids=tuple(request.stop_token_ids),  # masked while min_tokens holds
        )
        try:
            params.validate(engine.config.max_tokens_limit, engine.config.max_temperature, engine.config.max_logit_bias)
        except ValueError as e:
            raise ServeError.invalid(str(e)) from None
        return params

    async def Prefill(self, request, context):
        core, engine = self.core, self.core.engine
        r = room = None
        try:
            core.check_serving()
            room = self._room(request)
            self.rooms[room.name] = room
            ids, media = await self._prompt(request, context)
            params = await self._params(request)
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
                    ticket=room,
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
            self.counters.rooms_served += 1
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


def attach_prefill(
    engine, core, server, host: str, counters: PrefillCounters, protocol: str = "tcp", device: str = ""
) -> KVTransferEngine:
    """Starts this worker's transfer engine on its pools and adds the KVTransfer service to `server` (a GrpcServer)."""
    xfer = transfer_engine(engine, host, protocol, device)
    # Release is answered while the worker drains too: a decode worker waits for it to free the room's slots.
    server.add(
        pd_pb2_grpc.add_KVTransferServicer_to_server,
        PrefillService(core, xfer, counters),
        SERVICE_NAME,
        always_answered=("Release",),
    )
    return xfer


# ---------------------------------------------------------------------------------------- the decode side
def _constraint_json(grammar) -> str:
    """The room's constraint for the prefill worker: the compiled grammar's spec as JSON ("" = none)."""
    if grammar is None:
        return ""
    if not isinstance(grammar, Grammar):
        raise TypeError(f"a decode worker sends xgrammar constraints only, not a {type(grammar).__name__}")
    spec = grammar.spec
    return json.dumps({"kind": spec.kind, "value": spec.value, "param": spec.param, "thinking": spec.thinking})


def _layers(layout: PoolLayout) -> list:
    return [
        pd_pb2.PoolLayer(k_ptr=a.k_ptr, v_ptr=a.v_ptr, k_row_bytes=a.k_row, v_row_bytes=a.v_row, sliding=a.sliding)
        for a in layout.layers
    ]


class PrefillClient:
    """The decode side of the control channel: one `KVTransfer/Prefill` stream per room, on the worker's loop."""

    def __init__(self, fence_timeout_s: float, max_message_mb: int = 512):
        self.fence_timeout_s, self.max_message_mb = fence_timeout_s, max_message_mb
        self.xfer: KVWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stubs: dict[str, Any] = {}

    def open(self, xfer: KVWriter, loop: asyncio.AbstractEventLoop) -> None:
        """The worker's transfer engine (on the engine's pools) and the event loop the streams run on; before this
        the decode scheduler has no request to transfer (the worker opens it before it serves)."""
        self.xfer, self.loop = xfer, loop

    def _stub(self, address: str):
        if address not in self._stubs:
            mb = self.max_message_mb << 20
            ch = grpc.aio.insecure_channel(
                address,
                options=[("grpc.max_receive_message_length", mb), ("grpc.max_send_message_length", mb)],
                interceptors=client_interceptors(),  # the internal key, when the prefill worker wants one
            )
            self._stubs[address] = pd_pb2_grpc.KVTransferStub(ch)
        return self._stubs[address]

    def request(self, r: Request, room: DecodeRoom) -> pd_pb2.PrefillRequest:
        assert self.xfer is not None, "the port is open"
        p = r.params
        (session, layout), *others = self.xfer.ranks
        return pd_pb2.PrefillRequest(
            room=room.name,
            prompt_token_ids=r.prompt,
            media=room.media_items,
            session=session,
            layers=_layers(layout),
            rank_pools=[pd_pb2.RankPools(session=s, layers=_layers(lay)) for s, lay in others],
            decode_prefix=room.rule.decode_prefix,
            page_size=room.rule.page,
            full_slots=room.full_slots,
            swa_slots=room.swa_slots,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed or 0,
            has_seed=p.seed is not None,
            top_logprobs=p.top_logprobs,
            constraint=_constraint_json(p.grammar),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=[pd_pb2.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias],
            min_tokens=min(p.min_tokens, 1),
            stop_token_ids=sorted(r.stop_ids),
        )

    def start(self, r: Request, room: DecodeRoom, news: Callable[[str, object], None]) -> None:  # type: ignore[override]
        """Called on the engine thread: the stream runs on the loop and reports through `news`."""
        assert self.loop is not None, "the port is open"
        asyncio.run_coroutine_threadsafe(self._run(r, room, news), self.loop)

    def release(self, room: DecodeRoom, released: Callable[[str], None]) -> None:  # type: ignore[override]
        """Called on the engine thread for a room given up on: the stream is cancelled, then `KVTransfer/Release`
        is asked until the prefill worker answers (it closed the room) or is found gone; then "released" is posted
        and the scheduler frees the room's slots (the scheduler has marked the room cancelled)."""
        assert self.loop is not None, "the port is open"
        asyncio.run_coroutine_threadsafe(self._release(room, released), self.loop)

    async def _release(self, room: DecodeRoom, released: Callable[[str], None]) -> None:
        if room.call is not None:
            room.call.cancel()
        deadline = time.monotonic() + self.fence_timeout_s
        why = "the fence timed out"
        while time.monotonic() < deadline:
            try:
                reply = await self._stub(room.prefill).Release(
                    pd_pb2.ReleaseRequest(room=room.name), timeout=min(RELEASE_RPC_S, deadline - time.monotonic())
                )
                why = "closed by the prefill worker" if reply.known else "the prefill worker never opened it"
                break
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # the process is gone (or unreachable: it writes nothing)
                    why = f"the prefill worker is gone ({e.details()})"
                    break
                await asyncio.sleep(RELEASE_RETRY_S)  # it hangs: asked again until the fence times out
        released(why)

    async def _run(self, r: Request, room: DecodeRoom, post: Callable[[str, object], None]) -> None:
        if room.cancelled:
            return
        try:
            room.call = self._stub(room.prefill).Prefill(self.request(r, room))
            async for ev in room.call:
                if ev.HasField("done"):
                    post("done", ev.done)
                    return
                post("alive", None)
            post("failed", f"prefill worker {room.prefill} ended the stream without a first token")
        except grpc.aio.AioRpcError as e:
            if not room.cancelled:
                post("failed", f"prefill worker {room.prefill}: {e.code().name}: {e.details()}")
        except Exception as e:  # noqa: BLE001 - any failure of the stream fails this room only
            post("failed", f"prefill worker {room.prefill}: {type(e).__name__}: {e}")


class PrefillPicker:
    """The decode worker's own choice among `--pd-prefill` workers when a request names none: round robin."""

    def __init__(self, addresses: str):
        self.addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        self._next = itertools.count()

    def pick(self) -> str:
        return self.addresses[next(self._next) % len(self.addresses)] if self.addresses else ""


class DecodeTicketing:
    """The decode worker's ticket for each request (`GenerationCore`'s `ticketing`): the prefill worker the router
    chose, else one of `--pd-prefill` (round robin), "local" for none."""

    def __init__(self, addresses: str):
        self.picker = PrefillPicker(addresses)

    def ticket(self, prep) -> PDTicket:
        prefill = "" if prep.prefill_address == "local" else (prep.prefill_address or self.picker.pick())
        return PDTicket(prefill, list(prep.media_items))


def attach_decode(engine, port: PrefillClient, host: str, cfg) -> KVTransferEngine:
    """Starts this worker's transfer engine on its pools and opens the decode role's port on the running loop."""
    xfer = transfer_engine(engine, host, cfg.pd_protocol, cfg.pd_device)
    port.open(xfer, asyncio.get_running_loop())
    return xfer
