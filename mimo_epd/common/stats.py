"""The benchmarks' statistics, one module: percentiles (one definition for every figure) and confidence intervals
for ratios (a paired, seed-stratified bootstrap over requests).

Percentiles: numpy's default (linear interpolation between the two nearest ranks), in `percentile` and
`summary`; every benchmark, the simulator's report and the load tests use them, so a P90 means the same thing in
every JSON.

Intervals:
A simulator benchmark runs every policy on the same requests (one trace per seed), so a ratio such as "long
TTFT P90 of policy A over FCFS's" compares two samples that are *paired* by request. `paired_ratio` resamples
request indices with replacement inside each seed (stratified: every replicate keeps each seed's request
count), applies the same indices to both sides, pools the seeds and takes stat(numerator) / stat(denominator).
The interval is the percentile interval of `n_boot` replicates; the point is the ratio on the full data.

Invariants: `lo <= point <= hi` is not guaranteed for skewed statistics (a percentile bootstrap can exclude its
own point), so the point is reported as computed and the bounds as resampled; a ratio whose denominator is 0 in
a replicate is skipped (`n_boot_used` counts the rest); everything is deterministic for a given `seed`.

Requests of one run are not independent (they share queues), so a bootstrap over requests understates the
spread a new trace would show; `across_seeds` gives the other view, the spread of the per-seed ratios (min,
max and a t interval of their mean), which the benchmarks report next to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

Stat = Callable[[np.ndarray], float]


def percentile(values: Sequence[float], q: float, digits: int | None = None) -> float:
    """The q-th percentile (0-100) of `values` (0.0 for none), rounded to `digits` when given."""
    if not len(values):
        return 0.0
    v = float(np.percentile(np.asarray(values, dtype=float), q))
    return round(v, digits) if digits is not None else v


def summary(values: Sequence[float], scale: float = 1.0, digits: int = 4, suffix: str = "", qs=(50, 90, 99)) -> dict:
    """{"p50<suffix>": .., "p90<suffix>": .., "p99<suffix>": .., "avg<suffix>": ..} of values * scale (None for
    none): the latency block every report shares."""
    keys = [f"p{q:g}{suffix}" for q in qs] + [f"avg{suffix}"]
    if not len(values):
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=float) * scale
    out = {f"p{q:g}{suffix}": round(float(np.percentile(a, q)), digits) for q in qs}
    out[f"avg{suffix}"] = round(float(a.mean()), digits)
    return out


def p(q: float) -> Stat:
    """The q-th percentile (0-100) as a statistic."""
    return lambda a: float(np.percentile(a, q)) if a.size else float("nan")


def total(a: np.ndarray) -> float:
    return float(a.sum())


def _pool(groups: Sequence[np.ndarray], idx: Sequence[np.ndarray] | None = None) -> np.ndarray:
    if idx is None:
        return np.concatenate([np.asarray(g, dtype=float) for g in groups]) if groups else np.zeros(0)
    return np.concatenate([np.asarray(g, dtype=float)[i] for g, i in zip(groups, idx)])


def _stat_or_none(stat: Stat, a: np.ndarray) -> float | None:
    if not a.size:
        return None
    v = stat(a)
    return v if math.isfinite(v) else None


def paired_ratio(
    num: Sequence[Sequence[float]],
    den: Sequence[Sequence[float]],
    stat: Stat,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> dict:
    """stat(num) / stat(den) with a paired, seed-stratified bootstrap interval.

    `num[s]` and `den[s]` are seed s's per-request values of the two sides, aligned (element i is the same
    request). Returns {"value", "lo", "hi", "n", "n_boot_used"} (value / bounds None when undefined)."""
    if len(num) != len(den):
        raise ValueError(f"numerator has {len(num)} seeds, denominator {len(den)}")
    a = [np.asarray(x, dtype=float) for x in num]
    b = [np.asarray(x, dtype=float) for x in den]
    for s, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(f"seed {s}: {x.size} numerator values, {y.size} denominator values (must be paired)")
    n = int(sum(x.size for x in a))
    out: dict = {"value": None, "lo": None, "hi": None, "n": n, "n_boot_used": 0}
    top, bottom = _stat_or_none(stat, _pool(a)), _stat_or_none(stat, _pool(b))
    if top is None or not bottom:
        return out
    out["value"] = top / bottom
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_boot):
        idx = [rng.integers(0, x.size, x.size) for x in a]
        t, d = _stat_or_none(stat, _pool(a, idx)), _stat_or_none(stat, _pool(b, idx))
        if t is not None and d:
            reps.append(t / d)
    out["n_boot_used"] = len(reps)
    if reps:
        tail = (1.0 - level) / 2 * 100
        out["lo"], out["hi"] = (float(v) for v in np.percentile(reps, [tail, 100 - tail]))
    return out


# Two-sided 95% Student t quantiles by degrees of freedom (1-10), then the normal's.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def across_seeds(values: Sequence[float | None]) -> dict:
    """The spread of per-seed ratios: {"per_seed", "mean", "min", "max", "lo", "hi"} (a 95% t interval of the
    mean; None with fewer than two defined values)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    out: dict = {"per_seed": [None if v is None else round(float(v), 4) for v in values]}
    if not vals:
        return {**out, "mean": None, "min": None, "max": None, "lo": None, "hi": None}
    m = float(np.mean(vals))
    out.update(mean=m, min=min(vals), max=max(vals), lo=None, hi=None)
    if len(vals) > 1:
        dof = len(vals) - 1
        t = _T95[dof - 1] if dof <= len(_T95) else 1.96
        half = t * float(np.std(vals, ddof=1)) / math.sqrt(len(vals))
        out["lo"], out["hi"] = m - half, m + half
    return out


def with_ci(ratios: dict, key: str, r: dict, digits: int = 3) -> None:
    """Writes a `paired_ratio` result into a benchmark's `ratios`: `key`, `key_ci_lo`, `key_ci_hi`."""

    def rnd(v):
        return None if v is None else round(v, digits)

    ratios[key] = rnd(r["value"])
    ratios[f"{key}_ci_lo"] = rnd(r["lo"])
    ratios[f"{key}_ci_hi"] = rnd(r["hi"])
