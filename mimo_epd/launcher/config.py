"""The node's own flags (`mimo-epd serve`): `NodeConfig`, plus the LLM workers' flags passed through as
`--llm-*` (generated from LLMConfig) and the routing flags (LLMRouterConfig), so every default is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mimo_epd.common import flags
from mimo_epd.common.auth import AUTH_FIELDS, AuthConfig
from mimo_epd.common.flags import embedded, flag
from mimo_epd.common.http_server import EDGE_FIELDS, EdgeConfig

if TYPE_CHECKING:
    from mimo_epd.router.config import LLMRouterConfig


def _llm_default(name: str):
    """The worker's own default for a node flag that sets an LLM-worker setting (declared once, in LLMConfig)."""
    from llm_backend.config import LLMConfig

    return LLMConfig.__dataclass_fields__[name].default


@dataclass
class NodeConfig:
    """The node's own flags (`serve`); the encoders' come from EncoderServerConfig, the LLM workers' from
    LLMConfig (passed through as --llm-*), the routing ones from LLMRouterConfig."""

    checkpoint: str = flag(
        "",
        "the model to serve, same as MODEL: 'tiny' (the default), 'tiny-random' or a checkpoint directory; its LLM "
        "and, when its config.json has a vision_config, its vision tower (--encoder-model / --llm-model override "
        "one part)",
        name="model",
    )
    served_model_name: str = flag("", "the model id clients send and /v1/models lists (empty = the model's name)")
    max_model_len: int = flag(
        0,
        "longest sequence (prompt + output) of a request (0 = the model's max_position_embeddings, at most the KV pool)",
    )
    tokenizer: str = flag(
        "", "tokenizer.json, or a directory holding one (empty = the LLM checkpoint's; 'bytes' = one token per byte)"
    )
    encoders: int = flag(1, "encoder processes on this node, sharing one shm cache")
    drain_timeout_s: float = flag(
        10.0,
        "on SIGTERM/SIGINT (Ctrl-C), seconds the HTTP API lets requests in flight finish; then each open stream "
        "ends with an error event and [DONE]",
    )
    health_interval_s: float = flag(1.0, "seconds between the router's health checks of each encoder")
    vnodes: int = flag(160, "virtual nodes per encoder on the hash ring")
    encoder_load_factor: float = flag(
        1.25,
        "bounded loads on the hash ring: an encoder holds at most this times the mean of the router's items in flight "
        "(rounded up, counting the new one); an item whose owner is full goes to the next encoder clockwise (0 = "
        "always the owner)",
    )
    restart_encoders: bool = flag(True, "restart an encoder process that exits unexpectedly")
    restart_llm_workers: bool = flag(True, "restart an LLM worker process that exits unexpectedly")
    encoder_start_timeout_s: float = flag(180.0, "seconds to wait for an encoder's (or an LLM worker's) ready line")
    llm: bool = flag(True, "start LLM workers and serve Generate (and the HTTP API) through the router")
    llm_model: str = flag("", "the LLM workers' checkpoint, when not MODEL's (empty = MODEL)")
    llm_kv_cache_tokens: int = flag(_llm_default("kv_cache_tokens"), "each LLM worker's full-attention KV pool, tokens")
    llm_swa_cache_tokens: int = flag(
        _llm_default("swa_cache_tokens"), "each LLM worker's sliding-window KV pool, tokens"
    )
    http_port: int = flag(8000, "the router's OpenAI-compatible HTTP API (needs --llm); 0 = any free port, -1 = off")
    edge: EdgeConfig = embedded(EdgeConfig)  # the HTTP API's limits, on the front and on every worker
    auth: AuthConfig = embedded(AuthConfig)  # API keys and TLS of the node's ports; workers get the internal key
    llm_workers: int = flag(
        -1,
        "colocated LLM worker processes on this node, each its own engine; on the CPU each gets cores // N torch "
        "threads unless --llm-torch-threads is set (-1 = 1, or 0 when --pd-decode-workers is set: a node asked for "
        "1 prefill + 1 decode worker runs exactly those)",
    )
    pd_prefill_workers: int = flag(
        0, "prefill-role LLM workers (docs/pd.md): they compute prompts and write their KV into decode workers"
    )
    pd_decode_workers: int = flag(
        0,
        "decode-role LLM workers: each asks a prefill worker for a prompt's KV, then decodes (next to --llm-workers; "
        "--decode-workers is the encoders' image-decode processes)",
    )
    join: str = flag(
        "",
        "redis://HOST:PORT/DB: register this node's encoders and LLM workers there (with heartbeats) for the "
        "routers that share it; no router of its own (empty = off)",
    )
    node_host: str = flag(
        "127.0.0.1",
        "address the node's encoders and workers listen on and register under; use a routable one when routers "
        "run on other machines",
    )
    # Set by from_args, not flags of their own:
    routing: LLMRouterConfig = field(default=None, metadata={"flag": False})  # type: ignore[assignment]
    chat_template: str = field(default="", metadata={"flag": False})  # --llm-chat-template: the router renders too
    llm_args: list = field(default_factory=list, metadata={"flag": False})  # the --llm-* flags for each worker
    # --llm-data-parallel-size M: the M --llm-workers are one DP group (each given its --data-parallel-rank)
    llm_data_parallel: int = field(default=1, metadata={"flag": False})
    # why media items are refused (the model has no vision tower: no encoder process); empty = they are served
    media_refusal: str = field(default="", metadata={"flag": False})

    @staticmethod
    def add_arguments(parser) -> None:
        flags.add_arguments(parser, NodeConfig)
        from mimo_epd.router.config import add_routing_arguments

        add_routing_arguments(parser)
        add_llm_passthrough(parser)

    @classmethod
    def from_args(cls, args) -> "NodeConfig":
        cfg = flags.from_args(cls, args)
        cfg.edge.validate()
        cfg.auth = cfg.auth.resolved()
        if cfg.join and cfg.auth.api_key and not cfg.auth.internal_api_key:
            raise ValueError(
                "--join with --api-key needs --internal-api-key (or $MIMO_EPD_INTERNAL_API_KEY), the same on every "
                "node and router of the fleet: routers elsewhere call this node's workers with it"
            )
        cfg.auth = cfg.auth.with_internal_key()
        if cfg.encoders < 1:
            raise ValueError(f"--encoders must be at least 1, got {cfg.encoders}")
        if cfg.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {cfg.drain_timeout_s}")
        cfg.llm_data_parallel = getattr(args, "llm_data_parallel_size", 1) or 1
        if cfg.llm_workers == -1:
            cfg.llm_workers = 0 if cfg.pd_decode_workers > 0 else cfg.llm_data_parallel
        if cfg.llm_workers < 0 or cfg.pd_prefill_workers < 0 or cfg.pd_decode_workers < 0:
            raise ValueError("--llm-workers, --pd-prefill-workers and --pd-decode-workers must be >= 0")
        if cfg.llm_workers + cfg.pd_decode_workers < 1:
            raise ValueError("a node needs at least one worker that decodes: --llm-workers or --pd-decode-workers >= 1")
        if cfg.pd_prefill_workers and not cfg.pd_decode_workers:
            raise ValueError(
                "--pd-prefill-workers needs --pd-decode-workers (prefill workers only serve decode workers)"
            )
        dp = cfg.llm_data_parallel
        if dp > 1 and (cfg.llm_workers != dp or cfg.pd_prefill_workers or cfg.pd_decode_workers):
            raise ValueError(
                f"--llm-data-parallel-size {dp}: the node's --llm-workers are its DP ranks, so it needs --llm-workers "
                f"{dp} (got {cfg.llm_workers}) and no P/D workers"
            )
        if cfg.join and not cfg.join.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--join needs a redis:// URL, got {cfg.join!r}")
        from mimo_epd.router.config import routing_config

        # the router tokenizes like the workers (their model) and renders chats with their template
        cfg.routing = routing_config(args, model=cfg.llm_model, tokenizer=cfg.tokenizer)
        cfg.chat_template = getattr(args, "llm_chat_template", "")
        cfg.llm_args = llm_passthrough_args(args)
        return cfg


