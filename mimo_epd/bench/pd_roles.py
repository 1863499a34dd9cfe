"""`bench pd --role-parallelism`: disaggregation with each role at its own tensor-parallel size (DistServe's lever),
against colocated workers, on the same GPUs and arrivals.

The fleet has `--workers` x `--gpus-per-worker` GPUs (G). Colocated: `--workers` workers at TP `--gpus-per-worker`.
Disaggregated: every (prefill TP, decode TP) pair from `--role-tp` (default: half, once and twice the colocated
worker's) with every count of prefill workers p >= 1 that leaves a whole number d >= 1 of decode workers on the rest
(`p x tp_p + d x tp_d = G`), named `pPxTP:dDxTP`. Each worker's step time is the cost model's for its deployment
(llm_backend/sim/parallel.py `ParallelCost`: attention over tp GPUs, the experts over tp GPUs, the all-reduces on
the node's links, H200 figures, FP8 weights as released) and its KV pool what its GPUs' memory holds after the
weights (window reservation for the sliding layers); a deployment whose pool cannot hold two of the trace's longest
prompts is left out, named. A P/D transfer has one 400 Gb/s NIC per GPU of the smaller side (each rank sends its
own heads, as the engine does at TP > 1).

Goodput as in `bench pd` (its `grid` and `search`): every mode at the grid's rates, then the four best splits and
colocated refined by `--search-steps` geometric bisections. Reported per mode: goodput, attainment per rate, TTFT and
TPOT at the middle rate; `best` is the split with the highest goodput (ties: the lower TTFT P90 at the middle rate).
It reports; it does not grade.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial


def add_arguments(p) -> None:
    p.add_argument(
        "--role-parallelism",
        action="store_true",
        help="also each role at its own tensor-parallel size over the same GPUs (module doc; slower)",
    )
    p.add_argument(
        "--gpus-per-worker", type=int, default=8, help="--role-parallelism: GPUs of a colocated worker (default: 8)"
    )
    p.add_argument(
        "--role-tp",
        default="",
        help="--role-parallelism: the TP sizes a role may take, comma-separated (default: half, once and twice "
        "--gpus-per-worker)",
    )


def role_modes(workers: int, g: int, choices: list[int]) -> dict[str, tuple[int, int, int, int]]:
    """name -> (prefill workers, their TP, decode workers, their TP): every split of the fleet's GPUs."""
    total, out = workers * g, {}
    for tp_p in choices:
        for tp_d in choices:
            for p in range(1, total // tp_p + 1):
                rest = total - p * tp_p
                if rest >= tp_d and rest % tp_d == 0:
                    out[f"{p}Px{tp_p}:{rest // tp_d}Dx{tp_d}"] = (p, tp_p, rest // tp_d, tp_d)
    return out


def _worker(shape_name: str, tp: int, args, longest: int):
    """(cost, config) of one worker at TP `tp`, or a reason it cannot run."""
    from llm_backend.sim.cost import RooflineProfile
    from llm_backend.sim.engine import WorkerConfig
    from llm_backend.sim.parallel import LINKS, Deployment, ParallelCost, kv_capacity_tokens
    from llm_backend.sim.shapes import get_shape

    shape = replace(get_shape(shape_name), weight_bytes=1)  # FP8, as released
    deploy, links = Deployment(tp), LINKS["h200"]
    full = kv_capacity_tokens(shape, deploy, links, "window")
    if full < 2 * longest:
        return f"TP {tp}: {full} KV tokens after the weights, under two of the longest prompt ({longest})"
    chunk, running = 8192, 32
    cfg = WorkerConfig(
        full_tokens=full - full % 128,
        swa_tokens=running * (shape.window + 2 * chunk),
        page_size=128,
        chunk_size=chunk,
        max_running=running,
        unit=args.unit,
        max_prefill_tokens=chunk,
    )
    return ParallelCost(shape, RooflineProfile(name="h200", gpus=1), deploy, links), cfg


def _run(workers, split, reqs, args) -> tuple[list, dict]:
    """`reqs` through the colocated fleet (`split` None) or a per-role split (`workers` = prefill's, decode's)."""
    from mimo_epd.sim.fleet import Fleet
    from mimo_epd.sim.pd import Network, PDFleet

    if split is None:
        cost, cfg = workers
        fleet = Fleet(cost, cfg, args.workers, "affinity")
        fleet.run(reqs)
        return [f for w in fleet.workers for f in w.finished], {}
    (pcost, pcfg), (dcost, dcfg), (p, tp_p, d, tp_d) = workers[0], workers[1], split
    pd = PDFleet(
        dcost,
        dcfg,
        p,
        d,
        network=Network(args.bandwidth_gbit_s * min(tp_p, tp_d), args.latency_s),
        local_prefill_tokens=args.local_prefill_tokens,
        prefill_cost=pcost,
        prefill_config=pcfg,
    )
    pd.run(reqs)
    return [f for w in pd.decode for f in w.finished], {}


def compare(shape_name: str, trace: str, args, rates: list[float]) -> dict:
    """The colocated fleet and every per-role split on `trace` (module doc)."""
    from . import pd as bench_pd

    g = args.gpus_per_worker
    choices = sorted({int(x) for x in args.role_tp.split(",") if x.strip()} or {max(1, g // 2), g, 2 * g})
    longest = max(r.prompt_len for r in bench_pd._trace(trace, args, rates[0]))
    built, skipped = {}, {}
    for tp in sorted({*choices, g}):
        w = _worker(shape_name, tp, args, longest)
        if isinstance(w, str):
            skipped[str(tp)] = w
        else:
            built[tp] = w
    if g not in built:
        return {"skipped": skipped, "note": f"the colocated worker (TP {g}) cannot run: {skipped[str(g)]}"}
    col = f"colocated_{args.workers}x{g}"
    modes: dict = {col: partial(_run, built[g], None, args=args)}
    for name, split in role_modes(args.workers, g, choices).items():
        if split[1] in built and split[3] in built:
            modes[name] = partial(_run, (built[split[1]], built[split[3]]), split, args=args)
    rows = {name: bench_pd.grid(run, trace, args, rates) for name, run in modes.items()}
    top = sorted((m for m in rows if m != col), key=lambda m: -rows[m]["goodput_rate_factor"])[:4]
    for name in [col, *top]:
        bench_pd.search(rows[name], modes[name], trace, args, rates)
    best = max(
        (m for m in rows if m != col),
        key=lambda m: (rows[m]["goodput_rate_factor"], -rows[m].get("at_middle_rate", {}).get("ttft_p90_s", 1e9)),
        default=None,
    )
    out = {"gpus": args.workers * g, "role_tp": choices, "skipped": skipped, "modes": rows, "best": best}
    if best is not None and rows[col]["goodput_rate_factor"]:
        out["goodput_best_role_split_vs_colocated"] = round(
            rows[best]["goodput_rate_factor"] / rows[col]["goodput_rate_factor"], 3
        )
    return out
