"""Shutdown helpers: a step that overruns is abandoned and named; the task dump shows the innermost await."""

import asyncio
import logging

from mimo_epd.common.shutdown import await_chain, bounded


async def _inner_wait(ev: asyncio.Event) -> None:
    await ev.wait()


async def _outer(ev: asyncio.Event) -> None:
    await _inner_wait(ev)


def test_await_chain_reaches_the_innermost_coroutine():
    async def main():
        ev = asyncio.Event()
        task = asyncio.create_task(_outer(ev), name="waiter")
        await asyncio.sleep(0)
        chain = await_chain(task)
        ev.set()
        await task
        return chain

    chain = asyncio.run(main())
    assert chain.startswith("_outer (") and "-> _inner_wait (" in chain and "wait (" in chain.split("->")[-1]


def test_bounded_abandons_a_step_that_overruns_and_names_it(caplog):
    async def forever():
        await asyncio.Event().wait()

    async def main():
        t0 = asyncio.get_running_loop().time()
        await bounded(forever(), 0.2, "waiting for nothing")
        await bounded(asyncio.sleep(0), 1.0, "a quick step")
        return asyncio.get_running_loop().time() - t0

    with caplog.at_level(logging.WARNING, logger="mimo_epd"):
        took = asyncio.run(main())
    assert took < 2.0
    assert [r.getMessage() for r in caplog.records] == ["shutdown: waiting for nothing took over 0.2s; abandoned"]
