"""The one builder of a worker's KV bookkeeping: the two slot pools and the prefix cache over them (the SWA-aware
radix cache, or the tiered one when a host tier or a shared store is on).

Used by the engine (`LLM`), the simulator's worker and the benchmarks that replay the cache (`bench kv`,
`bench prefix-cache`), so all of them run the same parts built the same way. Sizes are in the caller's units
(tokens for the engine; a simulator or a benchmark may count a unit as U tokens, and then gives `token_bytes` per
unit). The KV tensors themselves are not built here (`paged_attention.KVPools`); a tiered cache in data mode is
attached to them by the caller (`TieredRadixCache.attach`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .pools import SlotPool
from .swa_radix_cache import SWARadixCache


@dataclass(frozen=True)
class KVLayout:
    """What to build. `window`: the model's sliding window (a very large value: a full-attention-only model);
    `checkpoint_interval`: the SWA checkpoint interval (0 = none). Tiers: on when `host_full_tokens` > 0 or `store`
    is given (kv/tiers: `policy`, `write_through`, `swa_backfill`, `store_write`, `token_bytes` for bookkeeping
    mode, `evict_fraction` for the host's eviction watermark)."""

    full_tokens: int
    swa_tokens: int
    page_size: int
    window: int
    checkpoint_interval: int = 0
    host_full_tokens: int = 0
    host_swa_tokens: int = 0
    store: object | None = None
    store_write: str = "evict"
    swa_backfill: bool = False
    policy: str = "lru"
    write_through: bool = False
    token_bytes: tuple[int, int] | None = None
    evict_fraction: float | None = None

    @property
    def tiered(self) -> bool:
        return self.host_full_tokens > 0 or self.store is not None


@dataclass
class KVParts:
    full_pool: SlotPool
    swa_pool: SlotPool
    cache: SWARadixCache
    tiers: object | None  # the cache itself when tiered (kv.tiers.TieredRadixCache), else None


def build_kv(layout: KVLayout) -> KVParts:
    """The pools and the prefix cache of `layout` (the checkpoint interval set as given: callers that fit a
    default do it before)."""
    full_pool = SlotPool("full", layout.full_tokens, layout.page_size)
    swa_pool = SlotPool("swa", layout.swa_tokens)
    if not layout.tiered:
        cache = SWARadixCache(full_pool, swa_pool, layout.window, full_pool.page_size)
        tiers = None
    else:
        from .tiers import TieredRadixCache  # torch: only for tiered workers
        from .tiers.cache import DEFAULT_EVICT_FRACTION

        cache = TieredRadixCache(
            full_pool,
            swa_pool,
            layout.window,
            full_pool.page_size,
            host_full_tokens=layout.host_full_tokens,
            host_swa_tokens=layout.host_swa_tokens,
            policy=layout.policy,
            write_through=layout.write_through,
            swa_backfill=layout.swa_backfill,
            store=layout.store,
            store_write=layout.store_write,
            token_bytes=layout.token_bytes or (0, 0),
            evict_fraction=DEFAULT_EVICT_FRACTION if layout.evict_fraction is None else layout.evict_fraction,
        )
        tiers = cache
    cache.swa_checkpoint_interval = layout.checkpoint_interval
    return KVParts(full_pool, swa_pool, cache, tiers)
