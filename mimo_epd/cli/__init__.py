"""The `mimo-epd` command line: one module per command group, assembled here.

To add a command: write `mimo_epd/cli/<name>.py` with `register(commands)` (see registry.py) and list it in
COMMAND_MODULES. Keep a command module's top level light (argparse, the standard library): import what a
command needs inside its setup and run functions, so that `mimo-epd --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

from .registry import Commands, HelpFormatter, complete, walk

__all__ = ["build_parser", "main", "complete", "walk", "COMMAND_MODULES"]

# In --help order.
COMMAND_MODULES = (
    "serve",
    "clients",
    "llm",
    "router",
    "video",
    "audio",
    "loadtest",
    "bench",
    "sim",
    "train",
    "checkpoint",
    "version",
)

DESCRIPTION = """\
mimo-epd serves MiMo-V2.5-family multimodal models with the Encoder / Prefill / Decode split:
vision-tower embeddings (Encode API), a node-wide shared-memory embedding cache, and an LLM worker
(Generate API), all behind one router.

quick start:
  mimo-epd serve                                   # prints: ready 127.0.0.1:50051
  mimo-epd health --server 127.0.0.1:50051
  mimo-epd encode --server 127.0.0.1:50051 photo.jpg --out emb.safetensors
  mimo-epd generate --server 127.0.0.1:50051 --prompt "What is in the picture?" --image photo.jpg"""

EPILOG = "`mimo-epd COMMAND --help` shows a command's flags; docs/cli.md lists every flag of every command."


def build_parser() -> argparse.ArgumentParser:
    """The whole CLI. Subcommands add their flags when selected (`complete(parser)` adds them all)."""
    p = argparse.ArgumentParser(prog="mimo-epd", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    commands = Commands(p, dest="command")
    for name in COMMAND_MODULES:
        import_module(f"{__name__}.{name}").register(commands)
    return p


def _quiet_grpc_env() -> None:
    """gRPC settings for this process and every server process it starts (they inherit the environment).

    The launcher starts its child processes (fork + exec) while its own gRPC server and channels run; gRPC's
    fork handlers then log `Other threads are currently calling into gRPC, skipping fork() handlers` at
    every start. The children exec a fresh interpreter at once, so nothing needs gRPC's fork support."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def main(argv: list[str] | None = None) -> int:
    _quiet_grpc_env()
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C in a client command: no traceback
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `mimo-epd encode ... | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
