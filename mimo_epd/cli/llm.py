"""`mimo-epd llm`: one LLM worker (Generator/Generate, streaming)."""

from __future__ import annotations

import argparse
import logging

from .common import error, one_line, setup_logging


def add_llm_flags(llm: argparse.ArgumentParser) -> None:
    from llm_backend.config import LLMConfig  # one flag source: the dataclass (no torch import)
    from mimo_epd.common.flags import add_arguments

    add_arguments(llm, LLMConfig)


def run_llm(args) -> int:
    import uvloop

    from llm_backend import LLM
    from llm_backend.config import LLMConfig
    from llm_backend.server.config import ServerConfig
    from llm_backend.server.worker import build_role, serve_llm
    from mimo_epd.common.flags import from_args

    try:
        cfg = from_args(LLMConfig, args)
        cfg.validate()
        server_cfg = ServerConfig.from_args(args)
    except ValueError as e:
        return error(str(e))
    from mimo_epd.common.checkpoint import CheckpointError, check_worker

    try:  # every file the worker needs, checked before it loads anything
        cfg.tokenizer = check_worker(cfg.model, cfg.tokenizer, cfg.max_model_len)
    except CheckpointError as e:
        return error(f"cannot start the LLM worker: {e}", 1)
    setup_logging(cfg.log_level)
    if cfg.node_rank > 0:  # another machine's ranks of node 0's replica: no API, no scheduler
        from llm_backend.parallel.replica import host_ranks, spec_from_config

        return host_ranks(spec_from_config(cfg), cfg.node_rank)
    from .serve import exit_with_serve

    exit_with_serve()  # started by `serve`: leave with it
    from mimo_epd.common.malloc import keep_freed_memory

    # Each step allocates and frees the same activations: with glibc's defaults a tiny worker faulted ~4 fresh pages
    # per generated token, ~1 with freed buffers kept (docs/reliability.md, the LLM worker's memory).
    keep_freed_memory()
    try:
        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        role = build_role(cfg)
        engine = LLM.from_config(cfg, scheduler=role)
        rc = uvloop.run(
            serve_llm(
                engine,
                cfg.host,
                cfg.port,
                cfg.encoder or None,
                grace_s=cfg.grace_period_s,
                config=server_cfg,
                model=cfg.model,
                role=role,
            )
        )
    except (OSError, ValueError, RuntimeError) as e:
        logging.getLogger("mimo_epd").error("cannot start the LLM worker: %s", one_line(e))
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130
    from .serve import exit_now

    return exit_now(rc)


def register(commands) -> None:
    commands.command(
        "llm",
        usage="%(prog)s [FLAGS]",
        help="run one LLM worker (Generator/Generate, streaming)",
        setup=add_llm_flags,
        run=run_llm,
        epilog="Prints `ready HOST:PORT` on stdout once serving; logs go to stderr.",
    )
