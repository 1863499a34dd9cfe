"""KV tiers below the device pools: the tiered radix cache (`cache.py`, a subclass of the SWA-aware radix cache:
cross-tier matching, write-back, the store's pages), the host tier's data (`host.py`), the shared page stores
(`store.py`: the page format, the `KVStore` protocol and the rules every backend shares; `redis_store.py`,
`mooncake_store.py`) and the layer-by-layer loads into the device pools (`loader.py`). See docs/kv-tiers.md."""

from .cache import TieredRadixCache
from .host import HostCopy, TierStats
from .loader import LayerwiseLoad, LoadStats
from .redis_store import RedisKVStore
from .store import KVStore, MemoryKVStore, PageData, SharedKVStore, open_store, store_scheme

__all__ = [
    "TieredRadixCache",
    "HostCopy",
    "TierStats",
    "LayerwiseLoad",
    "LoadStats",
    "KVStore",
    "SharedKVStore",
    "open_store",
    "store_scheme",
    "RedisKVStore",
    "MemoryKVStore",
    "PageData",
]
