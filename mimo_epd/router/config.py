"""The LLM router's settings: one dataclass whose fields are the routing flags of `mimo-epd serve` and
`mimo-epd router` (built through mimo_epd/common/flags.py, like every other command), with the policies' knobs
embedded as their own `PolicyConfig`, so each default is written once.

`workers` and `model` are flags of `mimo-epd router` only: `serve` knows its own workers and passes its
`--llm-model`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimo_epd.common.flags import embedded, flag

from .policies import POLICIES, PolicyConfig

# Fields that `serve` sets itself instead of taking them as flags.
ROUTER_ONLY = frozenset({"workers", "model", "tokenizer"})


@dataclass
class LLMRouterConfig:
    policy: str = flag("affinity", "LLM routing policy", choices=tuple(POLICIES), name="llm_policy")
    router_state: str = flag("memory", "'memory' (this router only) or redis://HOST:PORT/DB shared by every router")
    workers: str = flag(
        "",
        "LLM workers GRPC[/HTTP],... this router watches itself (empty = discover them in --router-state)",
    )
    model: str = flag("tiny", "the workers' model, for the tokenizer")
    tokenizer: str = flag(
        "", "the workers' tokenizer.json, when not the model's (empty = the model's; 'bytes' = one token per byte)"
    )
    weights: PolicyConfig = embedded(PolicyConfig)
    member_ttl_s: float = flag(
        3.0, "a worker's or encoder's registration and index entries expire this long after its last heartbeat"
    )
    poll_wait_ms: int = flag(500, "long-poll wait of the KV-event feeds")
    index_sync_ms: int = flag(
        250,
        "how long a pick waits for the index to reach what a worker has already answered (the KV-event position its "
        "response carries), so an agent's next turn is routed on its previous one; 0 = never wait",
    )
    discovery_interval_s: float = flag(0.5, "seconds between reads of the registry")
    down_s: float = flag(
        5.0, "a worker that failed a call is skipped this long, or until its feed answers again", name="worker_down_s"
    )
    worker_wait_s: float = flag(
        3.0,
        "a request that finds no live LLM worker waits up to this long for one to (re)register before it fails with "
        "UNAVAILABLE / 503 (a restart, a heartbeat late under load); 0 = fail at once",
    )

    pd_max_prefill_queue: int = flag(
        8192,
        "prompt tokens queued at every prefill worker above which a decode worker's request is prefilled on the decode "
        "worker itself (conditional disaggregation; -1 = never)",
    )

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--llm-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.member_ttl_s <= 0 or self.poll_wait_ms <= 0 or self.discovery_interval_s <= 0:
            raise ValueError("--member-ttl-s, --poll-wait-ms and --discovery-interval-s must be positive")
        if self.index_sync_ms < 0:
            raise ValueError(f"--index-sync-ms must be >= 0, got {self.index_sync_ms}")
        if self.down_s < 0 or self.worker_wait_s < 0 or self.weights.tree_blocks < 1:
            raise ValueError("--worker-down-s and --worker-wait-s must be >= 0, --cache-aware-tree-blocks positive")


def add_routing_arguments(parser, skip: frozenset[str] = ROUTER_ONLY) -> None:
    """The routing flags (`serve` leaves out the router-only ones)."""
    from mimo_epd.common import flags

    flags.add_arguments(parser, LLMRouterConfig, skip=skip)


def routing_config(args, **overrides) -> LLMRouterConfig:
    """The LLMRouterConfig of parsed flags (fields missing from `args` keep their defaults), validated."""
    from mimo_epd.common import flags

    cfg = flags.from_args(LLMRouterConfig, args, **overrides)
    cfg.validate()
    return cfg
