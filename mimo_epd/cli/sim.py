"""`mimo-epd sim run|calibrate|validate`: the fleet simulator (docs/simulator.md)."""

from __future__ import annotations

import argparse
import json


def _run_flags(p) -> None:
    from mimo_epd.router.policies import POLICIES
    from mimo_epd.sim.setup import SCHEDULERS, add_model_flags

    p.add_argument(
        "--trace",
        default="mooncake",
        help="mooncake (the shipped Mooncake conversation trace), long-mix (the generated long-context mix) or a Mooncake-format "
        "JSONL path (default: mooncake)",
    )
    p.add_argument("--requests", type=int, default=400, help="requests to replay / generate (default: 400)")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default: 4)")
    p.add_argument(
        "--policies", default="", help=f"routing policies, comma-separated (default: all: {', '.join(POLICIES)})"
    )
    p.add_argument(
        "--scheduler",
        default="uncached_first_buckets",
        choices=tuple(SCHEDULERS),
        help="wait-queue policy of every worker (default: uncached_first_buckets)",
    )
    p.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="nominal load to time-scale the trace to, 0 = the trace's own timestamps (default: 0.8)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the long-context mix (default: 0)")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run: 30 requests, 2 workers, 2 policies")
    add_model_flags(p)


def _run(args) -> int:
    from dataclasses import replace

    from llm_backend.sim.load import scale_to_load
    from llm_backend.sim.trace import long_context_mix
    from mimo_epd.router.policies import POLICIES
    from mimo_epd.sim.fleet import run_fleet
    from mimo_epd.sim.setup import build, describe
    from mimo_epd.sim.traces import mooncake_requests

    policies = [p for p in args.policies.split(",") if p] or list(POLICIES)
    if args.quick:
        args.requests, args.workers = min(args.requests, 30), min(args.workers, 2)
        policies = policies[:2]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown routing policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
    cost, cfg = build(args, args.scheduler)
    if args.trace == "long-mix":
        reqs = long_context_mix(args.requests, 1.0, seed=args.seed, unit=cfg.unit)
    else:
        reqs = mooncake_requests(args.trace, args.requests, cfg.unit)
    scaled = (
        scale_to_load(cost, reqs, args.load, args.workers, cfg.chunk_size, cfg.max_running) if args.load > 0 else {}
    )
    results = {p: run_fleet(cost, cfg, args.workers, p, [replace(r) for r in reqs]) for p in policies}
    print(
        json.dumps(
            {
                "command": "sim run",
                "config": {
                    "trace": args.trace,
                    "requests": len(reqs),
                    "workers": args.workers,
                    "scheduler": args.scheduler,
                    "load": scaled or "trace timestamps",
                    **describe(cost, cfg),
                },
                "policies": results,
            }
        )
    )
    return 0


def _calibrate_flags(p) -> None:
    p.add_argument(
        "--out",
        default="",
        help="where the fitted profile is written (empty = the package's cpu-measured.json, which the "
        "simulator uses by default) (default: '')",
    )
    p.add_argument("--waves", type=int, default=5, help="waves of 8 requests per workload (default: 5)")
    p.add_argument(
        "--seed", type=int, default=1, help="training workload seed; the held-out one is seed+1 (default: 1)"
    )


def _calibrate(args) -> int:
    from pathlib import Path

    from llm_backend.sim.calibrate import calibrate
    from llm_backend.sim.cost import PROFILE_DIR

    prof, report = calibrate(seed=args.seed, holdout_seed=args.seed + 1, waves=args.waves)
    out = args.out or str(PROFILE_DIR / "cpu-measured.json")
    Path(out).write_text(json.dumps(prof.to_json(), indent=1) + "\n")
    print(json.dumps({"command": "sim calibrate", "profile": prof.to_json(), "fit": report, "written": out}))
    return 0


def _validate_flags(p) -> None:
    p.add_argument("--profile", default="cpu-measured", help="device profile to check (default: cpu-measured)")
    p.add_argument("--waves", type=int, default=5, help="waves of 8 requests (default: 5)")
    p.add_argument("--seed", type=int, default=3, help="workload seed, not one calibrate trains on (default: 3)")
    p.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also fit a profile on this machine (training workload seed 1) and report the step-time error of "
        "both, the committed profile's and this machine's, on the validation run (default: True)",
    )


def _validate(args) -> int:
    from llm_backend.sim.calibrate import validate
    from llm_backend.sim.cost import load_profile

    res = validate(load_profile(args.profile), seed=args.seed, waves=args.waves, calibrate_here=args.calibrate)
    print(json.dumps(res))
    return 0


def _encoders_flags(p) -> None:
    p.add_argument("--nodes", default="8,32", help="fleet sizes, comma-separated (default: 8,32)")
    p.add_argument("--sessions", type=int, default=32, help="sessions per node (default: 32)")
    p.add_argument("--turns", type=int, default=8, help="requests per session (default: 8)")
    p.add_argument("--catalog", type=int, default=2000, help="distinct media items in the fleet (default: 2000)")
    p.add_argument("--zipf", type=float, default=0.9, help="Zipf exponent of item popularity (default: 0.9)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second per node (default: 4.0)")
    p.add_argument(
        "--encode-ms-per-1k-tokens",
        type=float,
        default=40.0,
        help="an encode's cost per 1000 merged tokens (an assumption: MiMo's 729M ViT on one GPU) (default: 40.0)",
    )
    p.add_argument("--hidden", type=int, default=4096, help="embedding width, bf16 rows (default: 4096)")
    p.add_argument("--node-cache-mib", type=int, default=512, help="each node's cache (default: 512)")
    p.add_argument("--segment-mib", type=int, default=1024, help="each node's share of the fleet cache (default: 1024)")
    p.add_argument("--store-ms", type=float, default=2.0, help="a fleet-cache read (default: 2.0)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default: 0)")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run: 2 and 4 nodes, 4 sessions each")


def _encoders(args) -> int:
    from mimo_epd.sim.encoder_fleet import run

    args.nodes = [int(n) for n in str(args.nodes).split(",") if n]
    if args.quick:
        args.nodes, args.sessions = [2, 4], min(args.sessions, 4)
    if not args.nodes or min(args.nodes) < 1:
        raise SystemExit("--nodes needs fleet sizes >= 1")
    config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list)) and k != "quick"}
    print(json.dumps({"command": "sim encoders", "config": config, "nodes": run(args)}))
    return 0


def register(commands) -> None:
    sim = commands.group(
        "sim",
        "the fleet simulator: the real scheduler, caches and routing policies on a virtual "
        "clock; each prints one JSON object",
        dest="sim",
    )
    sim.command("run", "simulate a trace through N workers under each routing policy", setup=_run_flags, run=_run)
    sim.command(
        "encoders",
        "the encoder half at N nodes: node-local caches vs the fleet's cache with the encode-once lease",
        setup=_encoders_flags,
        run=_encoders,
    )
    sim.command(
        "calibrate",
        "fit the cpu-measured step-time profile on timed steps of the real tiny model",
        setup=_calibrate_flags,
        run=_calibrate,
    )
    sim.command(
        "validate",
        "live tiny engine vs simulated worker: cached tokens per request and step times",
        setup=_validate_flags,
        run=_validate,
    )
