"""Members of the fleet and how routers find them: heartbeats into the state, and the worker feeds.

A member is an encoder or an LLM worker: `{kind, address, node, model, ...}` under its id (kind/address) in the
state backend (state.py) with a TTL that its heartbeat refreshes; it disappears one TTL after its last beat.

- `Heartbeat`: re-registers a member every ttl/3 while `alive()` says it is up (the launcher runs one per
  encoder; `serve --join` thereby puts its encoders on every router's hash ring).
- `WorkerFeed`: long-polls one LLM worker's `KVEvents/Poll` and applies its block changes and load to the
  state (the index). Each poll is also that worker's heartbeat. With a shared state several feeds may watch the
  same worker (every router given `--workers`, or the node that runs it): a lease in the state lets exactly one
  of them write, and the others take over within a TTL when it stops.
- `EncoderSet`: keeps an `EncoderRouter`'s hash ring equal to the encoders registered in the state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Callable

import grpc

from mimo_epd.common.auth import client_interceptors
from mimo_epd.v1 import kv_events_pb2, kv_events_pb2_grpc

from .channels import channel_options
from .state import StateUnavailable

log = logging.getLogger(__name__)


def member_id(kind: str, address: str) -> str:
    return f"{kind}/{address}"


def node_name() -> str:
    return os.environ.get("MIMO_EPD_NODE") or socket.gethostname()


class Heartbeat:
    def __init__(self, state, mid: str, fields: dict, ttl_s: float = 3.0, alive: Callable[[], bool] = lambda: True):
        self.state, self.id, self.fields, self.ttl_s, self.alive = state, mid, fields, ttl_s, alive
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            if self.alive():
                try:
                    await self.state.register(self.id, {**self.fields, "updated": f"{time.time():.3f}"}, self.ttl_s)
                except StateUnavailable as e:
                    log.warning("heartbeat of %s not written: %s", self.id, e)
            await asyncio.sleep(self.ttl_s / 3)

    def start(self) -> "Heartbeat":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self, unregister: bool = True) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if unregister:
            try:
                await self.state.unregister(self.id)
            except StateUnavailable:
                pass


class WorkerFeed:
    """One LLM worker's KV events and load into the state (see the module docstring)."""

    def __init__(
        self,
        state,
        address: str,
        fields: dict | None = None,
        ttl_s: float = 3.0,
        wait_ms: int = 500,
        owner: str | None = None,
        on_reply: Callable | None = None,
    ):
        self.state, self.address = state, address
        self.id = member_id("llm", address)
        self.fields = {"kind": "llm", "address": address, **(fields or {})}
        self.ttl_s, self.wait_ms = ttl_s, wait_ms
        self.owner = owner or uuid.uuid4().hex
        self.on_reply = on_reply  # callback(feed, reply) after each applied poll
        self.epoch, self.seq = "", 0
        self.resyncs = 0  # full snapshots asked for because the state had dropped this worker's entries
        self.ok: bool | None = False  # the last poll answered; None = another relay holds the lease
        self.block_size = 0
        self._channel = grpc.aio.insecure_channel(
            address, options=channel_options(), interceptors=client_interceptors()
        )  # quick reconnects
        self._stub = kv_events_pb2_grpc.KVEventsStub(self._channel)
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            try:
                if not await self.state.lease(self.id, self.owner, self.ttl_s):
                    self.epoch, self.ok = "", None  # someone else writes it (liveness: its registration)
                    await asyncio.sleep(self.ttl_s / 3)
                    continue
            except StateUnavailable:
                self.epoch = ""
                await asyncio.sleep(0.5)
                continue
            try:
                reply = await self._stub.Poll(
                    kv_events_pb2.PollRequest(epoch=self.epoch, since_seq=self.seq, wait_ms=self.wait_ms),
                    timeout=self.wait_ms / 1e3 + 2.0,
                )
            except grpc.aio.AioRpcError as e:
                if self.ok:
                    log.warning(
                        "LLM worker %s: KV events unavailable (%s); its entries expire in %gs",
                        self.address,
                        e.code().name,
                        self.ttl_s,
                    )
                self.ok, self.epoch = False, ""
                await asyncio.sleep(0.2)
                continue
            load = reply.load
            fields = {
                **self.fields,
                "model": reply.model,
                "block_size": reply.block_size,
                "role": reply.role or "both",
                "epoch": reply.epoch,
                "kv_seq": reply.seq,
                "queued_tokens": load.queued_tokens,
                "running_tokens": load.running_tokens,
                "waiting": load.waiting,
                "running": load.running,
                "updated": f"{time.time():.3f}",
            }
            try:
                continued = await self.state.apply(
                    self.id, reply.reset, list(reply.hashes), list(reply.states), fields, self.ttl_s
                )
            except StateUnavailable as e:
                log.warning(
                    "LLM worker %s: events not stored (%s); a full snapshot is written when it answers", self.address, e
                )
                self.epoch = ""  # rewrite everything once the state is back
                await asyncio.sleep(0.5)
                continue
            if not self.ok:
                log.info(
                    "LLM worker %s: KV events flowing (%d blocks, block %d)",
                    self.address,
                    len(reply.hashes) if reply.reset else -1,
                    reply.block_size,
                )
            if not continued:  # its entries had expired under us: this delta sits on nothing, rewrite everything
                log.warning(
                    "LLM worker %s: its index entries had expired (this feed stalled past --member-ttl-s %gs); "
                    "asking for a full snapshot",
                    self.address,
                    self.ttl_s,
                )
                self.resyncs += 1
                self.epoch, self.seq = "", 0
                continue
            self.ok, self.epoch, self.seq, self.block_size = True, reply.epoch, reply.seq, reply.block_size
            if self.on_reply:
                self.on_reply(self, reply)

    def start(self) -> "WorkerFeed":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()


class EncoderSet:
    """Adds and removes encoders on an EncoderRouter's ring as they appear in / leave the state."""

    def __init__(self, router):
        self.router = router

    def sync(self, endpoints: set[str]) -> None:
        r = self.router
        for e in sorted(endpoints - r.endpoints):
            r.add_endpoint(e)
            log.info("encoder %s joined the ring (registered)", e)
        for e in sorted(r.endpoints - endpoints):
            r.remove_endpoint(e)
            log.info("encoder %s left the ring (its registration expired)", e)
