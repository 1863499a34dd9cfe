"""Read-your-writes for the router's index (mimo_epd/router/sync.py): a pick waits until the index has applied a
worker's events up to the position its last answer named, never longer than --index-sync-ms, and a worker whose
feed lags is waited for once, not on every pick."""

from __future__ import annotations

import asyncio
import time

from mimo_epd.router.state import MemoryState
from mimo_epd.router.sync import IndexSync, parse_position


class Feed:  # what IndexSync reads of a WorkerFeed
    def __init__(self, epoch="e1", seq=0):
        self.ok, self.epoch, self.seq = True, epoch, seq


def test_positions_parse_or_are_ignored():
    assert parse_position("ab12:40") == ("ab12", 40)
    assert parse_position("") is None and parse_position("e1:") is None and parse_position("e1:-3") is None
    sync = IndexSync(MemoryState(), {}, 100)
    sync.expect("w", "garbage")
    assert sync.wants == {}
    sync.expect("w", "e1:7")
    sync.expect("w", "e1:5")  # an older answer never lowers the expectation
    assert sync.wants == {"w": ("e1", 7)}
    sync.expect("w", "e2:1")  # the worker restarted: its new log counts from 1
    assert sync.wants == {"w": ("e2", 1)}
    off = IndexSync(MemoryState(), {}, 0)
    off.expect("w", "e1:7")
    assert off.wants == {}  # --index-sync-ms 0: never waits


async def test_a_pick_waits_for_the_feed_then_not_longer():
    feed = Feed(seq=3)
    sync = IndexSync(MemoryState(), {"w": feed}, 2000)
    sync.expect("w", "e1:5")

    async def catch_up():
        await asyncio.sleep(0.05)
        feed.seq = 4
        await asyncio.sleep(0.05)
        feed.seq = 6

    t0 = time.monotonic()
    await asyncio.gather(sync.wait(["w", "other"]), catch_up())
    took = time.monotonic() - t0
    assert feed.seq == 6 and 0.09 < took < 1.0  # returned once seq 5 was applied, not at the 2 s bound
    assert sync.wants == {} and sync.stats["waits"] == 1 and sync.stats["timeouts"] == 0
    t0 = time.monotonic()
    await sync.wait(["w"])  # met: no wait
    assert time.monotonic() - t0 < 0.01 and sync.stats["waits"] == 1


async def test_an_epoch_change_is_not_a_catch_up():
    feed = Feed(epoch="old", seq=100)
    sync = IndexSync(MemoryState(), {"w": feed}, 80)
    sync.expect("w", "new:3")  # the worker restarted; the feed still has the old process's numbers
    await sync.wait(["w"])
    assert sync.stats["timeouts"] == 1


async def test_a_lagging_feed_costs_one_wait_and_is_met_later():
    feed = Feed(seq=0)
    sync = IndexSync(MemoryState(), {"w": feed}, 100)
    sync.expect("w", "e1:9")
    t0 = time.monotonic()
    await sync.wait(["w"])
    assert 0.09 < time.monotonic() - t0 < 0.5 and sync.stats["timeouts"] == 1 and "w" in sync.lagging
    sync.expect("w", "e1:10")
    t0 = time.monotonic()
    await sync.wait(["w"])  # known to lag: routed at once
    assert time.monotonic() - t0 < 0.05 and sync.stats["waits"] == 1
    feed.seq = 10
    await sync.wait(["w"])
    assert "w" not in sync.lagging and sync.wants == {}  # caught up: waited for again next time
    sync.expect("w", "e1:11")
    asyncio.get_running_loop().call_later(0.03, setattr, feed, "seq", 11)
    await sync.wait(["w"])
    assert sync.stats["waits"] == 2 and sync.stats["timeouts"] == 1


async def test_a_relay_elsewhere_is_read_from_the_state():
    state = MemoryState()
    await state.register("w", {"kind": "llm", "address": "a:1", "epoch": "e1", "kv_seq": 1}, 5)
    sync = IndexSync(state, {}, 2000)  # no feed of its own: the node's relay writes the member record
    sync.expect("w", "e1:2")

    async def relay():
        await asyncio.sleep(0.05)
        await state.apply("w", False, [], [], {"epoch": "e1", "kv_seq": 2}, 5)

    t0 = time.monotonic()
    await asyncio.gather(sync.wait(["w"]), relay())
    assert time.monotonic() - t0 < 1.0 and sync.wants == {} and sync.stats["timeouts"] == 0


async def test_routers_on_one_redis_wait_for_each_others_answers(redis_server):
    """Router A hears a worker's answer; router B, on the same Redis, routes that session's next turn: B waits for
    the index (written by the worker's relay) to reach A's answer too, and does not re-read a met one."""
    from mimo_epd.router.state import RedisState

    a_state, b_state, relay = (RedisState(redis_server.url) for _ in range(3))
    try:
        await relay.apply("w", True, [1], [2], {"kind": "llm", "address": "a:1", "epoch": "e1", "kv_seq": 3}, 5)
        a, b = IndexSync(a_state, {}, 2000), IndexSync(b_state, {}, 2000)
        a.expect("w", "e1:5")
        await asyncio.sleep(0.05)  # A's shared write
        assert await b_state.answered_positions(["w", "other"]) == {"w": "e1:5"}

        async def relay_catches_up():
            await asyncio.sleep(0.1)
            await relay.apply("w", False, [2], [2], {"epoch": "e1", "kv_seq": 5}, 5)

        t0 = time.monotonic()
        await asyncio.gather(b.wait(["w", "other"]), relay_catches_up())
        assert 0.09 < time.monotonic() - t0 < 1.5 and b.stats["waits"] == 1 and b.stats["timeouts"] == 0
        await b.wait(["w"])  # met: the shared position is not waited for again
        assert b.stats["waits"] == 1 and b.wants == {}
    finally:
        for s in (a_state, b_state, relay):
            await s.close()
