"""Bounded loads across routers: each router publishes its items in flight per encoder in the shared state, and
another router's placement counts them (an item whose owner is busy with the first router's items is diverted by
the second, which has nothing in flight itself). Bad `encoder_load` records are skipped."""

from __future__ import annotations

import asyncio

import pytest

from mimo_epd.router.config import LLMRouterConfig
from mimo_epd.router.encoder import EncoderRouter, RouterConfig
from mimo_epd.router.llm import LLMRouter
from mimo_epd.router.records import BadRecord, member
from mimo_epd.router.state import MemoryState

ENCODERS = ["127.0.0.1:7101", "127.0.0.1:7102"]


async def _scenario() -> None:
    state = MemoryState()
    for e in ENCODERS:
        await state.register(f"encoder/{e}", {"kind": "encoder", "address": e}, 30)
    cfg = LLMRouterConfig(model="tiny-random", discovery_interval_s=5.0)
    routers = [LLMRouter(cfg, state, encoders=EncoderRouter([], RouterConfig(load_factor=1.25))) for _ in range(2)]
    try:
        for r in routers:
            await r.refresh()
        a, b = (r.encoders.router for r in routers)
        key = next(k for k in (f"h:{i:032x}" for i in range(1000)) if next(iter(a.ring.owners(k))) == ENCODERS[0])
        assert b._place(key, set()) == ENCODERS[0]  # nothing in flight anywhere: the owner
        a.inflight[ENCODERS[0]] = 10  # router A keeps the owner busy
        assert b._place(key, set()) == ENCODERS[0]  # B does not know yet
        for r in routers:
            await r.refresh()
        assert b.remote == {ENCODERS[0]: 10} and a.remote == {}
        assert b._place(key, set()) == ENCODERS[1] and b.diversions == 1
        await routers[0].close()  # its record goes: B's view of the load with it
        await routers[1].refresh()
        assert b.remote == {} and b._place(key, set()) == ENCODERS[0]
    finally:
        await routers[1].close()


def test_routers_count_each_others_items_in_flight():
    asyncio.run(_scenario())


def test_bad_encoder_load_records_are_refused():
    assert member("router/x", {"kind": "router", "encoder_load": '{"127.0.0.1:1": 3}'})
    for bad in ("nope", '{"no port": 1}', '{"127.0.0.1:1": -1}', "[1]"):
        with pytest.raises(BadRecord):
            member("router/x", {"kind": "router", "encoder_load": bad})
