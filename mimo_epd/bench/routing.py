"""`mimo-epd bench routing`: the Mooncake conversation trace replayed through a simulated fleet of 2, 4 and 8
workers at 60-90% nominal load, under every routing policy (the real mimo_epd.router.policies classes over a
real page-hash index fed by each simulated worker's KV events; mimo_epd/sim).

Reports per (workers, load, policy) TTFT P50/P90/P99, end-to-end P90, hit tokens and throughput, and
ratios at the 8-worker, 80% point (or the largest fleet / nearest load run): affinity's hit tokens vs
round-robin's and vs the best other policy's, and affinity's TTFT P90 vs the best other policy's. A PNG of
TTFT P90 vs load per policy (one panel per fleet size) is written next to the JSON (--out-dir).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from llm_backend.sim.load import scale_to_load
from mimo_epd.router.policies import POLICIES
from mimo_epd.sim.fleet import run_fleet
from mimo_epd.sim.plot import ttft_vs_load
from mimo_epd.sim.setup import add_model_flags, add_trace_flags, build, describe
from mimo_epd.sim.traces import mooncake_requests


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _point(res: dict) -> dict:
    return {
        "ttft_s": {k: res["ttft_s"]["all"].get(k) for k in ("p50", "p90", "p99")},
        "e2e_p90_s": res["e2e_s"]["all"].get("p90"),
        "hit_tokens": res["hit_tokens"],
        "hit_token_rate": res["hit_token_rate"],
        "input_tokens_per_s": res["throughput"]["input_tokens_per_s"],
        "output_tokens_per_s": res["throughput"]["output_tokens_per_s"],
        "preemptions": res["preemptions"],
        "picks": res["picks"],
        "rejected": res["rejected"],
    }


def main(args) -> dict:
    if args.quick:
        args.requests, args.workers, args.loads = 40, "8", "0.8"
    workers, loads = _ints(args.workers), _floats(args.loads)
    policies = [p for p in args.policies.split(",") if p] if args.policies else list(POLICIES)
    cost, cfg = build(args)
    base = mooncake_requests(args.trace, args.requests, cfg.unit, args.offset, args.sessions)
    points, seconds = [], {}
    t_all = time.perf_counter()
    for W in workers:
        for load in loads:
            reqs = [replace(r) for r in base]
            scaled = scale_to_load(cost, reqs, load, W, cfg.chunk_size, cfg.max_running)
            for pol in policies:
                t0 = time.perf_counter()
                res = run_fleet(cost, cfg, W, pol, reqs)
                points.append(
                    {"workers": W, "load": load, "policy": pol, "rate_per_s": scaled["rate_per_s"], **_point(res)}
                )
                seconds[f"{W}/{load}/{pol}"] = round(time.perf_counter() - t0, 2)
    # The ratios' point: 8 workers, 80% load (or the largest fleet, the nearest load).
    W0 = 8 if 8 in workers else max(workers)
    L0 = min(loads, key=lambda x: abs(x - 0.8))
    at = {p["policy"]: p for p in points if p["workers"] == W0 and p["load"] == L0}
    ratios = {"workers": W0, "load": L0}
    if "affinity" in at:
        a = at["affinity"]
        peers = {k: v for k, v in at.items() if k != "affinity"}
        if "round_robin" in at:
            ratios["affinity_hit_vs_round_robin"] = round(a["hit_tokens"] / max(1, at["round_robin"]["hit_tokens"]), 3)
        if peers:
            best_hit = max(peers, key=lambda k: peers[k]["hit_tokens"])
            best_ttft = min(peers, key=lambda k: peers[k]["ttft_s"]["p90"])
            ratios["affinity_hit_vs_best_peer"] = round(a["hit_tokens"] / max(1, peers[best_hit]["hit_tokens"]), 3)
            ratios["best_hit_peer"] = best_hit
            ratios["affinity_ttft_p90_vs_best_peer"] = round(
                a["ttft_s"]["p90"] / max(1e-9, peers[best_ttft]["ttft_s"]["p90"]), 3
            )
            ratios["best_ttft_peer"] = best_ttft
    out_dir = Path(args.out_dir)
    panels = {
        f"{W} workers": {
            p: [(q["load"], q["ttft_s"]["p90"]) for q in points if q["workers"] == W and q["policy"] == p]
            for p in policies
        }
        for W in workers
    }
    png = ttft_vs_load(out_dir / "bench_routing.png", "Mooncake trace: TTFT P90 vs load per routing policy", panels)
    result = {
        "bench": "routing",
        "config": {
            "trace": args.trace,
            "requests": len(base),
            "sessions": args.sessions,
            "offset": args.offset,
            "workers": workers,
            "loads": loads,
            "policies": policies,
            **describe(cost, cfg),
            "load_definition": "arrival rate x mean uncached service time (cost model) / workers",
        },
        "ratios": ratios,
        "points": points,
        "plot": png,
        "seconds": {"total": round(time.perf_counter() - t_all, 1), **seconds},
    }
    (out_dir / "bench_routing.json").write_text(json.dumps(result, indent=1))
    return result


def add_arguments(p) -> None:
    add_trace_flags(p, 0.0125, ", about 150 requests over the whole hour")
    p.add_argument("--workers", default="2,4,8", help="fleet sizes, comma-separated (default: 2,4,8)")
    p.add_argument(
        "--loads", default="0.6,0.7,0.8,0.9", help="nominal loads, comma-separated (default: 0.6,0.7,0.8,0.9)"
    )
    p.add_argument(
        "--policies", default="", help=f"routing policies, comma-separated (default: all: {', '.join(POLICIES)})"
    )
    p.add_argument("--out-dir", default=".", help="where bench_routing.json and bench_routing.png go (default: .)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long version (CI): the first 40 sampled requests, 8 workers, 80%% load",
    )
    add_model_flags(p)
