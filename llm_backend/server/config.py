"""The serving layer's settings (HTTP API, admission), read from the worker's flags. The flags themselves are
fields of `LLMConfig` (llm_backend/config.py, the one flag source of `mimo-epd llm`), so the defaults here
are taken from there."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from llm_backend.config import LLMConfig
from mimo_epd.common import flags
from mimo_epd.common.auth import AuthConfig
from mimo_epd.common.http_server import EdgeConfig


def _default(name: str):
    return field(default=LLMConfig.__dataclass_fields__[name].default)


@dataclass
class ServerConfig:
    http_port: int = _default("http_port")  # 0 = a free port (printed as `http HOST:PORT` before `ready`), -1 = off
    served_model_name: str = _default("served_model_name")  # empty = `tiny` or the checkpoint directory's name
    chat_template: str = _default("chat_template")  # a jinja file overriding the checkpoint's template
    max_waiting: int = _default("max_waiting")  # waiting requests beyond which new ones get 429 / RESOURCE_EXHAUSTED
    default_max_tokens: int = _default("default_max_tokens")  # chat completions without max_tokens
    max_prompts_per_request: int = _default("max_prompts_per_request")  # a /v1/completions prompt list's length
    max_samples_per_request: int = _default("max_samples_per_request")  # n / best_of
    responses_store_size: int = _default("responses_store_size")  # Responses API answers kept
    responses_store_ttl_s: float = _default("responses_store_ttl_s")  # ... and for how long
    media_timeout_s: float = _default("media_timeout_s")  # deadline for the encoder to answer a request's media
    edge: EdgeConfig = field(default_factory=EdgeConfig)  # the HTTP API's limits (mimo_epd/common/http_server.py)
    auth: AuthConfig = field(default_factory=AuthConfig)  # API keys and TLS (mimo_epd/common/auth.py)

    @classmethod
    def from_engine(cls, engine) -> ServerConfig:
        """The settings of the engine's LLMConfig (defaults for an engine built without one)."""
        cfg = getattr(engine, "config", None)
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})

    @classmethod
    def from_args(cls, args) -> ServerConfig:
        cfg = cls(
            **{
                f.name: getattr(args, f.name)
                for f in fields(cls)
                if hasattr(args, f.name) and f.name not in ("edge", "auth")
            }
        )
        cfg.edge = flags.from_args(EdgeConfig, args)
        cfg.edge.validate()
        cfg.auth = flags.from_args(AuthConfig, args).resolved()
        if cfg.http_port < -1 or cfg.http_port > 65535:
            raise ValueError(f"--http-port must be -1, 0 or a port number, got {cfg.http_port}")
        if cfg.max_waiting < 0 or cfg.default_max_tokens < 1 or cfg.media_timeout_s <= 0:
            raise ValueError("need --max-waiting >= 0, --default-max-tokens >= 1 and --media-timeout-s > 0")
        if cfg.max_samples_per_request < 1:
            raise ValueError(f"--max-samples-per-request must be >= 1, got {cfg.max_samples_per_request}")
        if cfg.responses_store_size < 0 or cfg.responses_store_ttl_s <= 0:
            raise ValueError("--responses-store-size must be >= 0 and --responses-store-ttl-s positive")
        if cfg.max_prompts_per_request < 1:
            raise ValueError(f"--max-prompts-per-request must be >= 1, got {cfg.max_prompts_per_request}")
        return cfg
