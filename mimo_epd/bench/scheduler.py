"""`mimo-epd bench scheduler`: the engine's wait-queue policies on the long-context mix (prompts over
0-64K / 64K-256K / 256K-1M, Poisson arrivals) at 70/80/90% nominal load, one simulated worker (the real
Scheduler and SWA radix cache on a virtual clock; llm_backend/sim), MiMo-V2.5-Pro shape on the h200 roofline:

- `fcfs`: first come first served;
- `uncached_first`: fewest uncached tokens first, minus --wait-penalty tokens per second waited;
- `uncached_first_buckets`: the same inside length buckets (64K, 256K) that take turns (the engine's default).

Reports TTFT P50/P90/P99 per length class, short (< 64K) and long (>= 64K), end-to-end latency and throughput;
`ratios` compares the non-FCFS policy with the lowest long-request TTFT P90 at 80% load to FCFS there
(`long_ttft_p90_vs_fcfs`, `short_ttft_p99_vs_fcfs`), with the same ratios for every load. A PNG of long and
short TTFT P90 vs load per policy is written next to the JSON (--out-dir).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from llm_backend.sim.engine import SimWorker, simulate
from llm_backend.sim.load import scale_to_load
from llm_backend.sim.metrics import summarize
from llm_backend.sim.trace import long_context_mix
from mimo_epd.sim.plot import ttft_vs_load
from mimo_epd.sim.setup import SCHEDULERS, add_model_flags, build, describe


def run_one(cost, cfg, reqs) -> dict:
    w = simulate(SimWorker(cost, cfg), reqs)
    return summarize(w.finished, [w.queue_samples], [w.stats()], len(w.rejected))


def _ratios(by: dict, load: float) -> dict:
    fc = by.get(("fcfs", load))
    others = {p: v for (p, ld), v in by.items() if ld == load and p != "fcfs" and v["ttft_s"]["long_ge_64K"].get("p90")}
    if not fc or not others or not fc["ttft_s"]["long_ge_64K"].get("p90"):
        return {}
    best = min(others, key=lambda p: others[p]["ttft_s"]["long_ge_64K"]["p90"])
    b = others[best]
    return {
        "policy": best,
        "load": load,
        "long_ttft_p90_vs_fcfs": round(b["ttft_s"]["long_ge_64K"]["p90"] / fc["ttft_s"]["long_ge_64K"]["p90"], 3),
        "short_ttft_p99_vs_fcfs": round(b["ttft_s"]["short_lt_64K"]["p99"] / fc["ttft_s"]["short_lt_64K"]["p99"], 3),
    }


def main(args) -> dict:
    if args.quick:
        args.requests, args.loads = min(args.requests, 40), "0.8"
    loads = [float(x) for x in args.loads.split(",") if x]
    cost, cfg0 = build(args)
    base = long_context_mix(args.requests, 1.0, seed=args.seed, unit=args.unit)
    by, seconds = {}, {}
    t_all = time.perf_counter()
    for load in loads:
        reqs0 = [replace(r) for r in base]
        scaled = scale_to_load(cost, reqs0, load, 1, cfg0.chunk_size, cfg0.max_running)
        for pol in SCHEDULERS:
            _, cfg = build(args, pol)
            t0 = time.perf_counter()
            res = run_one(cost, cfg, [replace(r) for r in reqs0])
            res["rate_per_s"] = scaled["rate_per_s"]
            if not args.queues:
                res.pop("queue", None)
            by[(pol, load)] = res
            seconds[f"{pol}/{load}"] = round(time.perf_counter() - t0, 2)
    at = 0.8 if 0.8 in loads else loads[len(loads) // 2]
    ratios = {**_ratios(by, at), "by_load": {str(ld): _ratios(by, ld) for ld in loads}}
    out_dir = Path(args.out_dir)
    panels = {
        cls: {p: [(ld, by[(p, ld)]["ttft_s"][cls].get("p90") or 0.0) for ld in loads] for p in SCHEDULERS}
        for cls in ("long_ge_64K", "short_lt_64K")
    }
    png = ttft_vs_load(
        out_dir / "bench_scheduler.png", "long-context mix: TTFT P90 vs load per wait-queue policy", panels
    )
    result = {
        "bench": "scheduler",
        "config": {
            "requests": args.requests,
            "seed": args.seed,
            "loads": loads,
            "policies": list(SCHEDULERS),
            "mix": "prompt lengths 80% 0-64K, 15% 64K-256K, 5% 256K-1M (log-uniform within), outputs 64-1024",
            **describe(cost, cfg0),
        },
        "ratios": ratios,
        "results": {f"{p}@{ld}": v for (p, ld), v in by.items()},
        "plot": png,
        "seconds": {"total": round(time.perf_counter() - t_all, 1), **seconds},
    }
    (out_dir / "bench_scheduler.json").write_text(json.dumps(result, indent=1))
    return result


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=300, help="requests of the long-context mix (default: 300)")
    p.add_argument("--seed", type=int, default=0, help="the mix's seed (default: 0)")
    p.add_argument("--loads", default="0.7,0.8,0.9", help="nominal loads, comma-separated (default: 0.7,0.8,0.9)")
    p.add_argument("--queues", action="store_true", help="include queue lengths over time per run")
    p.add_argument("--out-dir", default=".", help="where bench_scheduler.json and bench_scheduler.png go (default: .)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI): 40 requests at 80%% load")
    add_model_flags(p, shape="pro", kv_gib=160.0, page=128, chunk=16384, max_running=32, unit=128)
