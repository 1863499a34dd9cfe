"""Online choice of the vision forward's shape on a CPU: how many forward workers (each with its own batch)
and how many torch intra-op threads each, from measured stage busy fractions.

On a CPU the forward and the decode processes share the cores, and which split is best depends on the
model, the images and the machine: a small tower next to busy decoders runs best on one thread; when the
forward is the slow stage it should get every core the decoders leave; and for small batches intra-op
threading may not scale where a second worker with its own batch does. So the tuner measures, every
window (`Window`: wall seconds, forward busy seconds, the decode processes' CPU seconds, patches encoded):

    budget  = round(cores - decode cores in use)       (at least 1) -- what the decoders leave
    busy    = forward busy seconds / (window x workers)             -- is the forward the bottleneck?
    rate    = patches / second, per shape (a running mean over windows where the forward was the
              bottleneck: a window the load left idle measures the load, not the shape)

and `ForwardPolicy.decide` moves one step at a time:
1. over budget (the decoders need cores back): to the best-rated shape that fits the budget, unless
   the current one measured BETTER x faster than it (its threads are runnable only while it runs: the
   cores were not oversubscribed, the decoders' use grew because the forward fed them faster);
2. forward busy >= BOTTLENECK and budget left: up one level of total threads (an untried shape there
   first: 1 x n+1 and, with two workers allowed, 2 x (n+1)/2 are both tried; the better one is kept);
   with no level left within the budget, a shape one level over it is tried for a window (untried, or on
   an explore window: the budget is rounded, 1.4 cores left read 1, and a decoder that waits on the
   forward leaves its core idle), and kept by the exception of 1 only where it measured faster; a shape
   kept over the budget that way has its level's other shape tried too (1x2 kept, 2x1 untried);
3. forward busy < SLACK (it waits for work): down one level, giving cores to the decoders;
4. otherwise to a measured shape that fits (or is over the budget and measured BETTER x faster than every
   shape that fits) and encodes BETTER x faster than the current one, if one exists.
A move to a shape measured slower than the current one is never taken, except on every `explore_every`-th
window, which re-tries the best alternative (load changes). Invariants: every shape's workers x threads is
at most the cores; a shape over the budget is kept only while it measures faster than every shape within
it (so at saturation the forward's runnable threads plus the decoders' cores stay within the cores); the policy reads only `Window`s, never the clock, so tests drive it with
synthetic stage timings.

`ForwardTuner` is the asyncio loop that samples the measurements and publishes the chosen `Shape`: the
forward reads `threads` before each forward (OpenMP's count is per calling thread) and the batcher reads
`workers` before starting one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from mimo_epd.common.proc_stat import cpu_seconds

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Shape:
    workers: int  # forward workers, each running its own batch
    threads: int  # torch intra-op threads of each

    @property
    def cores(self) -> int:
        return self.workers * self.threads

    def __str__(self) -> str:
        return f"{self.workers}x{self.threads}"


@dataclass
class Window:
    seconds: float  # wall time of the window
    forward_busy_s: float  # forward seconds in it, summed over workers
    decode_cpu_s: float  # CPU seconds the decode processes used in it
    patches: int  # patches encoded in it


def shapes(cores: int, max_workers: int = 1, min_workers: int = 1) -> list[Shape]:
    """Every shape of `min_workers`..`max_workers` workers that fits `cores`, by total threads, fewest workers
    first (a fixed worker count above the cores keeps one thread each: the caller asked for it)."""
    ws = range(max(1, min_workers), max(1, min_workers, max_workers) + 1)
    out = [Shape(w, t) for w in ws for t in range(1, cores + 1) if w * t <= cores]
    return sorted(out, key=lambda s: (s.cores, s.workers)) or [Shape(ws[0], 1)]


class ForwardPolicy:
    BOTTLENECK = 0.8  # forward busy fraction at which the forward is the slow stage
    SLACK = 0.5  # below it the forward waits for work
    BETTER = 1.05  # a measured shape must be this much faster to be moved to
    ALPHA = 0.5  # weight of the newest window in a shape's rate

    def __init__(
        self,
        cores: int,
        max_workers: int = 1,
        min_workers: int = 1,
        explore_every: int = 8,
        start: Shape = Shape(1, 1),
    ):
        self.cores = max(1, cores)
        self.options = shapes(self.cores, max_workers, min_workers)
        self.explore_every = explore_every
        self.current = start if start in self.options else self.options[0]
        self.rate: dict[Shape, float] = {}
        self.windows = 0
        self.budget = self.cores

    def decide(self, w: Window) -> Shape:
        """The shape for the next window, from the one just measured with `self.current`."""
        if w.patches <= 0 or w.seconds <= 0:
            return self.current  # idle: nothing to learn
        self.windows += 1
        cur = self.current
        r = w.patches / w.seconds
        self.budget = max(1, min(self.cores, int(self.cores - w.decode_cpu_s / w.seconds + 0.5)))
        busy = w.forward_busy_s / (w.seconds * cur.workers)
        if busy >= self.BOTTLENECK:  # a rate is what the shape can do, not what a lighter load asked of it
            self.rate[cur] = r if cur not in self.rate else self.ALPHA * r + (1 - self.ALPHA) * self.rate[cur]
        nxt = self._step(cur, busy)
        log.debug(
            "forward window %d at %s: %.1f s, %d patches/s, busy %.2f, decoders %.2f cores, budget %d -> %s "
            "(patches/s by shape %s)",
            self.windows,
            cur,
            w.seconds,
            r,
            busy,
            w.decode_cpu_s / w.seconds,
            self.budget,
            nxt,
            {str(k): round(v) for k, v in self.rate.items()},
        )
        self.current = nxt
        return nxt

    def _step(self, cur: Shape, busy: float) -> Shape:
        fits = [s for s in self.options if s.cores <= self.budget] or self.options[:1]
        if cur.cores > self.budget:  # 1. the decoders need cores back, unless this measured faster than all that fit
            down = self._best(fits, level=max(s.cores for s in fits))
            if down not in self.rate or cur not in self.rate or self.rate[cur] <= self.BETTER * self.rate[down]:
                return down
        allowed = fits + self._faster_over_budget(fits)
        explore = self.windows % self.explore_every == 0
        if busy >= self.BOTTLENECK:  # 2. the forward is the slow stage: one level up, or the other shape here
            # Already over the budget at this level (rule 1 kept it: it measured faster than every shape that
            # fits), the other shape of the level costs no more cores: it is tried too.
            level = allowed if cur.cores <= self.budget else self.options
            same = [s for s in level if s.cores == cur.cores and s != cur and (s not in self.rate or explore)]
            if same:
                return same[0]
            up = [s for s in allowed if s.cores > cur.cores]
            if not up:  # 2b. none within the budget: the cores the budget rounded away may still be idle
                up = [s for s in self.options if s.cores > cur.cores and (s not in self.rate or explore)]
            if up:
                target = self._best(up, level=min(s.cores for s in up))
                if self._may_move(cur, target, explore):
                    return target
        elif busy < self.SLACK and cur.cores > 1:  # 3. the forward waits for work: give a core back
            return self._best(fits, level=cur.cores - 1)
        if cur not in self.rate:  # 4. (never saturated here: nothing to compare it with)
            return cur
        better = [s for s in allowed if s in self.rate and self.rate[s] > self.BETTER * self.rate[cur]]
        return max(better, key=self.rate.__getitem__) if better else cur

    def _faster_over_budget(self, fits: list[Shape]) -> list[Shape]:
        """Measured shapes over the budget that encode BETTER x faster than every measured shape within it."""
        best = max((self.rate[s] for s in fits if s in self.rate), default=None)
        if best is None:
            return []
        return [
            s for s in self.options if s.cores > self.budget and s in self.rate and self.rate[s] > self.BETTER * best
        ]

    def _best(self, candidates: list[Shape], level: int) -> Shape:
        """At `level` total threads: an untried shape first, else the fastest measured."""
        at = [s for s in candidates if s.cores == level] or candidates
        untried = [s for s in at if s not in self.rate]
        return untried[0] if untried else max(at, key=self.rate.__getitem__)

    def _may_move(self, cur: Shape, target: Shape, explore: bool) -> bool:
        return target not in self.rate or explore or self.rate[target] > self.BETTER * self.rate[cur]


class ForwardTuner:
    """Samples the measurements every `window_s` and applies `policy`'s decision.

    `stats()` returns (forward busy seconds, patches) so far, or (busy seconds, patches, forwards); with the
    forward count a window lasts until each worker finished `min_forwards` forwards (at most `max_windows`
    windows of `window_s`): a large tower's forward takes about a second, and a 1.5-s window that sees one or
    two of them measures its rate to ±50 %; and after a change of shape the next window starts once the
    forwards in flight at the change have ended. `decode_pids()` the decode processes."""

    MIN_FORWARDS = 3  # forwards per worker a window must see before it is judged
    MAX_WINDOWS = 4  # ... unless it has lasted this many windows

    def __init__(
        self,
        stats: Callable[[], tuple[float, int]],
        decode_pids: Callable[[], list[int]],
        policy: ForwardPolicy,
        threads: int = 0,
    ):
        self.stats = stats
        self.decode_pids = decode_pids
        self.policy = policy
        self.threads = threads  # 0: torch's default (a fixed --torch-threads, or no tuner)
        self._workers = 1
        self._since = time.monotonic()
        self._worker_s = 0.0  # workers integrated over time until `_since`

    @property
    def workers(self) -> int:
        return self._workers

    @workers.setter
    def workers(self, n: int) -> None:
        now = time.monotonic()
        self._worker_s += self._workers * (now - self._since)
        self._workers, self._since = n, now

    def worker_seconds(self) -> float:
        """The forward's workers integrated over time: the denominator of its busy fraction across shape changes."""
        return self._worker_s + self._workers * (time.monotonic() - self._since)

    def apply(self, shape: Shape) -> None:
        self.threads, self.workers = shape.threads, shape.workers

    def _sample(self) -> tuple[float, int, int | None]:
        busy, patches, *forwards = self.stats()
        return busy, patches, forwards[0] if forwards else None

    async def run(self, window_s: float = 1.5) -> None:
        self.apply(self.policy.current)
        busy0, patches0, forwards0 = self._sample()
        cpu0, t0 = cpu_seconds(self.decode_pids()), time.perf_counter()
        waited = 0
        while True:
            await asyncio.sleep(window_s)
            waited += 1
            busy1, patches1, forwards1 = self._sample()
            seen = None if forwards1 is None or forwards0 is None else forwards1 - forwards0
            if seen is not None and seen < self.MIN_FORWARDS * self.workers and waited < self.MAX_WINDOWS:
                continue  # too few forwards to judge yet (or idle): the window goes on
            cpu1, t1 = cpu_seconds(self.decode_pids()), time.perf_counter()
            w = Window(t1 - t0, busy1 - busy0, max(0.0, cpu1 - cpu0), patches1 - patches0)
            before = self.workers, self.threads
            self.apply(self.policy.decide(w))
            if (self.workers, self.threads) != before and forwards1 is not None:
                # Forwards and patches count when a forward ends: the next window starts once the forwards in
                # flight at the switch (at most the old worker count) have ended, so it measures the new shape
                # alone (a large tower's forward lasts about a second: a third of a 3-forward window).
                await self._settle(forwards1 + before[0], window_s)
                busy1, patches1, forwards1 = self._sample()
                cpu1, t1 = cpu_seconds(self.decode_pids()), time.perf_counter()
            busy0, patches0, forwards0, cpu0, t0, waited = busy1, patches1, forwards1, cpu1, t1, 0

    async def _settle(self, forwards: int, window_s: float) -> None:
        """Waits (up to MAX_WINDOWS windows) until the forward count reaches `forwards`."""
        for _ in range(4 * self.MAX_WINDOWS):
            _, _, seen = self._sample()
            if seen is None or seen >= forwards:
                return
            await asyncio.sleep(window_s / 4)
