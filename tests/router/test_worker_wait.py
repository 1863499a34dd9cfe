"""A request that finds no live LLM worker waits `--worker-wait-s` for one to register (a restart, a heartbeat late
under load) instead of failing at once; with nothing registering it fails after the wait, and with 0 at once."""

from __future__ import annotations

import asyncio
import time

from mimo_epd.router.config import LLMRouterConfig
from mimo_epd.router.llm import LLMRouter
from mimo_epd.router.state import MemoryState

MEMBER = {"kind": "llm", "address": "127.0.0.1:7001", "block_size": "4", "queued_tokens": "0"}


async def _scenario() -> None:
    state = MemoryState()
    cfg = LLMRouterConfig(model="tiny-random", discovery_interval_s=5.0, member_ttl_s=3.0, worker_wait_s=2.0)
    router = LLMRouter(cfg, state)
    await router.start(wait_s=0.0)
    try:
        assert router.live() == []

        async def joins_later() -> None:
            await asyncio.sleep(0.4)
            await state.register("llm/127.0.0.1:7001", MEMBER, 30)

        t0 = time.monotonic()
        task = asyncio.create_task(joins_later())
        choices = await router.first_pick([1, 2, 3, 4, 5])
        waited = time.monotonic() - t0
        await task
        # found before the discovery loop's next read (5 s): the wait reads the registry itself
        assert [c.address for c in choices] == ["127.0.0.1:7001"] and 0.3 < waited < 1.9, (choices, waited)
        assert router.stats["worker_waits"] == 1

        await state.unregister("llm/127.0.0.1:7001")
        await router.refresh()
        t0 = time.monotonic()
        assert await router.first_pick([1, 2, 3]) == []
        assert 1.9 < time.monotonic() - t0 < 4.0 and router.stats["worker_waits"] == 2

        router.config.worker_wait_s = 0.0
        t0 = time.monotonic()
        assert await router.first_pick([1, 2, 3]) == [] and time.monotonic() - t0 < 0.5
        assert router.stats["worker_waits"] == 2
    finally:
        await router.close()


def test_a_request_waits_for_a_worker_to_register():
    asyncio.run(_scenario())
