"""State backends: the memory one and a real redis-server behave the same; keys expire with their heartbeat;
a dead Redis raises StateUnavailable (the router's cue to route by load only)."""

from __future__ import annotations

import asyncio

import pytest

from llm_backend.kv.events import ABSENT, STORED, USABLE
from mimo_epd.router.state import MemoryState, RedisState, StateUnavailable, open_state


async def exercise(state) -> None:
    await state.apply("w1", True, [1, 2, 3], [USABLE, STORED, USABLE], {"kind": "llm", "address": "a:1"}, 5)
    await state.apply("w2", True, [1, 9], [USABLE, USABLE], {"kind": "llm", "address": "a:2"}, 5)
    got = await state.lookup([1, 2, 3], ["w1", "w2"])
    assert got["w1"] == [USABLE, STORED, USABLE]
    assert got["w2"][0] == USABLE and got["w2"][1:] in ([], [ABSENT, ABSENT], [ABSENT])
    await state.apply("w1", False, [2, 3, 2], [ABSENT, STORED, USABLE], {"queued_tokens": 7}, 5)
    assert (await state.lookup([1, 2, 3], ["w1"]))["w1"] == [USABLE, USABLE, STORED]
    members = await state.members("llm")
    assert set(members) == {"w1", "w2"} and members["w1"]["queued_tokens"] == "7" and members["w1"]["address"] == "a:1"
    await state.apply("w1", True, [5], [USABLE], {}, 5)  # a reset replaces everything the worker held
    assert (await state.lookup([1], ["w1"]))["w1"] in ([], [ABSENT])
    await state.register("e1", {"kind": "encoder", "address": "a:3"}, 0.3)
    assert set(await state.members("encoder")) == {"e1"}
    await asyncio.sleep(0.5)
    assert await state.members("encoder") == {}
    assert await state.lease("w1", "me", 0.3) and await state.lease("w1", "me", 0.3)
    assert not await state.lease("w1", "other", 0.3)
    await asyncio.sleep(0.5)
    assert await state.lease("w1", "other", 0.3)
    await state.unregister("w2")
    assert set(await state.members("llm")) == {"w1"}
    # the index position a relay writes with each apply; a delta onto a record that expired meanwhile is refused
    w3 = {"kind": "llm", "address": "a:4", "epoch": "e9", "kv_seq": 2}
    assert await state.apply("w3", True, [7, 8], [USABLE, USABLE], w3, 0.3)
    assert await state.position("w3") == "e9:2" and await state.position("nobody") == ""
    assert await state.apply("w3", False, [8], [STORED], {"kv_seq": 3}, 0.3)  # live: continued
    assert await state.position("w3") == "e9:3"
    assert await state.progress("w3") == ("e9:3", {})  # no load written with it: the position alone
    load = {"queued_tokens": 5, "running_tokens": 9, "waiting": 1, "running": 2, "updated": "12.5"}
    assert await state.apply("w3", False, [], [], {"kv_seq": 4, **load}, 0.3)
    want = {"queued_tokens": 5, "running_tokens": 9, "waiting": 1, "running": 2, "updated": 12.5}
    assert await state.progress("w3") == ("e9:4", want)  # the load the feed wrote with that position, one read
    assert await state.progress("nobody") == ("", {})
    await asyncio.sleep(0.5)
    assert "w3" not in await state.members("llm")  # expired (and its index with it)
    assert not await state.apply("w3", False, [9], [USABLE], {**w3, "kv_seq": 5}, 5)  # a delta on nothing
    assert await state.apply("w3", True, [7, 9], [USABLE, USABLE], {**w3, "kv_seq": 5}, 5)  # the snapshot is taken
    assert (await state.lookup([7], ["w3"]))["w3"] == [USABLE]
    await state.unregister("w3")


async def test_memory_state():
    await exercise(open_state("memory"))


async def test_redis_state(redis_server):
    state = open_state(redis_server.url)
    assert isinstance(state, RedisState)
    await exercise(state)
    # a second client (another router) sees the same index
    other = RedisState(redis_server.url)
    assert (await other.lookup([5], ["w1"]))["w1"] == [USABLE]
    await asyncio.sleep(5.2)  # w1's last heartbeat had a 5 s TTL: its entries are gone
    assert (await other.lookup([5], ["w1"]))["w1"] == [ABSENT] and await other.members() == {}
    await state.close()
    await other.close()


async def test_redis_down_raises_state_unavailable(redis_server):
    state = RedisState(redis_server.url)
    await state.register("w", {"kind": "llm"}, 5)
    redis_server.stop()
    with pytest.raises(StateUnavailable):
        await state.lookup([1], ["w"])
    assert not await state.ping()
    redis_server.start()  # same port: the client reconnects
    for _ in range(20):
        if await state.ping():
            break
        await asyncio.sleep(0.1)
    assert await state.ping()
    await state.close()


def test_state_spec_is_checked():
    assert isinstance(open_state("memory"), MemoryState)
    with pytest.raises(ValueError, match="--router-state"):
        open_state("mysql://x")
