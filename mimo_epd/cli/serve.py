"""`mimo-epd serve` (the product on one node) and `mimo-epd encoder` (one encoder server)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .common import error, one_line, setup_logging

# --help sections for the encoder's flags (EncoderServerConfig): a field belongs to the section of the
# nearest field named here at or before it, in declaration order (fields added inside a section join it),
# unless its metadata names a `group` itself.
ENCODER_SECTIONS = {
    "host": "encoder: model and serving",
    "max_items_per_request": "encoder: limits",
    "max_video_bytes": "video",
    "fetch_timeout_s": "encoder: fetching and URL policy",
    "pipeline": "encoder: pipeline",
    "cache_bytes": "cache",
}
# Fields that read better elsewhere in `serve --help` than where the dataclass declares them.
SERVE_MOVES = {"host": "node", "port": "node", "grace_period_s": "node", "log_level": "node", "metrics_port": "node"}
ENCODER_MOVES = {
    "host": "server",
    "port": "server",
    "grace_period_s": "server",
    "log_level": "server",
    "metrics_port": "server",
}
# Node flags (NodeConfig and whatever the launcher adds) by prefix of their dest; the rest are "node".
NODE_PREFIXES = (
    ("llm_policy", "routing"),
    ("affinity", "routing"),
    ("cache_aware", "routing"),
    ("kv_cost", "routing"),
    ("member_ttl", "routing"),
    ("poll_wait", "routing"),
    ("discovery", "routing"),
    ("worker_down", "routing"),
    ("llm", "LLM worker"),
    ("http", "HTTP (OpenAI API)"),
    ("health_interval", "routing"),
    ("vnodes", "routing"),
    ("encoder_load", "routing"),
    ("routing", "routing"),
    ("router", "routing"),
)
GROUP_ORDER = (
    "server",
    "node",
    "routing",
    "LLM worker",
    "LLM KV cache",
    "LLM scheduling",
    "LLM limits",
    "HTTP (OpenAI API)",
    "encoder: model and serving",
    "encoder: limits",
    "encoder: fetching and URL policy",
    "encoder: pipeline",
    "video",
    "cache",
)


class _Grouped:
    """Looks like a parser to `add_arguments(parser)` helpers; puts each flag into its --help section."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        section_of,
        helps: dict[str, str] | None = None,
        renames: dict[str, tuple[str, object]] | None = None,
    ):
        self.parser, self.section_of, self.helps = parser, section_of, helps or {}
        self.renames = renames or {}  # flag -> (the flag it is called here, its default here)
        self.groups = getattr(parser, "_mimo_groups", None)
        if self.groups is None:
            self.groups = parser._mimo_groups = {}
            for title in GROUP_ORDER:  # fixed order, empty groups are not shown
                self.groups[title] = parser.add_argument_group(title)

    def add_argument(self, *flags, **kw):
        dest = kw.get("dest") or flags[0].lstrip("-").replace("-", "_")
        if flags[0] in self.renames:
            kw["dest"], (new, kw["default"]) = dest, self.renames[flags[0]]
            flags = (new, *flags[1:])
        title = self.section_of(flags[0].lstrip("-").replace("-", "_"))  # by flag name (a dest may differ)
        if dest in self.helps:
            kw["help"] = f"{self.helps[dest]} (default: {kw.get('default')!r})"
        if "metavar" not in kw and "action" not in kw and kw.get("type", str) in (int, float, str):
            kw["metavar"] = _metavar(dest, kw.get("type", str))
        if title not in self.groups:
            self.groups[title] = self.parser.add_argument_group(title)
        return self.groups[title].add_argument(*flags, **kw)

    def __getattr__(self, name):  # set_defaults, add_mutually_exclusive_group, ...
        return getattr(self.parser, name)


def _metavar(dest: str, typ: type) -> str:
    if typ is float:
        return "MS" if dest.endswith("_ms") else "S" if dest.endswith("_s") else "X"
    if typ is int:
        return "PORT" if dest.endswith("port") else "BYTES" if dest.endswith("bytes") else "N"
    return "ADDR" if dest in ("host", "encoder") else "STR"


