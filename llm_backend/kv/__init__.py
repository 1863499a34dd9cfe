"""KV cache management: slot pools (`pools.py`), the SWA-aware radix prefix cache (`swa_radix_cache.py`)
and a running request's slots on top of it (`request_kv.py`)."""

from .pools import PoolExhausted, SlotPool
from .request_kv import RequestKV
from .swa_radix_cache import Match, SWARadixCache, fit_checkpoint_interval

__all__ = ["SlotPool", "PoolExhausted", "SWARadixCache", "Match", "RequestKV", "fit_checkpoint_interval"]
