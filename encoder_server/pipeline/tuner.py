"""Online choice of the vision forward's thread count on a CPU deployment with decode processes."""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)


class ThreadTuner:
    """On a CPU the vision forward and the decode processes share the cores, and which split is best
    depends on the model and the load: a small tower runs best on one core next to busy decoders, a
    large one needs every core. So measure it: run each setting (1 thread, all cores) for a window,
    keep the one that encoded more patches per second, and re-check the other now and then.

    `threads` is read by the forward thread before each forward (OpenMP's count is per thread);
    0 means torch's default."""

    def __init__(self, batch_stats, threads: int = 0):
        self.stats = batch_stats  # BatchStats: .patches grows as forwards finish
        self.threads = threads

    async def run(self, window_s: float = 1.5, explore_every: int = 8) -> None:
        cores = os.cpu_count() or 1
        if cores < 2:
            return
        options = [1, cores]
        rate = {1: None, cores: None}
        current, windows = 1, 0
        self.threads = current
        while True:
            before = self.stats.patches
            await asyncio.sleep(window_s)
            done = self.stats.patches - before
            if done == 0:
                continue  # idle: nothing to learn
            rate[current] = done / window_s
            windows += 1
            other = options[1 - options.index(current)]
            if rate[other] is None or windows % explore_every == 0:
                nxt = other  # explore
            else:
                nxt = max(options, key=lambda o: rate[o] or 0.0)  # exploit the better one
            if nxt != current:
                log.debug("forward threads %d -> %d (patches/s: %s)", current, nxt, rate)
                current = self.threads = nxt
