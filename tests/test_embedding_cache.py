import torch

from encoder_server.embedding_cache import CachedEmbedding, EmbeddingLRU


def entry(n):
    return CachedEmbedding(torch.zeros(n, 4), (1, 2, 2 * n))  # n*16 bytes


def test_lru_evicts_by_bytes_in_recency_order():
    c = EmbeddingLRU(capacity_bytes=16 * 10)
    c.put("a", entry(4))
    c.put("b", entry(4))
    assert c.get("a") is not None  # a is now most recent
    c.put("c", entry(4))  # 12 entries of 16 bytes > 10: evict LRU = b
    assert c.get("b") is None and c.get("a") is not None and c.get("c") is not None
    assert c.bytes_used == 16 * 8
    s = c.stats()
    assert s["evictions"] == 1 and s["hits"] == 3 and s["misses"] == 1 and s["inserts"] == 3


def test_oversized_entry_is_refused_and_replacing_keeps_accounting():
    c = EmbeddingLRU(capacity_bytes=100)
    assert not c.put("big", entry(10))
    assert c.put("a", entry(2)) and c.put("a", entry(3))
    assert len(c) == 1 and c.bytes_used == 48