# Worker flags `serve` sets itself, or already has under its own name.
_LLM_OWN = {
    "host",
    "port",
    "encoder",
    "http_port",
    "log_level",
    "grace_period_s",
    "model",
    "kv_cache_tokens",
    "swa_cache_tokens",
    "served_model_name",
    "max_model_len",
    "tokenizer",
    "role",  # --pd-prefill-workers / --pd-decode-workers
    "data_parallel_rank",  # each of --llm-workers is given its own with --llm-data-parallel-size
    "pd_prefill",
}


_LLM_OWN |= EDGE_FIELDS | AUTH_FIELDS  # the node's edge flags, given to its workers too (node.py); keys by env


def add_llm_passthrough(parser) -> None:
    """Every other `mimo-epd llm` flag as `--llm-<flag>`, generated from LLMConfig (one flag source)."""
    from llm_backend.config import LLMConfig

    flags.add_arguments(parser, LLMConfig, prefix="llm_", skip=_LLM_OWN)


def llm_passthrough_args(args) -> list[str]:
    """The `--<flag>` arguments for each worker from the `--llm-<flag>` values that differ from the defaults."""
    from llm_backend.config import LLMConfig

    return flags.to_argv(flags.from_args(LLMConfig, args, prefix="llm_"), skip=_LLM_OWN)
