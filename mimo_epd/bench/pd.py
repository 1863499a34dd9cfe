"""`mimo-epd bench pd`: prefill/decode disaggregation in the fleet simulator (mimo_epd/sim/pd.py), colocated N
workers vs every P:D split of the same N, on the same arrivals.

Per model shape (MiMo-V2-Flash and Pro on the h200 cost model) and trace (the Mooncake conversation trace, the
long-context mix), arrivals are replayed at several rates (the trace's own times compressed by a factor; the mix
drawn at a Poisson rate). Reported: goodput = the highest rate at which at least `--slo-share` of the requests meet
both the TTFT and the TPOT SLO (stated in the JSON), searched: the grid's last passing rate, then `--search-steps`
geometric bisections towards its first failing one (ties on a coarse grid no longer hide a difference), TTFT and TPOT P50/P90 at the middle rate, and the
transfer bytes per request against a full-KV transfer. The best split is the one with the highest goodput (ties:
the lower TTFT P90 at the middle rate). Ratios compare it with colocated. Prefill placement: the best split again at
the middle rate with the prefill worker chosen by `affinity` and by `round_robin` (`--prefill-policies`), the
prefill side's cached fraction and TTFT for each (`prefill_affinity_cached_vs_round_robin`,
`prefill_affinity_ttft_p90_vs_round_robin`). It reports; it does not grade.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from functools import partial

from mimo_epd.common.stats import percentile


def add_arguments(p) -> None:
    p.add_argument("--shapes", default="flash,pro", help="model shapes (default: flash,pro)")
    p.add_argument("--traces", default="mooncake,long-context", help="traces (default: mooncake,long-context)")
    p.add_argument("--workers", type=int, default=4, help="workers per fleet, colocated and split (default: 4)")
    p.add_argument("--requests", type=int, default=200, help="requests per run (default: 200)")
    p.add_argument("--rates", default="2,8,32", help="arrival-rate factors over the trace's own rate (default: 2,8,32)")
    p.add_argument("--long-rate", type=float, default=0.5, help="long-context mix: requests/s at factor 1")
    p.add_argument(
        "--search-steps",
        type=int,
        default=4,
        help="goodput: bisections of the rate between the last grid rate that meets the SLOs and the first that "
        "does not (geometric; 0 = the grid's rate only) (default: 4)",
    )
    p.add_argument("--ttft-slo-s", type=float, default=2.0, help="TTFT SLO, seconds (default: 2)")
    p.add_argument("--tpot-slo-s", type=float, default=0.05, help="TPOT SLO, seconds per output token (default: 0.05)")
    p.add_argument("--slo-share", type=float, default=0.9, help="share of requests meeting both SLOs (default: 0.9)")
    p.add_argument("--bandwidth-gbit-s", type=float, default=400.0, help="transfer bandwidth per worker, Gbit/s")
    p.add_argument("--latency-s", type=float, default=0.0005, help="per-transfer latency, seconds")
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=2048,
        help="conditional disaggregation: uncached prompts up to this many tokens prefill on the decode worker "
        "(default: 2048, the worker's default)",
    )
    p.add_argument("--unit", type=int, default=16, help="real tokens per simulated token (default: 16)")
    p.add_argument(
        "--prefill-policies",
        default="affinity,round_robin",
        help="at the best split and the middle rate, place the prefill worker by each of these routing policies "
        "(the decode worker by affinity): the prefill side's cache hit rate and TTFT (default: affinity,round_robin)",
    )

    from .pd_roles import add_arguments as add_role_arguments

    add_role_arguments(p)


def log(msg: str) -> None:
    print(f"[bench pd] {msg}", file=sys.stderr, flush=True)


def _latencies(finished) -> tuple[list[float], list[float]]:
    ttft = [f.first_token - f.arrival for f in finished]
    tpot = [(f.finish - f.first_token) / (f.output_len - 1) for f in finished if f.output_len > 1]
    return ttft, tpot


def _attained(finished, ttft_slo, tpot_slo) -> float:
    ok = 0
    for f in finished:
        tpot = (f.finish - f.first_token) / (f.output_len - 1) if f.output_len > 1 else 0.0
        ok += f.first_token - f.arrival <= ttft_slo and tpot <= tpot_slo
    return ok / max(1, len(finished))


def _trace(name: str, args, factor: float):
    from llm_backend.sim.trace import long_context_mix
    from mimo_epd.sim.traces import mooncake_requests

    if name == "mooncake":
        reqs = mooncake_requests(limit=args.requests, unit=args.unit, sessions=0.3)
        t0 = reqs[0].arrival if reqs else 0.0
        return [replace(r, arrival=(r.arrival - t0) / factor) for r in reqs]
    return long_context_mix(args.requests, args.long_rate * factor, seed=1, unit=args.unit, shares=(0.9, 0.1, 0.0))


def _run(cost, cfg, split, reqs, args, prefill_policy: str = "affinity") -> tuple[list, dict]:
    """`reqs` through colocated workers (`split` None) or `split` = (prefill, decode) workers."""
    from mimo_epd.sim.fleet import Fleet
    from mimo_epd.sim.pd import Network, PDFleet

    if split is None:
        fleet = Fleet(cost, cfg, args.workers, "affinity")
        fleet.run(reqs)
        return [f for w in fleet.workers for f in w.finished], {}
    p, d = split
    pd = PDFleet(
        cost,
        cfg,
        p,
        d,
        network=Network(args.bandwidth_gbit_s, args.latency_s),
        local_prefill_tokens=args.local_prefill_tokens,
        prefill_policy=prefill_policy,
    )
    res = pd.run(reqs)
    keys = ("transfer_bytes_per_request", "full_kv_bytes_per_request", "local_prefills", "prefill_cached_fraction")
    extra = {k: res[k] for k in keys}
    return [f for w in pd.decode for f in w.finished], extra


def _config(shape_name: str, args):
    from llm_backend.sim.cost import CostModel, load_profile
    from llm_backend.sim.engine import WorkerConfig
    from llm_backend.sim.shapes import get_shape

    shape = get_shape(shape_name)
    cost = CostModel(shape, load_profile("h200", None))
    full, swa = shape.pool_tokens(40 << 30, 0.2)
    cfg = WorkerConfig(
        full_tokens=full,
        swa_tokens=swa,
        page_size=128,
        chunk_size=8192,
        max_running=32,
        unit=args.unit,
        max_prefill_tokens=8192,
    )
    return cost, cfg


def _one(shape_name: str, trace: str, args, rates: list[float]) -> dict:
    cost, cfg = _config(shape_name, args)
    n = args.workers
    modes = {"colocated": None, **{f"{p}P:{n - p}D": (p, n - p) for p in range(1, n)}}
    out = {}
    for mode, split in modes.items():
        run = partial(_run, cost, cfg, split, args=args)
        row = grid(run, trace, args, rates)
        search(row, run, trace, args, rates)
        log(f"{shape_name} {trace} {mode}: goodput factor {row['goodput_rate_factor']}, {row['attainment']}")
        out[mode] = row
    return out


def grid(run, trace: str, args, rates: list[float]) -> dict:
    """One mode at the grid's rates: `run(requests) -> (finished, extra)`. Goodput is the highest rate whose share
    of requests meeting both SLOs reaches `--slo-share`; latencies (and `extra`) at the middle rate."""
    row: dict = {"goodput_rate_factor": 0.0, "attainment": {}}
    mid = rates[len(rates) // 2]
    for factor in rates:
        finished, extra = run(_trace(trace, args, factor))
        share = _attained(finished, args.ttft_slo_s, args.tpot_slo_s)
        row["attainment"][str(factor)] = round(share, 3)
        if share >= args.slo_share:
            row["goodput_rate_factor"] = max(row["goodput_rate_factor"], factor)
        if factor == mid:
            ttft, tpot = _latencies(finished)
            row["at_middle_rate"] = {
                "rate_factor": factor,
                "ttft_p50_s": percentile(ttft, 50, 4),
                "ttft_p90_s": percentile(ttft, 90, 4),
                "tpot_p50_s": percentile(tpot, 50, 4),
                "tpot_p90_s": percentile(tpot, 90, 4),
                **extra,
            }
    return row


def search(row: dict, run, trace: str, args, rates: list[float]) -> None:
    """Refines `row["goodput_rate_factor"]` by geometric bisection between the highest grid rate that met the SLOs
    and the next grid rate (which did not): `--search-steps` more runs, each kept in `row["attainment"]`. Nothing
    to refine when every grid rate passed or none did (the goodput is then at the grid's edge: said as is)."""
    lo = row["goodput_rate_factor"]
    above = [f for f in sorted(rates) if f > lo]
    if lo == 0.0 or not above:
        return
    hi = above[0]
    for _ in range(args.search_steps):
        mid = round((lo * hi) ** 0.5, 4)
        finished, _ = run(_trace(trace, args, mid))
        share = _attained(finished, args.ttft_slo_s, args.tpot_slo_s)
        row["attainment"][str(mid)] = round(share, 3)
        lo, hi = (mid, hi) if share >= args.slo_share else (lo, mid)
    row["goodput_rate_factor"] = lo
    row["goodput_bracket"] = [lo, hi]


def _prefill_placement(shape_name: str, trace: str, args, split, factor: float) -> dict:
    """The best split at the middle rate with the prefill worker placed by each of `--prefill-policies` (the
    decode worker by affinity throughout): the prefill side's cache hit rate and the TTFT it buys."""
    cost, cfg = _config(shape_name, args)
    reqs = _trace(trace, args, factor)
    out = {}
    for name in [x.strip() for x in args.prefill_policies.split(",") if x.strip()]:
        finished, extra = _run(cost, cfg, split, reqs, args, prefill_policy=name)
        ttft, _ = _latencies(finished)
        out[name] = {
            "prefill_cached_fraction": round(extra["prefill_cached_fraction"], 4),
            "local_prefills": extra["local_prefills"],
            "ttft_p50_s": percentile(ttft, 50, 4),
            "ttft_p90_s": percentile(ttft, 90, 4),
        }
        log(f"{shape_name} {trace} prefill placed by {name}: {out[name]}")
    return out


def _placement_ratios(rows: dict) -> dict:
    a, rr = rows.get("affinity"), rows.get("round_robin")
    if not a or not rr:
        return {}
    return {
        "prefill_affinity_cached_vs_round_robin": round(a["prefill_cached_fraction"] / rr["prefill_cached_fraction"], 3)
        if rr["prefill_cached_fraction"]
        else None,
        "prefill_affinity_ttft_p90_vs_round_robin": round(a["ttft_p90_s"] / max(rr["ttft_p90_s"], 1e-9), 3),
    }


def _best(rows: dict) -> str:
    splits = [m for m in rows if m != "colocated"]
    return max(splits, key=lambda m: (rows[m]["goodput_rate_factor"], -rows[m]["at_middle_rate"]["ttft_p90_s"]))


def main(args) -> dict:
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    results, ratios = {}, {}
    for shape_name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        for trace in [t.strip() for t in args.traces.split(",") if t.strip()]:
            rows = _one(shape_name, trace, args, rates)
            best = _best(rows)
            col, b = rows["colocated"], rows[best]
            cm, bm = col["at_middle_rate"], b["at_middle_rate"]
            key = f"{shape_name}/{trace}"
            p = int(best.split("P:")[0])
            placement = _prefill_placement(shape_name, trace, args, (p, args.workers - p), rates[len(rates) // 2])
            results[key] = {"best_split": best, "modes": rows, "prefill_placement": placement}
            ratios[key] = {
                "goodput_disagg_vs_colocated": round(b["goodput_rate_factor"] / col["goodput_rate_factor"], 3)
                if col["goodput_rate_factor"]
                else None,
                "ttft_p90_disagg_vs_colocated": round(bm["ttft_p90_s"] / max(cm["ttft_p90_s"], 1e-9), 3),
                "tpot_p90_disagg_vs_colocated": round(bm["tpot_p90_s"] / max(cm["tpot_p90_s"], 1e-9), 3),
                "transfer_bytes_vs_full_kv": round(
                    bm["transfer_bytes_per_request"] / max(bm["full_kv_bytes_per_request"], 1), 4
                ),
                **_placement_ratios(placement),
            }
            if args.role_parallelism:
                from .pd_roles import compare

                roles = compare(shape_name, trace, args, rates)
                results[key]["role_parallelism"] = roles
                if "goodput_best_role_split_vs_colocated" in roles:
                    ratios[key]["goodput_role_split_vs_colocated"] = roles["goodput_best_role_split_vs_colocated"]
                log(f"{key} per-role parallelism: best {roles.get('best')}, {roles.get('skipped')}")
    return {
        "benchmark": "pd",
        "simulated": True,
        "cost_model": "h200 roofline",
        "workers": args.workers,
        "requests_per_run": args.requests,
        "rate_factors": rates,
        "slo": {"ttft_s": args.ttft_slo_s, "tpot_s": args.tpot_slo_s, "share": args.slo_share},
        "goodput": "the highest rate factor at which the share of requests meeting both SLOs reaches slo.share: the "
        "grid's last passing factor refined by search_steps geometric bisections towards the next",
        "search_steps": args.search_steps,
        "network": {"bandwidth_gbit_s": args.bandwidth_gbit_s, "latency_s": args.latency_s},
        "results": results,
        "ratios": ratios,
    }
