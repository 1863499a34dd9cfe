"""The LLM worker's serving flags (HTTP API, admission limits); the engine's own flags live with the engine."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class ServerConfig:
    http_port: int = 0  # 0 = a free port (printed as `http HOST:PORT` before `ready`), -1 = no HTTP API
    served_model_name: str = ""  # empty = the model's name (`tiny`, or the checkpoint directory's name)
    chat_template: str = ""  # a jinja file overriding the checkpoint's template
    max_waiting: int = 1024  # requests waiting for admission; beyond it new ones get 429 / RESOURCE_EXHAUSTED
    default_max_tokens: int = 256  # chat completions without max_tokens
    media_timeout_s: float = 60.0  # deadline for the encoder to answer a request's media

    @staticmethod
    def add_arguments(parser) -> None:
        """Adds the flags the parser does not have yet (the engine's LLMConfig may define --http-port and
        --max-waiting itself: one flag, one value, read by both)."""
        have = set(getattr(parser, "_option_string_actions", {}))

        def add(flag, **kw):
            if flag not in have:
                parser.add_argument(flag, **kw)

        add("--http-port", type=int, default=0,
            help="OpenAI-compatible HTTP API port; 0 = any free port, -1 = off (default: 0)")
        add("--served-model-name", default="",
            help="model id in the HTTP API (default: the model's name)")
        add("--chat-template", default="",
            help="jinja chat template file overriding the checkpoint's (default: the checkpoint's)")
        add("--max-waiting", type=int, default=1024,
            help="requests waiting for admission before new ones are refused with 429 (default: 1024)")
        add("--default-max-tokens", type=int, default=256,
            help="completion tokens of a chat request that sets no max_tokens (default: 256)")
        add("--media-timeout-s", type=float, default=60.0,
            help="seconds the encoder may take for one request's media (default: 60)")

    @classmethod
    def from_engine(cls, engine) -> "ServerConfig":
        """Defaults, with the engine config's http_port / max_waiting where it has them."""
        cfg = getattr(engine, "config", None)
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})

    @classmethod
    def from_args(cls, args) -> "ServerConfig":
        cfg = cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
        if cfg.http_port < -1 or cfg.http_port > 65535:
            raise ValueError(f"--http-port must be -1, 0 or a port number, got {cfg.http_port}")
        if cfg.max_waiting < 0 or cfg.default_max_tokens < 1 or cfg.media_timeout_s <= 0:
            raise ValueError("need --max-waiting >= 0, --default-max-tokens >= 1 and --media-timeout-s > 0")
        return cfg
