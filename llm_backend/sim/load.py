"""Nominal load: how much of a fleet's capacity a request stream asks for, from the cost model.

A request's service time is its prefill run alone in `chunk`-token steps (uncached: prefix hits make the real
load lower) plus its decode tokens at 1/`batch` of a step that decodes `batch` sequences at its mid-output
context. Load = arrival rate x mean service time / workers, so load 0.8 means the workers would be busy 80% of
the time if nothing were cached and decode batches were always full. Traces are time-scaled to a target load.
"""

from __future__ import annotations

from .cost import CostModel
from .trace import SimRequest


def service_seconds(cost: CostModel, r: SimRequest, chunk: int, batch: int) -> float:
    t, done = 0.0, 0
    while done < r.prompt_len:
        n = min(chunk, r.prompt_len - done)
        t += cost.step_seconds([(done, n, done + n == r.prompt_len)])
        done += n
    if r.output_len > 1:
        ctx = r.prompt_len + r.output_len // 2
        t += (r.output_len - 1) * cost.step_seconds([(ctx, 1, True)] * batch) / batch
    return t


def mean_service(cost: CostModel, reqs: list[SimRequest], chunk: int, batch: int, sample: int = 2000) -> float:
    step = max(1, len(reqs) // sample)
    chosen = reqs[::step]
    return sum(service_seconds(cost, r, chunk, batch) for r in chosen) / max(1, len(chosen))


def scale_to_load(cost: CostModel, reqs: list[SimRequest], load: float, workers: int, chunk: int, batch: int) -> dict:
    """Rescales arrival times (in place, keeping their pattern) so the nominal load is `load`; returns the figures."""
    mean = mean_service(cost, reqs, chunk, batch)
    rate = load * workers / mean
    t0 = min(r.arrival for r in reqs)
    span = max(r.arrival for r in reqs) - t0
    native = (len(reqs) - 1) / span if span > 0 else rate
    factor = native / rate
    for r in reqs:
        r.arrival = (r.arrival - t0) * factor
    return {
        "load": load,
        "workers": workers,
        "mean_service_s": round(mean, 5),
        "rate_per_s": round(rate, 4),
        "time_scale": round(factor, 5),
    }
