"""The front router: the same `Encoder/Encode` API, spread over several encoder servers.

Each item is routed by consistent hashing (mimo_epd.router.hash_ring) of its routing key:
- the client's `content_hash` when given (the bytes' own hash),
- else the xxh3-128 of inline `data` (the same bytes always go to the same encoder),
- else the URL or path string (the router does not download: the owner does).
Because every encoder of a node shares one shm cache, an item is a hit wherever it lands; routing by
content makes each encoder's working set (and in-flight de-duplication) cover a slice of the catalog.

A request's items are split by owner, sent concurrently, and merged back in order. An encoder that
fails health checks, or whose call fails with UNAVAILABLE, leaves the ring's live set and its items go
to the next live endpoint clockwise; it rejoins as soon as its health check says SERVING again.
Item errors keep their status; their `item N:` prefix is rewritten to the index in the client's request.

Bounded loads (consistent hashing with bounded loads, Mirrokni et al.): a hot item must not pin one encoder. With
`load_factor` c > 0, an encoder may hold at most ceil(c x (items in flight + 1) / live encoders) of this router's
items in flight; an item whose owner is at that bound goes to the next live encoder clockwise that is under it.
Under light load every item stays with its owner (the bound is at least c); only a skew diverts, and the
diversions are counted (`diversions`; `router_encoder_diversions` on the /metrics of a router that routes the
Encode API over a shared registry). Routers on one shared state count each other's items too: each publishes its
in-flight counts per encoder in its registry record every discovery round (LLMRouter.refresh) and hands the others'
sum to `set_remote_load`; the bound is then over every router's items, at most one discovery interval stale.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from dataclasses import dataclass

import grpc
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mimo_epd.router.channels import channel_options
from mimo_epd.router.hash_ring import HashRing
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)

_ITEM_PREFIX = re.compile(r"^item (\d+): ")


def routing_key(item: encoder_pb2.MediaItem) -> str:
    if item.content_hash:
        return "h:" + item.content_hash.strip().lower()
    which = item.WhichOneof("source")
    if which == "data":
        return "h:" + xxhash.xxh3_128_hexdigest(item.data)
    return f"{which}:{getattr(item, which) if which else ''}"


@dataclass
class RouterConfig:
    max_items_per_request: int = 64
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    vnodes: int = 160
    max_message_mb: int = 256
    load_factor: float = 1.25  # bounded loads (0 = the owner always)


class EncoderRouter(encoder_pb2_grpc.EncoderServicer):
    """`endpoints` may be empty: a router over a shared registry starts with none and follows it
    (router/discovery.py `EncoderSet` calls `add_endpoint` / `remove_endpoint`)."""

    def __init__(self, endpoints: list[str], config: RouterConfig):
        self.config = config
        self.ring = HashRing((), vnodes=config.vnodes)
        self.alive: set[str] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, encoder_pb2_grpc.EncoderStub] = {}
        self._health: dict[str, health_pb2_grpc.HealthStub] = {}
        self._task: asyncio.Task | None = None
        self._shutting_down = False
        self.on_change = None  # optional callback(alive: set[str])
        self.inflight: dict[str, int] = {}  # this router's items in flight per encoder
        self.remote: dict[str, int] = {}  # other routers' items in flight per encoder (shared state)
        self.diversions = 0  # items sent past their owner by the load bound
        for e in endpoints:
            self.add_endpoint(e)

    # ------------------------------------------------------------------ members
    @property
    def endpoints(self) -> set[str]:
        """Every encoder on the ring, live or not."""
        return set(self._channels)

    def add_endpoint(self, endpoint: str) -> None:
        """Puts an encoder on the ring (live until a health check says otherwise)."""
        if endpoint in self._channels:
            return
        ch = grpc.aio.insecure_channel(endpoint, options=channel_options(self.config.max_message_mb))
        self._channels[endpoint] = ch  # quick reconnects to a restarted encoder (channel_options)
        self._stubs[endpoint] = encoder_pb2_grpc.EncoderStub(ch)
        self._health[endpoint] = health_pb2_grpc.HealthStub(ch)
        self.ring.add(endpoint)
        self.alive.add(endpoint)

    def remove_endpoint(self, endpoint: str) -> None:
        """Takes an encoder off the ring and closes its channel."""
        ch = self._channels.pop(endpoint, None)
        if ch is None:
            return
        self._stubs.pop(endpoint, None)
        self._health.pop(endpoint, None)
        self.ring.remove(endpoint)
        self.alive.discard(endpoint)
        asyncio.get_running_loop().create_task(ch.close())

    # ------------------------------------------------------------------ health
    async def check_all(self) -> None:
        results = await asyncio.gather(*(self._check(e) for e in self._channels))
        for endpoint, ok in zip(self._channels, results):
            self._set_alive(endpoint, ok)

    async def _check(self, endpoint: str) -> bool:
        try:
            r = await self._health[endpoint].Check(
                health_pb2.HealthCheckRequest(), timeout=self.config.health_timeout_s
            )
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _set_alive(self, endpoint: str, ok: bool) -> None:
        if self._shutting_down:  # the node is stopping its encoders itself; they did not fail
            return
        if ok and endpoint not in self.alive:
            log.info("encoder %s rejoined the ring", endpoint)
            self.alive.add(endpoint)
        elif not ok and endpoint in self.alive:
            log.warning("encoder %s left the ring (unhealthy)", endpoint)
            self.alive.discard(endpoint)
        else:
            return
        if self.on_change:
            self.on_change(set(self.alive))

    async def _health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.health_interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._health_loop())

    def begin_shutdown(self) -> None:
        """The node is about to stop its encoders: stop health checks and ring changes from here on."""
        self._shutting_down = True
        if self._task:
            self._task.cancel()

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._channels.values()))

    # ------------------------------------------------------------------ Encode
    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        items = list(request.items)
        if not items:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request has no items")
        if len(items) > self.config.max_items_per_request:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request has {len(items)} items, over the limit of {self.config.max_items_per_request} "
                "(--max-items-per-request)",
            )
        keys = [routing_key(it) for it in items]
        results: list[encoder_pb2.ItemEmbedding | None] = [None] * len(items)
        pending = list(range(len(items)))
        tried: dict[int, set[str]] = {i: set() for i in pending}
        model = ""
        timeout = context.time_remaining()
        while pending:
            groups: dict[str, list[int]] = {}
            for i in pending:
                owner = self._place(keys[i], tried[i])
                if owner is None:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, f"item {i}: no live encoder (tried {sorted(tried[i]) or 'none'})"
                    )
                groups.setdefault(owner, []).append(i)
                self.inflight[owner] = self.inflight.get(owner, 0) + 1
            try:
                outcomes = await asyncio.gather(
                    *(self._forward(e, [items[i] for i in idx], timeout, request.hold) for e, idx in groups.items())
                )
            finally:
                for e, idx in groups.items():
                    self.inflight[e] -= len(idx)
            pending = []
            first_error: tuple[int, grpc.StatusCode, str] | None = None
            for (endpoint, idx), (resp, err) in zip(groups.items(), outcomes):
                if resp is not None:
                    model = resp.model
                    for j, r in zip(idx, resp.items):
                        if r.HasField("held"):  # the worker's Transfer goes to the encoder, by this address
                            r.held.encoder = endpoint
                        results[j] = r
                    continue
                code, details = err
                if code == grpc.StatusCode.UNAVAILABLE and not _ITEM_PREFIX.match(details or ""):
                    self._set_alive(endpoint, False)  # the encoder itself is gone: fail over
                    for j in idx:
                        tried[j].add(endpoint)
                    pending.extend(idx)
                    continue
                m = _ITEM_PREFIX.match(details or "")
                if m and int(m.group(1)) < len(idx):  # an item's own error: report the client's index
                    orig = idx[int(m.group(1))]
                    msg = _ITEM_PREFIX.sub(f"item {orig}: ", details)
                else:  # not item-specific (e.g. backpressure): pass through
                    orig, msg = idx[0], details or code.name
                if first_error is None or orig < first_error[0]:
                    first_error = (orig, code, msg)
            if first_error is not None:
                await context.abort(first_error[1], first_error[2])
        return encoder_pb2.EncodeResponse(items=results, model=model)

    def set_remote_load(self, loads: dict[str, int]) -> None:
        """The other routers' items in flight per encoder, as last read from the shared state."""
        self.remote = dict(loads)

    def _place(self, key: str, tried: set[str]) -> str | None:
        """The live, untried encoder clockwise from `key` that is under the load bound (the first live one when
        every one is at it)."""
        live = [o for o in self.ring.owners(key) if o in self.alive and o not in tried]
        if not live:
            return None
        c = self.config.load_factor
        if c <= 0:
            return live[0]
        load = {e: self.inflight.get(e, 0) + self.remote.get(e, 0) for e in self.alive}
        bound = math.ceil(c * (sum(load.values()) + 1) / len(self.alive))
        for o in live:
            if load.get(o, 0) < bound:
                if o != live[0]:
                    self.diversions += 1
                return o
        return live[0]

    async def _forward(self, endpoint: str, items: list, timeout: float | None, hold: bool = False):
        try:
            req = encoder_pb2.EncodeRequest(items=items, hold=hold)
            resp = await self._stubs[endpoint].Encode(req, timeout=timeout)
            return resp, None
        except grpc.aio.AioRpcError as e:
            return None, (e.code(), e.details())


class NoVisionRouter(EncoderRouter):
    """The Encode service of a node whose model has no vision tower (a text-only checkpoint): no encoder runs,
    and every request is refused with FAILED_PRECONDITION and the reason (the workers pass it on per item)."""

    def __init__(self, reason: str, config: RouterConfig):
        super().__init__([], config)
        self.reason = reason

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"media is unavailable: {self.reason}")
