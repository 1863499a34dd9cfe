"""Embedding caches keyed by content key (see mimo_epd.common.content_key), with one interface:
`get(key) -> CachedEmbedding | None`, `put(key, CachedEmbedding) -> bool`, `stats() -> dict`.

- `EmbeddingLRU`: in-process, LRU bounded by bytes; what a lone encoder uses.
- `ShmEmbeddingStore`: the node-local shared-memory store (`shm_cache`), shared by every encoder
  process of the node, so an item one encoder computed is a hit for all of them.

Entries are immutable: content keys name the bytes and everything that shaped the embedding.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CachedEmbedding:
    embedding: torch.Tensor  # [num_tokens, hidden], on the CPU
    grid_thw: tuple[int, int, int]
    meta: dict | None = None  # videos: timestamps and what was sampled

    @property
    def nbytes(self) -> int:
        return self.embedding.numel() * self.embedding.element_size()


class EmbeddingLRU:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, CachedEmbedding] = OrderedDict()
        self.bytes_used = 0
        self.hits = self.misses = self.inserts = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedEmbedding | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, entry: CachedEmbedding) -> bool:
        """Inserts (or refreshes) an entry; returns False when it is larger than the whole cache."""
        if entry.nbytes > self.capacity_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes_used -= old.nbytes
        while self._entries and self.bytes_used + entry.nbytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes_used -= evicted.nbytes
            self.evictions += 1
        self._entries[key] = entry
        self.bytes_used += entry.nbytes
        self.inserts += 1
        return True

    def stats(self) -> dict:
        return {
            "entries": len(self._entries),
            "bytes_used": self.bytes_used,
            "capacity_bytes": self.capacity_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "inserts": self.inserts,
            "evictions": self.evictions,
        }


class ShmEmbeddingStore:
    """Adapter from the encoder's cache interface to `shm_cache.ShmCache`.

    `get` copies the entry out of shared memory (the reply is serialised anyway) and releases its pin
    at once, so a slow client never holds cache space. A video's metadata (timestamps, what was sampled)
    is stored inside its entry, so a hit always carries it.

    Cost: `get` copies the embedding (memory bandwidth: ~50 ms for a 100 MB entry into fresh pages) and,
    after a recovery or on a `verify_sample_rate` sample, hashes it (xxh3, ~7 ms per 100 MB). Both release
    the GIL; `get_async` runs them in a worker thread so the asyncio loop keeps serving meanwhile."""

    def __init__(self, name: str, size_bytes: int, verify_sample_rate: float = 0.01):
        from shm_cache import ShmCache

        self.cache = ShmCache.open(name, size_bytes, verify_sample_rate=verify_sample_rate)
        self.name = name

    def get(self, key: str) -> CachedEmbedding | None:
        entry = self.cache.get(key)
        if entry is None:
            return None
        with entry:
            arr = np.array(entry.array)  # copy out while pinned
            t = torch.from_numpy(arr)
            if entry.dtype == "bfloat16":
                t = t.view(torch.bfloat16)
            grid = entry.grid_thw
            meta = json.loads(entry.meta) if entry.meta else None
        return CachedEmbedding(t, grid, meta)

    async def get_async(self, key: str) -> CachedEmbedding | None:
        """`get` in a worker thread: for callers on an event loop (large entries take milliseconds)."""
        import asyncio

        return await asyncio.to_thread(self.get, key)

    def put(self, key: str, entry: CachedEmbedding) -> bool:
        t = entry.embedding.contiguous()
        meta = json.dumps(entry.meta).encode() if entry.meta is not None else None
        if t.dtype == torch.bfloat16:
            return self.cache.put(key, t.view(torch.uint16).numpy(), entry.grid_thw, dtype="bfloat16", meta=meta)
        return self.cache.put(key, t.numpy(), entry.grid_thw, meta=meta)

    def stats(self) -> dict:
        return {"shm_name": self.name, **self.cache.stats()}

    def close(self) -> None:
        self.cache.close()
