"""KV tiers below the device pools: the host tier and the cross-tier logic (`host.py`), the shared
Redis store (`store.py`) and the layerwise host->device loading (`loader.py`). See docs/kv-tiers.md."""

from .host import HostCopy, KVTiers
from .loader import LayerwiseLoad, LoadStats
from .store import MemoryKVStore, PageData, RedisKVStore

__all__ = ["KVTiers", "HostCopy", "LayerwiseLoad", "LoadStats", "RedisKVStore", "MemoryKVStore", "PageData"]
