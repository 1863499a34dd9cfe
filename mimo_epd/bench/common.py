"""Shared pieces of the benchmarks: closed-loop load and latency statistics (server subprocesses are in
mimo_epd.testing.servers)."""

from __future__ import annotations

import asyncio
import time

from mimo_epd.common.stats import summary


def latency_stats(latencies_s: list[float], wall_s: float) -> dict:
    return {
        "requests": len(latencies_s),
        "seconds": round(wall_s, 3),
        "qps": round(len(latencies_s) / wall_s, 3),
        **summary(latencies_s, 1e3, 2, "_ms"),
    }


async def closed_loop(send, n: int, concurrency: int) -> tuple[list[float], float, int]:
    """`concurrency` clients each send their next request as soon as the previous answer arrives, until
    `n` requests have been sent. `send(i)` is a coroutine. Returns (latencies, wall seconds, failures)."""
    latencies: list[float] = []
    failures = 0
    counter = iter(range(n))

    async def client() -> None:
        nonlocal failures
        for i in counter:
            t0 = time.perf_counter()
            try:
                await send(i)
                latencies.append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - counted and reported
                failures += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start, failures
