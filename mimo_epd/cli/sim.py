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


def register(commands) -> None:
    sim = commands.group(
        "sim",
        "the fleet simulator: the real scheduler, caches and routing policies on a virtual "
        "clock; each prints one JSON object",
        dest="sim",
    )
    sim.command("run", "simulate a trace through N workers under each routing policy", setup=_run_flags, run=_run)
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
