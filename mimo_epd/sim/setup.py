"""Building simulations from command-line flags (shared by `mimo-epd sim run` and the simulator benchmarks)."""

from __future__ import annotations

from llm_backend.sim.cost import CostModel, load_profile
from llm_backend.sim.engine import WorkerConfig
from llm_backend.sim.shapes import get_shape

SCHEDULERS = {  # name -> (fcfs, length buckets): the wait-queue policies the engine's Scheduler has
    "fcfs": (True, ()),
    "uncached_first": (False, ()),
    "uncached_first_buckets": (False, (65536, 262144)),
}
DEFAULT_GPUS = {"tiny": 1, "flash": 8, "pro": 16}


def add_trace_flags(p, sessions: float, about: str = "") -> None:
    """--trace / --sessions / --requests / --offset of the benchmarks that replay the Mooncake trace."""
    p.add_argument(
        "--trace",
        default="mooncake",
        help="mooncake (the shipped Mooncake conversation trace) or a Mooncake-format JSONL path, plain, .xz or "
        ".gz (default: mooncake)",
    )
    p.add_argument(
        "--sessions",
        type=float,
        default=sessions,
        help=f"fraction of the trace's conversations replayed, every turn of each (default: {sessions}{about}); "
        "1 = every request",
    )
    p.add_argument("--requests", type=int, default=0, help="at most this many of them, 0 = all (default: 0)")
    p.add_argument("--offset", type=int, default=0, help="first trace line considered (default: 0)")


def add_model_flags(p, shape="flash", kv_gib=40.0, page=128, chunk=8192, max_running=32, unit=16) -> None:
    g = p.add_argument_group("simulated worker")
    g.add_argument(
        "--shape",
        default=shape,
        choices=("tiny", "flash", "pro"),
        help=f"model shape: tiny, flash (MiMo-V2-Flash), pro (MiMo-V2.5-Pro) (default: {shape})",
    )
    g.add_argument(
        "--profile",
        default="h200",
        help="device profile: h200 (roofline), cpu-measured (the committed fit) or a profile JSON (default: h200)",
    )
    g.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="GPUs per worker for the h200 profile, 0 = by shape "
        f"({', '.join(f'{k} {v}' for k, v in DEFAULT_GPUS.items())}) (default: 0)",
    )
    g.add_argument("--kv-gib", type=float, default=kv_gib, help=f"KV bytes per worker, GiB (default: {kv_gib})")
    g.add_argument("--swa-share", type=float, default=0.3, help="share of the KV bytes for the SWA pool (default: 0.3)")
    g.add_argument("--page-size", type=int, default=page, help=f"full-pool page, tokens (default: {page})")
    g.add_argument("--chunk-size", type=int, default=chunk, help=f"prefill chunk, tokens (default: {chunk})")
    g.add_argument(
        "--max-running", type=int, default=max_running, help=f"running requests per worker (default: {max_running})"
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=-1,
        help="prefill tokens per step, oldest prompt first (-1 = one chunk, 0 = no cap) (default: -1)",
    )
    g.add_argument(
        "--prefill-order",
        default="fewest_left",
        choices=("fewest_left", "oldest"),
        help="who takes the prefill budget first (the engine's flag; FCFS is always oldest) (default: fewest_left)",
    )
    g.add_argument(
        "--swa-checkpoint-interval",
        type=int,
        default=512,
        help="the engine's denser SWA checkpoints: trimming keeps the window before each cached span's last "
        "multiple of this many tokens, fitted to a page multiple above the window (0 = off; default: 512)",
    )
    g.add_argument(
        "--wait-penalty", type=float, default=2048.0, help="uncached tokens forgiven per second waited (default: 2048)"
    )
    g.add_argument(
        "--unit",
        type=int,
        default=unit,
        help=f"real tokens per simulated prompt token (1 = exact; default: {unit}); see docs/simulator.md",
    )


def build(args, scheduler: str = "uncached_first_buckets") -> tuple[CostModel, WorkerConfig]:
    shape = get_shape(args.shape)
    gpus = args.gpus or DEFAULT_GPUS[args.shape]
    cost = CostModel(shape, load_profile(args.profile, gpus))
    full, swa = shape.pool_tokens(int(args.kv_gib * (1 << 30)), args.swa_share)
    fcfs, buckets = SCHEDULERS[scheduler]
    if args.unit < 1 or args.page_size % args.unit and args.page_size > 1 or args.chunk_size % args.unit:
        raise SystemExit(
            f"--unit {args.unit} must divide --page-size ({args.page_size}) and --chunk-size ({args.chunk_size})"
        )
    window = -(-shape.window // args.unit)
    need = (window + args.chunk_size // args.unit + 17) * args.unit
    if swa < need:
        raise SystemExit(
            f"the SWA pool ({swa} tokens of --kv-gib {args.kv_gib} x --swa-share {args.swa_share}) "
            f"cannot hold one request's window + chunk ({need} tokens)"
        )
    cfg = WorkerConfig(
        full_tokens=full,
        swa_tokens=swa,
        page_size=args.page_size,
        chunk_size=args.chunk_size,
        max_running=args.max_running,
        fcfs=fcfs,
        wait_penalty=args.wait_penalty,
        length_buckets=buckets,
        unit=args.unit,
        max_prefill_tokens=args.chunk_size if args.max_prefill_tokens < 0 else args.max_prefill_tokens,
        prefill_order=getattr(args, "prefill_order", "fewest_left"),
        swa_checkpoint_interval=args.swa_checkpoint_interval,
    )
    if args.swa_checkpoint_interval < 0:
        raise SystemExit(f"--swa-checkpoint-interval must be >= 0, got {args.swa_checkpoint_interval}")
    return cost, cfg


def describe(cost: CostModel, cfg: WorkerConfig) -> dict:
    return {
        "shape": cost.shape.describe(),
        "profile": cost.profile.to_json(),
        "worker": {
            "full_pool_tokens": cfg.full_tokens,
            "swa_pool_tokens": cfg.swa_tokens,
            "page_size": cfg.page_size,
            "chunk_size": cfg.chunk_size,
            "max_running": cfg.max_running,
            "max_prefill_tokens": cfg.max_prefill_tokens,
            "prefill_order": cfg.prefill_order,
            "wait_penalty": cfg.wait_penalty,
            "swa_checkpoint_interval": cfg.swa_checkpoint_interval,
            "unit": cfg.unit,
        },
    }
