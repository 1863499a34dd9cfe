"""An in-process LRU cache of item embeddings, bounded by bytes.

Keyed by content key (see mimo_epd.content_key). Entries are immutable: a tensor is stored once and
handed out as is; readers never see a half-written entry because an entry is only published after
it is complete (a single dict assignment on the event loop thread).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachedEmbedding:
    embedding: torch.Tensor  # [num_tokens, hidden], on the CPU
    grid_thw: tuple[int, int, int]

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
        return {"entries": len(self._entries), "bytes_used": self.bytes_used, "capacity_bytes": self.capacity_bytes,
                "hits": self.hits, "misses": self.misses, "inserts": self.inserts, "evictions": self.evictions}
