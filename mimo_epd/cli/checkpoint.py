"""`mimo-epd make-checkpoint`: a random MiMo checkpoint in a released layout (llm_backend/models/make_checkpoint.py)."""

from __future__ import annotations

import json

from .common import error

LIKES = ("v2-flash", "v2.5", "v2.5-pro", "v2.6")


def add_flags(p) -> None:
    p.add_argument("out", help="directory to write (created; must be empty or absent)")
    p.add_argument("--like", choices=LIKES, default="v2-flash", help="which release's layout (default: v2-flash)")
    p.add_argument(
        "--weights",
        choices=("fp8", "bf16", "mxfp4"),
        default="fp8",
        help="FP8 128x128 block weights, bf16, or mxfp4 (V2.6: FP8 with MXFP4 experts) (default: fp8)",
    )
    p.add_argument(
        "--scale",
        choices=("tiny", "small"),
        default="tiny",
        help="tiny (~15 MB: hidden 256, 8 layers, 8 experts) or small (~0.6 GB FP8: hidden 1024, 12 layers, 32 "
        "experts); the real models' shapes are in docs/model.md (default: tiny)",
    )
    p.add_argument("--shards", type=int, default=4, help="weight files besides model_mtp.safetensors (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def run(args) -> int:
    from llm_backend.models.make_checkpoint import write_checkpoint

    try:
        summary = write_checkpoint(args.out, args.like, args.weights, args.scale, args.seed, args.shards)
    except (ValueError, OSError) as e:
        return error(str(e))
    print(json.dumps(summary))
    return 0


def register(commands) -> None:
    commands.command(
        "make-checkpoint",
        "write a random MiMo checkpoint in a released layout (config keys, tensor names, dtypes, shards, index)",
        setup=add_flags,
        run=run,
        epilog="example:\n  mimo-epd make-checkpoint /tmp/v25 --like v2.5 && mimo-epd serve /tmp/v25",
    )