# serve runs several processes: its --metrics-port is one endpoint for all of them (mimo_epd/node_metrics.py).
SERVE_HELPS = {
    "model": "the vision tower's checkpoint, when not MODEL's (empty = MODEL's vision_config)",
    "metrics_port": "Prometheus /metrics of the whole node on this port, as the HTTP API's /metrics: every "
    'process\'s metrics merged, each sample labelled process="encoder-N", "llm-N" or "router" (encoder N '
    "itself serves on PORT+1+N) (0 = off)",
}
# In serve, --model names the whole model (MODEL): the encoders' own --model is --encoder-model.
SERVE_RENAMES = {"--model": ("--encoder-model", "")}


def _encoder_section_of(moves: dict[str, str]):
    from dataclasses import fields

    from encoder_server.config import EncoderServerConfig

    sections, current = {}, "encoder: model and serving"
    for f in fields(EncoderServerConfig):
        current = ENCODER_SECTIONS.get(f.name, current)
        sections[f.name] = f.metadata.get("group") or moves.get(f.name) or current
    return lambda dest: sections.get(dest, "encoder: model and serving")


def _node_section_of(dest: str) -> str:
    for prefix, title in NODE_PREFIXES:
        if dest.startswith(prefix):
            return title
    return "node"


def add_encoder_flags(p: argparse.ArgumentParser) -> None:
    from encoder_server.config import EncoderServerConfig

    EncoderServerConfig.add_arguments(_Grouped(p, _encoder_section_of(ENCODER_MOVES)))


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from encoder_server.config import EncoderServerConfig
    from mimo_epd.launcher import NodeConfig

    encoder_section = _encoder_section_of(SERVE_MOVES)
    p.add_argument(
        "model_arg",
        nargs="?",
        default="",
        metavar="MODEL",
        help="the model to serve: 'tiny' (the default), 'tiny-random' or a checkpoint directory (same as --model)",
    )
    EncoderServerConfig.add_arguments(_Grouped(p, encoder_section, SERVE_HELPS, SERVE_RENAMES))
    NodeConfig.add_arguments(_Grouped(p, _node_section_of))


def explain_bind_failure(message: str) -> str:
    """gRPC says only `Failed to bind to address HOST:PORT; set GRPC_VERBOSITY=debug ...`: binding the same
    address with a plain socket gives the operating system's reason (e.g. Address already in use)."""
    import re
    import socket

    m = re.search(r"Failed to bind to address (\S+?);", message)
    if not m:
        return message
    address = m.group(1)
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, int(port)))
        reason = "gRPC could not bind it"
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
    return f"cannot listen on {address} (--host/--port): {reason}"


def run_encoder(args) -> int:
    import uvloop

    from encoder_server.config import EncoderServerConfig
    from encoder_server.service import serve_encoder

    try:
        config = EncoderServerConfig.from_args(args)
    except ValueError as e:
        return error(str(e))
    from mimo_epd.common.checkpoint import CheckpointError, check_tower

    try:  # the tower's files, checked before anything loads
        check_tower(config.model)
    except CheckpointError as e:
        return error(f"cannot start the encoder: {e}", 1)
    setup_logging(config.log_level)
    parent = exit_with_serve()
    try:
        rc = uvloop.run(serve_encoder(config))
    except (OSError, ValueError, FileNotFoundError, RuntimeError) as e:
        logging.getLogger("mimo_epd").error("cannot start the encoder: %s", explain_bind_failure(one_line(e)))
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130
    finally:
        if parent is not None and config.shm_cache_name:  # its launcher died (SIGKILL): nobody else removes the cache
            from mimo_epd.launcher import remove_stale_segments

            remove_stale_segments(min_age_s=0.0, names=[config.shm_cache_name])
    return exit_now(rc)


