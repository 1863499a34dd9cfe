"""Garbage in the shared Redis, two routers reading it: bad member records (a non-integer block_size, an
unparsable or out-of-range address, a value that is not UTF-8) and KV values that are not integers are skipped
and counted on /metrics; routing goes on; the discovery loop stays alive and still sees a worker join and
leave afterwards."""

from __future__ import annotations

import asyncio
import time

from llm_backend.kv.events import STORED, block_hashes
from mimo_epd.common.shutdown import await_chain
from mimo_epd.router.config import LLMRouterConfig
from mimo_epd.router.llm import LLMRouter
from mimo_epd.router.records import BadRecord, check_address, kv_state, member
from mimo_epd.router.state import RedisState

GOOD = {"kind": "llm", "address": "127.0.0.1:7001", "block_size": "4", "queued_tokens": "0"}


def test_records_rules():
    assert member("llm/127.0.0.1:7001", GOOD) == GOOD
    for bad in (
        {**GOOD, "block_size": "abc"},
        {**GOOD, "block_size": "0"},
        {**GOOD, "address": "127.0.0.1:99999"},
        {**GOOD, "address": "no port"},
        {**GOOD, "http_address": "%41%42:80"},
        {**GOOD, "queued_tokens": "-3"},
        {**GOOD, "kind": "printer"},
    ):
        try:
            member("llm/x", bad)
        except BadRecord:
            continue
        raise AssertionError(f"accepted {bad}")
    assert check_address("[::1]:80", "a") == "[::1]:80"
    assert kv_state(b"2") == 2 and kv_state(b"zz") is None and kv_state(b"-1") is None


async def _scenario(url: str) -> None:
    writer = RedisState(url)
    cfg = LLMRouterConfig(router_state=url, model="tiny-random", discovery_interval_s=0.05, member_ttl_s=3.0)
    routers = [LLMRouter(cfg, RedisState(url)) for _ in range(2)]
    for r in routers:
        await r.start(wait_s=0.0)
    try:
        await writer.register("llm/127.0.0.1:7001", GOOD, 30)
        await writer.register("llm/127.0.0.1:7002", {**GOOD, "address": "127.0.0.1:7002", "block_size": "x"}, 30)
        await writer.register("llm/bad", {**GOOD, "address": "127.0.0.1:70000"}, 30)
        await writer.register("llm/h", {**GOOD, "address": "127.0.0.1:7003", "http_address": "a b:1"}, 30)
        await writer.r.hset(writer._member("llm/u"), mapping={b"kind": b"\xff\xfe", b"address": b"x:1"})
        await writer.r.sadd(f"{writer.p}:members", "llm/u")
        tokens = list(range(1, 17))
        hashes = block_hashes(tokens, 4)
        await writer.apply("llm/127.0.0.1:7001", True, hashes[:2], [STORED, STORED], {}, 30)
        await writer.r.hset(writer._kv("llm/127.0.0.1:7001"), hashes[2].to_bytes(8, "big"), b"not a number")
        await asyncio.sleep(0.3)
        for r in routers:
            assert set(r.workers) == {"llm/127.0.0.1:7001"}, r.workers
            choices = await r.pick(tokens)  # the garbage KV value counts as absent: no exception
            assert [c.worker for c in choices] == ["llm/127.0.0.1:7001"]
            assert r.discovery_alive()
            text = r.metrics.render().decode()
            assert 'router_bad_records{what="member"}' in text and 'router_bad_records{what="kv"}' in text
            assert r.state.bad.counts["member"] >= 4 and r.state.bad.counts["kv"] >= 1
        # the loop lives on: a worker joins and leaves
        await writer.register("llm/127.0.0.1:7009", {**GOOD, "address": "127.0.0.1:7009"}, 30)
        await asyncio.sleep(0.3)
        assert all("llm/127.0.0.1:7009" in r.workers for r in routers)
        await writer.unregister("llm/127.0.0.1:7009")
        await asyncio.sleep(0.3)
        assert all("llm/127.0.0.1:7009" not in r.workers for r in routers)
        assert all(r.discovery_alive() for r in routers)
    finally:
        for r in routers:
            await r.close()
        await writer.close()


async def _bounded(coro, seconds: float) -> None:
    """Runs `coro`; past `seconds` fails naming where it waits (a hang reads as a location, not a timeout)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        chain = await_chain(task)
        task.cancel()
        raise AssertionError(f"the scenario did not end in {seconds:g} s; it waits in {chain}")
    task.result()


def test_garbage_in_redis_is_skipped_counted_and_discovery_lives(redis_server):
    asyncio.run(_bounded(_scenario(redis_server.url), 120))


async def _dead_loop() -> None:
    router = LLMRouter(LLMRouterConfig(model="tiny-random", discovery_interval_s=0.05))
    deaths = []
    router.on_loop_death = deaths.append
    await router.start(wait_s=0.0)
    try:
        assert router.discovery_alive()
        next(t for t in router._tasks if t.get_name() == "discovery").cancel()  # a loop ending before close()
        await asyncio.sleep(0.05)
        assert deaths == ["discovery"] and not router.discovery_alive()
        assert "router_discovery_alive 0.0" in router.metrics.render().decode()
    finally:
        await router.close()


def test_a_loop_that_ends_is_reported_not_silent():
    asyncio.run(_dead_loop())


async def _stale_load_scenario() -> None:
    from llm_backend.kv.events import USABLE
    from mimo_epd.router.llm import Choice
    from mimo_epd.router.state import MemoryState

    state = MemoryState()
    router = LLMRouter(LLMRouterConfig(model="tiny-random", discovery_interval_s=0.05), state)
    tokens = list(range(1, 41))  # 10 blocks of 4; the session's worker holds the first 4 (a 40 % match)
    hashes = block_hashes(tokens, 4)
    a, b = "llm/127.0.0.1:7001", "llm/127.0.0.1:7002"
    await state.register(b, {**GOOD, "address": "127.0.0.1:7002"}, 30)
    busy = {**GOOD, "running_tokens": "300", "running": "1", "updated": "0"}
    await state.register(a, busy, 30)
    await state.apply(a, True, hashes[:4], [STORED] * 3 + [USABLE], {}, 30)
    await router.start(wait_s=0.0)
    try:
        await asyncio.sleep(0.2)
        # a's last word says it still runs a request: 40 % of the cache does not outweigh a full load
        first = await router.pick(tokens)
        assert [(c.worker, c.predicted_tokens) for c in first] == [(b, 0), (a, 16)]
        # ... unless that request was this router's and finished after a said so
        await state.register(a, {**busy, "updated": f"{time.time():.3f}"}, 30)
        await asyncio.sleep(0.2)
        flight = router.started(Choice(a, "127.0.0.1:7001", "", 0, 0), 300)
        router.progressed(flight, 1)
        router.finished(flight)
        assert [c.worker for c in await router.pick(tokens)] == [a, b]
        assert router.workers[a].current_load() == (0, 0, 0)
        # a newer word from the worker supersedes the discount
        await state.register(a, {**busy, "updated": f"{time.time() + 1:.3f}"}, 30)
        await asyncio.sleep(0.2)
        assert router.workers[a].current_load() == (0, 300, 1) and not router.workers[a].done
    finally:
        await router.close()


def test_own_finished_requests_leave_a_stale_load_snapshot():
    """A worker's load snapshot taken while this router's request still ran is discounted by that request once it
    finished: an agent's next turn, sent as the answer arrives, stays on its cache (test_fleet's flake)."""
    asyncio.run(_bounded(_stale_load_scenario(), 20))
