"""A decode process killed (SIGKILL, as the OOM killer does) is replaced, the images it held are decoded
again, and every shared-memory slot comes back: the pool keeps working instead of failing every image."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np

from encoder_server.decode_pool import DecodeOptions, DecodePool, decode_job
from encoder_server.preprocess import PreprocessConfig
from tests.conftest import encode_image, textured

LIMIT = 50_000_000


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _wait_dead(pid: int) -> None:
    for _ in range(100):
        if not _alive(pid):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"process {pid} still alive after SIGKILL")


def test_killed_worker_is_replaced_and_inflight_images_are_retried():
    small = encode_image(textured(240, 320, seed=1), "JPEG", quality=90)
    big = encode_image(textured(2000, 2600, seed=2), "PNG")  # slow enough to be in flight when the kill lands
    opts = DecodeOptions(max_pixels=LIMIT, resize=True, patchify=True, preprocess=PreprocessConfig())
    expected = {d: decode_job(d, opts, -1)[1] for d in (small, big)}

    async def run():
        pool = DecodePool(2, opts, slot_bytes=64 << 20)
        await pool.start()
        try:
            pids = pool.worker_pids()
            assert len(pids) == 2
            # 1. A worker killed while idle: the next images still decode.
            os.kill(pids[0], signal.SIGKILL)
            await _wait_dead(pids[0])
            # The executor notices the death on its own thread, a moment later: until then images still land on
            # the live worker. Every image decodes either way, and the pool is replaced once it notices.
            out, deadline = [], time.monotonic() + 60
            while (pool.respawns < 1 or len(out) < 3) and time.monotonic() < deadline:
                out.append(await pool.decode(small))
                await asyncio.sleep(0.05)
            assert pool.respawns == 1
            # 2. Workers killed while images are in flight on them: they are decoded again on fresh processes.
            # Eight big images (~0.1 s each on an idle core) keep both workers busy for a while; the kill lands as
            # soon as the replaced pool's processes exist (they start on demand), not after a fixed sleep, which
            # on a quiet machine came after every image was done.
            work = (big,) * 7 + (small,)
            tasks = [asyncio.ensure_future(pool.decode(d)) for d in work]
            victims, deadline = [], time.monotonic() + 30
            while len(victims) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                victims = pool.worker_pids()
            assert victims and not set(victims) & set(pids)  # fresh processes replaced the broken pool
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            assert not all(t.done() for t in tasks)  # the kill came while images were in flight
            results = await asyncio.gather(*tasks)
            assert pool.respawns == 2
            # Every slot is back in the free list, each exactly once.
            assert pool._free.qsize() == pool.max_inflight
            assert sorted(pool._free._queue) == list(range(pool.max_inflight))
            after = [await pool.decode(big)]
            return out, results, after
        finally:
            pool.stop()

    out, results, after = asyncio.run(run())
    for d in out:
        np.testing.assert_array_equal(d.pixels, expected[small])
    for d, data in zip(results + after, (big,) * 7 + (small, big)):
        np.testing.assert_array_equal(d.pixels, expected[data])


def test_an_image_whose_decoder_dies_twice_is_refused_and_the_pool_recovers():
    """The retry is once: a job whose process dies on both attempts fails (BrokenProcessPool, which the server
    answers UNAVAILABLE), and the pool is whole again for the next image."""
    import concurrent.futures

    small = encode_image(textured(64, 64, seed=3), "PNG")
    opts = DecodeOptions(max_pixels=LIMIT)

    async def run():
        pool = DecodePool(1, opts)
        await pool.start()
        try:
            first = pool.worker_pids()[0]
            os.kill(first, signal.SIGKILL)  # the first attempt meets a broken pool...
            await _wait_dead(first)

            async def kill_the_replacement():  # ...and the retry's fresh process is killed while it boots
                while True:
                    pids = [p for p in pool.worker_pids() if p != first]
                    if pids:
                        os.kill(pids[0], signal.SIGKILL)
                        return pids[0]
                    await asyncio.sleep(0.005)

            k = asyncio.ensure_future(kill_the_replacement())
            try:
                await pool.decode(small)
                outcome = "decoded"
            except concurrent.futures.process.BrokenProcessPool:
                outcome = "broken"
            await k
            respawns = pool.respawns
            return outcome, respawns, await pool.decode(small), pool._free.qsize() == pool.max_inflight
        finally:
            pool.stop()

    outcome, respawns, last, slots_back = asyncio.run(run())
    assert outcome == "broken" and respawns == 2
    assert last.pixels.shape == (64, 64, 3) and slots_back
