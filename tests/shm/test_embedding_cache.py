import os

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


def test_shm_store_video_hit_always_carries_its_timestamps_after_heavy_eviction():
    """A video's metadata lives inside its entry: whatever eviction does, a hit comes with its timestamps (it
    used to be a separate entry that could be evicted on its own)."""
    import uuid

    from encoder_server.embedding_cache import ShmEmbeddingStore

    name = f"mimo-test-{uuid.uuid4().hex[:12]}"
    store = ShmEmbeddingStore(name, 12 << 20)
    try:

        def video(i):
            meta = {"timestamps_s": [0.5 * i + g for g in range(4)], "video": {"fps": 2.0, "frames_sampled": 8}}
            return CachedEmbedding(torch.full((16, 64), float(i)), (4, 4, 4), meta)

        hits = 0
        for i in range(3000):  # ~4 KiB each into a ~1.5 MiB arena: the CLOCK hand sweeps it many times
            assert store.put(f"{i:032x}", video(i))
            if i % 3 == 0:  # a hot set, so some videos survive many sweeps
                store.get(f"{7:032x}")
            for j in (i, i - 1, i - 50, 7):
                hit = store.get(f"{max(j, 0):032x}")
                if hit is not None:
                    hits += 1
                    assert hit.meta == video(max(j, 0)).meta  # never a hit without (or with wrong) metadata
                    assert torch.equal(hit.embedding, video(max(j, 0)).embedding)
        st = store.stats()
        assert st["evictions"] > 2000 and hits > 6000
        assert store.get(f"{0:032x}") is None  # evicted long ago: the whole entry, metadata included
        bf = CachedEmbedding(torch.arange(8, dtype=torch.bfloat16).reshape(2, 4), (1, 2, 4), None)
        assert store.put("ab" * 16, bf)
        got = store.get("ab" * 16)
        assert got.meta is None and got.embedding.dtype == torch.bfloat16 and torch.equal(got.embedding, bf.embedding)
        import asyncio

        assert asyncio.run(store.get_async(f"{2999:032x}")).meta == video(2999).meta
    finally:
        store.close()
        os.unlink(f"/dev/shm/{name}")
