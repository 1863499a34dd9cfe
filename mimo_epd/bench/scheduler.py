"""`mimo-epd bench scheduler`: the engine's wait-queue policies on the long-context mix (prompts over
0-64K / 64K-256K / 256K-1M, Poisson arrivals) at several nominal loads, one simulated worker (the real
Scheduler and SWA radix cache on a virtual clock; llm_backend/sim), MiMo-V2.5-Pro shape on the h200 roofline:

- `fcfs`: first come first served;
- `uncached_first`: fewest uncached tokens first, minus --wait-penalty tokens per second waited;
- `uncached_first_buckets`: the same inside length buckets (64K, 256K) that take turns (the engine's default).

Every (policy, load) runs on --seeds independent traces of --requests each (the same traces for every policy).
Reports TTFT P50/P90/P99 per length class, short (< 64K) and long (>= 64K), pooled over the seeds, end-to-end
latency and throughput. `ratios` compares each non-FCFS policy with FCFS at each load (`by_load`), and the
engine's default policy at 80% load at the top: `long_ttft_p90_vs_fcfs` and `short_ttft_p99_vs_fcfs`, each with
`_ci_lo` / `_ci_hi`, the 95% interval of a paired bootstrap over requests stratified by seed (mimo_epd/common/stats.py),
and `_seeds`, the per-seed ratios' spread. Two PNGs go next to the JSON (--out-dir): the ratios vs load with
their intervals (bench_scheduler.png) and TTFT P90 vs load per policy (bench_scheduler_ttft.png).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from llm_backend.sim.engine import SimWorker, simulate
from llm_backend.sim.load import scale_to_load
from llm_backend.sim.metrics import _pct, summarize
from llm_backend.sim.trace import long_context_mix
from mimo_epd.common.stats import across_seeds, p, paired_ratio, with_ci
from mimo_epd.sim.plot import ratio_vs_load, ttft_vs_load
from mimo_epd.sim.setup import SCHEDULERS, add_model_flags, build, describe

DEFAULT_POLICY = "uncached_first_buckets"  # the engine's (length buckets on)
SHORT = 65536
RATIOS = (("long_ttft_p90_vs_fcfs", "long", 90), ("short_ttft_p99_vs_fcfs", "short", 99))


def run_one(cost, cfg, reqs) -> tuple[dict, dict[int, tuple[float, int]]]:
    """(summary, {request index: (TTFT, prompt length)}) of one single-worker run."""
    w = simulate(SimWorker(cost, cfg), reqs)
    ttft = {f.index: (f.first_token - f.arrival, f.prompt_len) for f in w.finished}
    return summarize(w.finished, [w.queue_samples], [w.stats()], len(w.rejected)), ttft


def _aligned(runs: list[dict[int, tuple[float, int]]], ref: list[dict[int, tuple[float, int]]], cls: str):
    """Per seed, the TTFTs of one length class of both runs, aligned by request index (paired)."""
    num, den = [], []
    for a, b in zip(runs, ref):
        keys = sorted(k for k in a.keys() & b.keys() if (a[k][1] >= SHORT) == (cls == "long"))
        num.append([a[k][0] for k in keys])
        den.append([b[k][0] for k in keys])
    return num, den


def _ratios(ttfts: dict, pol: str, load: float, n_boot: int) -> dict:
    """`pol` vs FCFS at `load`: each ratio with its bootstrap interval and per-seed spread."""
    out: dict = {"policy": pol, "load": load}
    for key, cls, q in RATIOS:
        num, den = _aligned(ttfts[(pol, load)], ttfts[("fcfs", load)], cls)
        with_ci(out, key, paired_ratio(num, den, p(q), n_boot=n_boot))
        per_seed = [paired_ratio([a], [b], p(q), n_boot=0)["value"] for a, b in zip(num, den)]
        spread = across_seeds(per_seed)
        out[f"{key}_seeds"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in spread.items()}
    return out


def _pooled(summaries: list[dict], ttfts: list[dict[int, tuple[float, int]]]) -> dict:
    """One (policy, load) over its seeds: TTFT percentiles of the pooled requests, the rest per seed (mean)."""
    all_t = [t for d in ttfts for t, _ in d.values()]
    short = [t for d in ttfts for t, n in d.values() if n < SHORT]
    long = [t for d in ttfts for t, n in d.values() if n >= SHORT]
    first = summaries[0]
    return {
        "requests": sum(s["requests"] for s in summaries),
        "rejected": sum(s["rejected"] for s in summaries),
        "ttft_s": {"all": _pct(all_t), "short_lt_64K": _pct(short), "long_ge_64K": _pct(long)},
        "e2e_p90_s_per_seed": [s["e2e_s"]["all"].get("p90") for s in summaries],
        "throughput": {
            k: round(float(np.mean([s["throughput"][k] for s in summaries])), 4) for k in first["throughput"]
        },
        "preemptions": sum(s["preemptions"] for s in summaries),
        "busy_fraction_per_seed": [s["busy_fraction"][0] for s in summaries],
        **({"queue": first["queue"]} if "queue" in first else {}),
    }


def _simulate_all(args, loads, policies, seeds):
    cost, cfg0 = build(args)
    summaries: dict = {}
    ttfts: dict = {}
    rates: dict = {}
    seconds: dict = {}
    for seed in seeds:
        base = long_context_mix(args.requests, 1.0, seed=seed, unit=args.unit)
        for load in loads:
            reqs0 = [replace(r) for r in base]
            rates.setdefault(load, []).append(
                scale_to_load(cost, reqs0, load, 1, cfg0.chunk_size, cfg0.max_running)["rate_per_s"]
            )
            for pol in policies:
                _, cfg = build(args, pol)
                t0 = time.perf_counter()
                res, tt = run_one(cost, cfg, [replace(r) for r in reqs0])
                if not args.queues:
                    res.pop("queue", None)
                summaries.setdefault((pol, load), []).append(res)
                ttfts.setdefault((pol, load), []).append(tt)
                seconds[f"{pol}/{load}/{seed}"] = round(time.perf_counter() - t0, 2)
    return cost, cfg0, summaries, ttfts, rates, seconds


def _plots(out_dir: Path, by_load: dict, results: dict, loads, policies) -> list[str]:
    others = [q for q in policies if q != "fcfs"]
    panels = {
        f"{cls} TTFT P{q} vs FCFS": {
            pol: [
                (ld, *(by_load[str(ld)][pol].get(key + s) for s in ("", "_ci_lo", "_ci_hi")))
                for ld in loads
                if pol in by_load[str(ld)]
            ]
            for pol in others
        }
        for key, cls, q in RATIOS
    }
    png = ratio_vs_load(out_dir / "bench_scheduler.png", "long-context mix: wait-queue policy / FCFS vs load", panels)
    ttft = {
        cls: {q: [(ld, results[f"{q}@{ld}"]["ttft_s"][cls].get("p90") or 0.0) for ld in loads] for q in policies}
        for cls in ("long_ge_64K", "short_lt_64K")
    }
    png2 = ttft_vs_load(out_dir / "bench_scheduler_ttft.png", "long-context mix: TTFT P90 vs load", ttft)
    return [png, png2]


def merge(paths: list[str], out_dir: Path) -> dict:
    """One JSON (and the PNGs) from runs of the same set-up at different loads (a long measurement run in
    pieces): `by_load`, `results` and `seconds` are united, the top ratios are the 80% load's if present."""
    parts = [json.loads(Path(x).read_text()) for x in paths]
    first = parts[0]
    by_load: dict = {}
    results: dict = {}
    seconds: dict = {}
    for d in parts:
        keep = {k: d["config"][k] for k in ("requests", "seeds", "policies")}
        if keep != {k: first["config"][k] for k in keep}:
            raise SystemExit(f"--merge: runs differ in requests / seeds / policies: {keep}")
        by_load.update(d["ratios"]["by_load"])
        results.update(d["results"])
        seconds.update({k: v for k, v in d["seconds"].items() if k != "total"})
    loads = sorted(float(x) for x in by_load)
    policies = first["config"]["policies"]
    at = "0.8" if "0.8" in by_load else str(loads[len(loads) // 2])
    main_pol = DEFAULT_POLICY if DEFAULT_POLICY in by_load[at] else next(iter(by_load[at]))
    plots = _plots(out_dir, by_load, results, loads, policies)
    result = {
        **first,
        "config": {**first["config"], "loads": loads, "merged_from": paths},
        "ratios": {**by_load[at][main_pol], "by_load": by_load},
        "results": results,
        "plot": plots[0],
        "plots": plots,
        "seconds": {"total": round(sum(d["seconds"]["total"] for d in parts), 1), **seconds},
    }
    (out_dir / "bench_scheduler.json").write_text(json.dumps(result, indent=1))
    return result


def main(args) -> dict:
    if args.merge:
        return merge(args.merge, Path(args.out_dir))
    if args.quick:
        args.requests, args.loads, args.seeds, args.bootstrap = min(args.requests, 40), "0.8", 1, 200
    loads = [float(x) for x in args.loads.split(",") if x]
    policies = [q for q in args.policies.split(",") if q] if args.policies else list(SCHEDULERS)
    unknown = [q for q in policies if q not in SCHEDULERS]
    if unknown or "fcfs" not in policies or len(policies) < 2:
        raise SystemExit(f"--policies: fcfs and at least one of {', '.join(SCHEDULERS)} (got {args.policies!r})")
    seeds = list(range(args.seed, args.seed + args.seeds))
    t_all = time.perf_counter()
    cost, cfg0, summaries, ttfts, rates, seconds = _simulate_all(args, loads, policies, seeds)
    results = {}
    for (pol, ld), sums in summaries.items():
        results[f"{pol}@{ld}"] = {**_pooled(sums, ttfts[(pol, ld)]), "rate_per_s_per_seed": rates[ld]}
    by_load = {str(ld): {q: _ratios(ttfts, q, ld, args.bootstrap) for q in policies if q != "fcfs"} for ld in loads}
    at = 0.8 if 0.8 in loads else loads[len(loads) // 2]
    main_pol = DEFAULT_POLICY if DEFAULT_POLICY in policies else next(q for q in policies if q != "fcfs")
    ratios = {**by_load[str(at)][main_pol], "by_load": by_load}
    plots = _plots(Path(args.out_dir), by_load, results, loads, policies)
    result = {
        "bench": "scheduler",
        "config": {
            "requests": args.requests,
            "seeds": seeds,
            "loads": loads,
            "policies": policies,
            "bootstrap": {"replicates": args.bootstrap, "level": 0.95, "over": "requests, paired, stratified by seed"},
            "mix": "prompt lengths 80% 0-64K, 15% 64K-256K, 5% 256K-1M (log-uniform within), outputs 64-1024",
            **describe(cost, cfg0),
        },
        "ratios": ratios,
        "results": results,
        "plot": plots[0],
        "plots": plots,
        "seconds": {"total": round(time.perf_counter() - t_all, 1), **seconds},
    }
    (Path(args.out_dir) / "bench_scheduler.json").write_text(json.dumps(result, indent=1))
    return result


def add_arguments(q) -> None:
    q.add_argument("--requests", type=int, default=300, help="requests of the long-context mix per seed (default: 300)")
    q.add_argument("--seed", type=int, default=0, help="the first trace seed (default: 0)")
    q.add_argument("--seeds", type=int, default=1, help="traces (seeds --seed, --seed+1, ...) per point (default: 1)")
    q.add_argument(
        "--bootstrap", type=int, default=1000, help="bootstrap replicates of each ratio's interval (default: 1000)"
    )
    q.add_argument(
        "--loads", default="0.6,0.7,0.8,0.9", help="nominal loads, comma-separated (default: 0.6,0.7,0.8,0.9)"
    )
    q.add_argument(
        "--policies", default="", help=f"wait-queue policies, fcfs and others (default: all: {', '.join(SCHEDULERS)})"
    )
    q.add_argument("--queues", action="store_true", help="include queue lengths over time (the first seed's) per run")
    q.add_argument("--out-dir", default=".", help="where bench_scheduler.json and the PNGs go (default: .)")
    q.add_argument("--quick", action="store_true", help="a seconds-long version (CI): 40 requests at 80%% load")
    q.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="JSON",
        help="instead of simulating, unite bench_scheduler.json files of one set-up run at different loads "
        "(a long run in pieces) into one JSON and its PNGs in --out-dir",
    )
    add_model_flags(q, shape="pro", kv_gib=160.0, page=128, chunk=16384, max_running=32, unit=128)
