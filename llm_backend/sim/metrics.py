"""What a simulation reports: latency percentiles per length class, throughput, cache hits, queue lengths."""

from __future__ import annotations

import numpy as np

from mimo_epd.common.stats import summary

from .trace import BUCKETS, length_class


def _pct(values) -> dict:
    if not len(values):
        return {"n": 0}
    out = summary(values, 1.0, 4)
    return {"n": len(values), "p50": out["p50"], "p90": out["p90"], "p99": out["p99"], "mean": out["avg"]}


def queue_series(samples_per_worker: list[list[tuple[float, int, int]]], end: float, points: int = 40) -> dict:
    """Waiting and running requests summed over workers, averaged over `points` equal time bins."""
    if end <= 0:
        return {"t": [], "waiting": [], "running": []}
    edges = np.linspace(0, end, points + 1)
    waiting = np.zeros(points)
    running = np.zeros(points)
    for samples in samples_per_worker:
        if not samples:
            continue
        a = np.asarray(samples, dtype=float)
        idx = np.clip(np.searchsorted(edges, a[:, 0], side="right") - 1, 0, points - 1)
        cnt = np.bincount(idx, minlength=points)
        w = np.bincount(idx, weights=a[:, 1], minlength=points)
        r = np.bincount(idx, weights=a[:, 2], minlength=points)
        nz = cnt > 0
        waiting[nz] += w[nz] / cnt[nz]
        running[nz] += r[nz] / cnt[nz]
    return {
        "t": [round(float(x), 3) for x in edges[1:]],
        "waiting": [round(float(x), 2) for x in waiting],
        "running": [round(float(x), 2) for x in running],
    }


def summarize(finished, samples_per_worker, worker_stats: list[dict], rejected: int = 0) -> dict:
    if not finished:
        return {"requests": 0, "rejected": rejected}
    start = min(f.arrival for f in finished)
    end = max(f.finish for f in finished)
    span = max(end - start, 1e-9)
    ttft = {name: [] for name, _, _ in BUCKETS}
    e2e = {name: [] for name, _, _ in BUCKETS}
    for f in finished:
        c = length_class(f.prompt_len)
        ttft[c].append(f.first_token - f.arrival)
        e2e[c].append(f.finish - f.arrival)
    prompt = sum(f.prompt_len for f in finished)
    hit = sum(f.cached_tokens for f in finished)
    out = sum(f.output_len for f in finished)
    short = [f.first_token - f.arrival for f in finished if f.prompt_len < BUCKETS[0][2]]
    long = [f.first_token - f.arrival for f in finished if f.prompt_len >= BUCKETS[0][2]]
    return {
        "requests": len(finished),
        "rejected": rejected,
        "errors": sum(f.reason == "error" for f in finished),
        "ttft_s": {
            "all": _pct([f.first_token - f.arrival for f in finished]),
            "short_lt_64K": _pct(short),
            "long_ge_64K": _pct(long),
            "by_class": {k: _pct(v) for k, v in ttft.items() if v},
        },
        "e2e_s": {
            "all": _pct([f.finish - f.arrival for f in finished]),
            "by_class": {k: _pct(v) for k, v in e2e.items() if v},
        },
        "throughput": {
            "seconds": round(span, 3),
            "requests_per_s": round(len(finished) / span, 4),
            "input_tokens_per_s": round(prompt / span, 1),
            "output_tokens_per_s": round(out / span, 1),
        },
        "hit_tokens": hit,
        "prompt_tokens": prompt,
        "hit_token_rate": round(hit / max(prompt, 1), 4),
        "preemptions": sum(s["preemptions"] for s in worker_stats),
        "steps": sum(s["steps"] for s in worker_stats),
        "busy_fraction": [round(s["busy_s"] / span, 3) for s in worker_stats],
        "queue": queue_series(samples_per_worker, end),
        **_tier_totals(worker_stats),
    }


def _tier_totals(worker_stats: list[dict]) -> dict:
    """Tiered workers (sim/tiers.py): hit tokens per tier and the loads' bytes and seconds, summed."""
    tiered = [s for s in worker_stats if "hit_tokens_by_tier" in s]
    if not tiered:
        return {}
    hits = {k: sum(s["hit_tokens_by_tier"][k] for s in tiered) for k in tiered[0]["hit_tokens_by_tier"]}
    loads = {k: sum(s["tier_loads"][k] for s in tiered) for k in tiered[0]["tier_loads"]}
    return {"hit_tokens_by_tier": hits, "tier_loads": {k: round(v, 4) for k, v in loads.items()}}
