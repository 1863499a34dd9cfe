"""`mimo-epd llm`: one LLM worker (Generator/Generate, streaming)."""
from __future__ import annotations

import argparse
import logging

from .common import error, setup_logging


def add_llm_flags(llm: argparse.ArgumentParser) -> None:
    llm.add_argument("--model", default="tiny", help="'tiny' or a mimo_v2_flash checkpoint directory (default: tiny)")
    llm.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    llm.add_argument("--port", type=int, default=50061, help="gRPC port, 0 = any (default: 50061)")
    llm.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    llm.add_argument("--dtype", default="auto",
                     help="weights, activations and KV: float32, bfloat16, float16 or auto (bfloat16 on CUDA, else "
                          "float32) (default: auto)")
    llm.add_argument("--encoder", default="", help="encoder (or router) address for media items (default: none)")
    llm.add_argument("--kv-cache-tokens", type=int, default=16384, help="full-attention KV pool, tokens (default: 16384)")
    llm.add_argument("--swa-cache-tokens", type=int, default=4096, help="sliding-window KV pool, tokens (default: 4096)")
    llm.add_argument("--page-size", type=int, default=1, help="prefix-cache match granularity (default: 1)")
    llm.add_argument("--chunk-size", type=int, default=512, help="prefill chunk, tokens (default: 512)")
    llm.add_argument("--release-interval", type=int, default=16, help="decode steps between SWA releases (default: 16)")
    llm.add_argument("--max-running", type=int, default=16, help="requests running at once (default: 16)")
    llm.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                     help="SWA-aware radix prefix cache (default: on)")
    llm.add_argument("--fcfs", action="store_true", help="first come first served instead of fewest uncached tokens first")
    llm.add_argument("--wait-penalty", type=float, default=2048.0,
                     help="uncached tokens forgiven per second of waiting, so nothing starves (default: 2048)")
    llm.add_argument("--length-buckets", default="65536,262144",
                     help="prompt-length bucket bounds; buckets take turns at admission (default: 65536,262144)")
    llm.add_argument("--log-level", default="info", help="debug, info, warning or error (default: info)")
    from llm_backend.server.config import ServerConfig  # the HTTP API's flags (--http-port, ...)

    ServerConfig.add_arguments(llm)


def run_llm(args) -> int:
    import torch
    import uvloop

    from llm_backend import LLM
    from llm_backend.service import serve_llm

    setup_logging(args.log_level)
    try:
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.startswith("cuda") else "float32")
        if dtype not in ("float32", "bfloat16", "float16"):
            return error(f"--dtype must be auto, float32, bfloat16 or float16, got {args.dtype!r}")
        engine = LLM(args.model, device=args.device, dtype=getattr(torch, dtype), kv_cache_tokens=args.kv_cache_tokens,
                     swa_cache_tokens=args.swa_cache_tokens, page_size=args.page_size, chunk_size=args.chunk_size,
                     enable_prefix_cache=args.prefix_cache, release_interval=args.release_interval,
                     max_running=args.max_running, fcfs=args.fcfs, wait_penalty_tokens_per_s=args.wait_penalty,
                     length_buckets=tuple(int(x) for x in args.length_buckets.split(",") if x.strip()))
        from llm_backend.server.config import ServerConfig

        return uvloop.run(serve_llm(engine, args.host, args.port, args.encoder or None,
                                    config=ServerConfig.from_args(args), model=args.model))
    except (OSError, ValueError, RuntimeError) as e:
        logging.getLogger("mimo_epd").error("cannot start the LLM worker: %s", e)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130


def register(commands) -> None:
    commands.command("llm", usage="%(prog)s [FLAGS]", help="run one LLM worker (Generator/Generate, streaming)", setup=add_llm_flags, run=run_llm,
                     epilog="Prints `ready HOST:PORT` on stdout once serving; logs go to stderr.")
