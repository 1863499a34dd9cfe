"""`mimo-epd bench routing`: the Mooncake trace replayed through a simulated fleet of 8 and 32 workers (by
default) at 60-90% nominal load, under every routing policy (the real mimo_epd.router.policies classes over a
real page-hash index fed by each simulated worker's KV events; mimo_epd/sim).

Every point runs on --seeds samples of the trace's conversations (`--sessions` of them each, every turn; seed s
draws another sample), the same samples for every policy. Reports per (workers, load, policy) TTFT
P50/P90/P99 and hit tokens pooled over the seeds, end-to-end P90 and throughput, and ratios at the 8-worker,
80% point (or the largest fleet / nearest load run) and per point (`by_point`): affinity's cached (hit) tokens
vs round robin's (`affinity_cached_vs_round_robin`), vs SGLang's gateway algorithm (`cache_aware`) and vs the
best other policy's, and affinity's TTFT P90 vs the best other policy's (`affinity_ttft_p90_vs_best_peer`, the
peer with the lowest TTFT P90). Each ratio has `_ci_lo` / `_ci_hi`: the 95% interval of a bootstrap over
requests, paired (the same requests on both sides) and stratified by seed (mimo_epd/common/stats.py). A PNG of TTFT P90
vs load per policy (one panel per fleet size) is written next to the JSON (--out-dir).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from llm_backend.sim.load import scale_to_load
from llm_backend.sim.metrics import _pct
from mimo_epd.common.flags import add_arguments as add_flag_arguments
from mimo_epd.common.flags import from_args
from mimo_epd.common.stats import p, paired_ratio, total, with_ci
from mimo_epd.router.policies import POLICIES, PolicyConfig
from mimo_epd.sim.fleet import Fleet
from mimo_epd.sim.plot import ttft_vs_load
from mimo_epd.sim.setup import add_model_flags, add_trace_flags, build, describe
from mimo_epd.sim.traces import mooncake_requests


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _point(runs: list[tuple[dict, dict]]) -> dict:
    """One (workers, load, policy) over its seeds: `runs` = [(summary, {index: (ttft, cached)})]."""
    ttft = [t for _, d in runs for t, _ in d.values()]
    hit = sum(s["hit_tokens"] for s, _ in runs)
    prompt = sum(s["prompt_tokens"] for s, _ in runs)
    return {
        "requests": sum(s["requests"] for s, _ in runs),
        "ttft_s": {k: v for k, v in _pct(ttft).items() if k in ("p50", "p90", "p99")},
        "e2e_p90_s_per_seed": [s["e2e_s"]["all"].get("p90") for s, _ in runs],
        "hit_tokens": hit,
        "hit_token_rate": round(hit / max(1, prompt), 4),
        "input_tokens_per_s_per_seed": [s["throughput"]["input_tokens_per_s"] for s, _ in runs],
        "preemptions": sum(s["preemptions"] for s, _ in runs),
        "picks": [s["picks"] for s, _ in runs],
        "rejected": sum(s["rejected"] for s, _ in runs),
    }


def _paired(a: list[dict], b: list[dict], field: int) -> tuple[list, list]:
    num, den = [], []
    for x, y in zip(a, b):
        keys = sorted(x.keys() & y.keys())
        num.append([x[k][field] for k in keys])
        den.append([y[k][field] for k in keys])
    return num, den


def _ratios(points: dict, per_req: dict, W: int, L: float, n_boot: int) -> dict:
    """Affinity against the others at (W, L), each ratio with its interval."""
    at = {pol: v for (w, ld, pol), v in points.items() if w == W and ld == L}
    out: dict = {"workers": W, "load": L}
    if "affinity" not in at:
        return out
    a = per_req[(W, L, "affinity")]
    peers = {k: v for k, v in at.items() if k != "affinity"}
    if not peers:
        return out
    best_hit = max(peers, key=lambda k: peers[k]["hit_tokens"])
    best_ttft = min(peers, key=lambda k: peers[k]["ttft_s"]["p90"])
    out["best_hit_peer"], out["best_ttft_peer"] = best_hit, best_ttft
    for key, peer in (
        ("affinity_cached_vs_round_robin", "round_robin"),
        ("affinity_cached_vs_sglang_gateway", "cache_aware"),
        ("affinity_cached_vs_best_peer", best_hit),
    ):
        if peer in at:
            with_ci(out, key, paired_ratio(*_paired(a, per_req[(W, L, peer)], 1), total, n_boot=n_boot))
    with_ci(
        out,
        "affinity_ttft_p90_vs_best_peer",
        paired_ratio(*_paired(a, per_req[(W, L, best_ttft)], 0), p(90), n_boot=n_boot),
    )
    return out


def _simulate_all(args, workers, loads, policies, seeds):
    cost, cfg = build(args)
    pcfg = from_args(PolicyConfig, args)
    bases = [mooncake_requests(args.trace, args.requests, cfg.unit, args.offset, args.sessions, s) for s in seeds]
    runs: dict = {}
    seconds: dict = {}
    rates: dict = {}
    for W in workers:
        for load in loads:
            for base in bases:
                reqs = [replace(r) for r in base]
                scaled = scale_to_load(cost, reqs, load, W, cfg.chunk_size, cfg.max_running)
                rates.setdefault((W, load), []).append(scaled["rate_per_s"])
                for pol in policies:
                    t0 = time.perf_counter()
                    fleet = Fleet(cost, cfg, W, pol, pcfg)
                    res = fleet.run(reqs)
                    per = {f.index: (f.first_token - f.arrival, f.cached_tokens) for f in fleet.finished}
                    runs.setdefault((W, load, pol), []).append((res, per))
                    key = f"{W}/{load}/{pol}"
                    seconds[key] = round(seconds.get(key, 0.0) + time.perf_counter() - t0, 2)
    return cost, cfg, bases, runs, rates, seconds


def main(args) -> dict:
    if args.quick:
        args.requests, args.workers, args.loads, args.seeds, args.bootstrap = 40, "8", "0.8", 1, 200
    workers, loads = _ints(args.workers), _floats(args.loads)
    policies = [q for q in args.policies.split(",") if q] if args.policies else list(POLICIES)
    seeds = list(range(args.seed, args.seed + args.seeds))
    t_all = time.perf_counter()
    cost, cfg, bases, runs, rates, seconds = _simulate_all(args, workers, loads, policies, seeds)
    points = {k: _point(v) for k, v in runs.items()}
    per_req = {k: [d for _, d in v] for k, v in runs.items()}
    W0 = 8 if 8 in workers else max(workers)
    L0 = min(loads, key=lambda x: abs(x - 0.8))
    by_point = {f"{W}/{L}": _ratios(points, per_req, W, L, args.bootstrap) for W in workers for L in loads}
    ratios = {**by_point[f"{W0}/{L0}"], "by_point": by_point}
    out_dir = Path(args.out_dir)
    panels = {
        f"{W} workers": {
            pol: [(L, points[(W, L, pol)]["ttft_s"]["p90"]) for L in loads if (W, L, pol) in points] for pol in policies
        }
        for W in workers
    }
    png = ttft_vs_load(out_dir / "bench_routing.png", "Mooncake trace: TTFT P90 vs load per routing policy", panels)
    result = {
        "bench": "routing",
        "config": {
            "trace": args.trace,
            "requests_per_seed": [len(b) for b in bases],
            "sessions": args.sessions,
            "seeds": seeds,
            "offset": args.offset,
            "workers": workers,
            "loads": loads,
            "policies": policies,
            "bootstrap": {"replicates": args.bootstrap, "level": 0.95, "over": "requests, paired, stratified by seed"},
            **describe(cost, cfg),
            "policy_config": vars(from_args(PolicyConfig, args)),
            "load_definition": "arrival rate x mean uncached service time (cost model) / workers",
        },
        "ratios": ratios,
        "points": [
            {"workers": W, "load": L, "policy": pol, "rate_per_s_per_seed": rates[(W, L)], **v}
            for (W, L, pol), v in points.items()
        ],
        "plot": png,
        "seconds": {"total": round(time.perf_counter() - t_all, 1), **seconds},
    }
    (out_dir / "bench_routing.json").write_text(json.dumps(result, indent=1))
    return result


def add_arguments(q) -> None:
    add_trace_flags(q, 0.0125, ", about 150 requests over the whole hour")
    q.add_argument("--seed", type=int, default=0, help="the first conversation sample's seed (default: 0)")
    q.add_argument("--seeds", type=int, default=1, help="conversation samples per point (default: 1)")
    q.add_argument(
        "--bootstrap", type=int, default=1000, help="bootstrap replicates of each ratio's interval (default: 1000)"
    )
    q.add_argument("--workers", default="8,32", help="fleet sizes, comma-separated (default: 8,32)")
    q.add_argument(
        "--loads", default="0.6,0.7,0.8,0.9", help="nominal loads, comma-separated (default: 0.6,0.7,0.8,0.9)"
    )
    q.add_argument(
        "--policies", default="", help=f"routing policies, comma-separated (default: all: {', '.join(POLICIES)})"
    )
    q.add_argument("--out-dir", default=".", help="where bench_routing.json and bench_routing.png go (default: .)")
    q.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long version (CI): the first 40 sampled requests, 8 workers, 80%% load",
    )
    add_model_flags(q)
    add_flag_arguments(q, PolicyConfig, default_group="routing policies (as `serve` and `router`)")
