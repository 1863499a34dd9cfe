"""KV tiers below the device pools: the tiered radix cache (`cache.py`, a subclass of the SWA-aware radix cache:
cross-tier matching, write-back, the store's pages), the host tier's data (`host.py`), the shared page stores
(`store.py`) and the layer-by-layer loads into the device pools (`loader.py`). See docs/kv-tiers.md."""

from .cache import TieredRadixCache
from .host import HostCopy, TierStats
from .loader import LayerwiseLoad, LoadStats
from .store import MemoryKVStore, PageData, RedisKVStore

__all__ = [
    "TieredRadixCache",
    "HostCopy",
    "TierStats",
    "LayerwiseLoad",
    "LoadStats",
    "RedisKVStore",
    "MemoryKVStore",
    "PageData",
]