def exit_now(rc: int) -> int:
    """A child of `serve` that has drained and stopped its servers leaves at once: the interpreter's own teardown
    (torch's and gRPC's threads) adds seconds to every node stop and has nothing left to release."""
    from mimo_epd.common.parent import marked_parent

    if marked_parent() is None:
        return rc
    # multiprocessing's own exit finalizers (named semaphores of the decode pools' queues): without them the
    # resource tracker that outlives this process prints "leaked semaphore objects" after the node's last line.
    from multiprocessing import util

    try:
        util._run_finalizers()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def exit_with_serve() -> int | None:
    """A worker that `serve` started (it set MIMO_EPD_PARENT_PID) gets SIGTERM, its normal drain, when that
    `serve` dies, even by SIGKILL: it would otherwise keep serving nobody. Returns that parent's pid."""
    import signal

    from mimo_epd.common.parent import exit_with_parent, marked_parent

    parent = marked_parent()
    if parent is not None:
        exit_with_parent(signum=signal.SIGTERM, parent=parent)
    return parent


def plan_serve(args):
    """MODEL (or --model) and the per-part overrides, checked against each other and against their files before
    any process starts (mimo_epd/common/checkpoint.py); sets the encoders' and the workers' model flags from it."""
    from mimo_epd.common.checkpoint import CheckpointError, plan_node
    from mimo_epd.common.model_names import TINY

    if args.model_arg and args.checkpoint and args.model_arg != args.checkpoint:
        raise CheckpointError(f"MODEL {args.model_arg!r} and --model {args.checkpoint!r} name different models")
    model = args.model_arg or args.checkpoint or TINY
    plan = plan_node(model, args.model, args.llm_model, args.tokenizer, args.llm, args.max_model_len)
    args.checkpoint = model
    args.model = plan.vision.name if plan.vision is not None else model
    args.llm_model = plan.llm.name if plan.llm is not None else (args.llm_model or model)
    args.tokenizer = plan.tokenizer
    return plan


def run_serve(args) -> int:
    import uvloop

    from encoder_server.config import EncoderServerConfig
    from mimo_epd.common.checkpoint import CheckpointError
    from mimo_epd.launcher import NodeConfig, serve_node

    try:
        plan = plan_serve(args)
    except CheckpointError as e:
        return error(f"cannot start: {e}", 1)
    try:
        enc, node = EncoderServerConfig.from_args(args), NodeConfig.from_args(args)
    except ValueError as e:
        return error(str(e))
    setup_logging(enc.log_level)
    for line in plan.notices:
        logging.getLogger("mimo_epd").warning("%s", line)
    if plan.vision is None:  # a text-only model: no encoder process, media refused with the reason
        node.encoders, node.media_refusal = 0, plan.notices[0]
    try:
        return uvloop.run(serve_node(enc, node))
    except (OSError, RuntimeError, ValueError) as e:
        logging.getLogger("mimo_epd").error("cannot start: %s", explain_bind_failure(str(e)))
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130


SERVE_EPILOG = """\
examples:
  mimo-epd serve                                   router + 1 encoder + LLM worker on 127.0.0.1:50051
  mimo-epd serve /models/MiMo-V2.5 --served-model-name mimo --max-model-len 8192
                                                   a checkpoint directory: its LLM and its vision tower
  mimo-epd serve --encoders 2 --metrics-port 9110  one /metrics for the whole node (label process=...)
  mimo-epd serve --port 0 --no-llm                 any free port (the ready line says which), no LLM worker

Prints `ready HOST:PORT` on stdout once everything serves; logs go to stderr."""


def register(commands) -> None:
    commands.command(
        "serve",
        usage="%(prog)s [MODEL] [FLAGS]",
        help="the product on this node: router + encoders sharing one shm cache + LLM worker",
        setup=add_serve_flags,
        run=run_serve,
        epilog=SERVE_EPILOG,
        description="Starts the product on this node: a front router on --host:--port that speaks the "
        "Encode and Generate APIs,\n--encoders encoder processes sharing one shared-memory "
        "embedding cache, and an LLM worker (--llm).",
    )
    commands.command(
        "encoder",
        usage="%(prog)s [FLAGS]",
        help="run one encoder server (no router, no LLM worker)",
        setup=add_encoder_flags,
        run=run_encoder,
        epilog="Prints `ready HOST:PORT` on stdout once serving; logs go to stderr.",
    )
