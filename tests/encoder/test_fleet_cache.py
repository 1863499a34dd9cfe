"""The fleet's embedding cache (encoder_server/cluster_cache.py) with real processes: two encoders, each with its own
node cache (two nodes' worth), one `mooncake_master` from the wheel, one `redis-server` for the encode lease.

- an image encoded on node A is a fleet hit on node B: no forward on B, the same rows;
- 16 concurrent requests for one new image, 8 on each node, encode it once in the whole fleet (the lease: one node
  encodes, the other waits for its entry);
- an entry is only ever served for its own key, intact (the value codec refuses another key, a flipped byte, a
  truncated value);
- with the store's master down an encoder keeps serving (it encodes; the lookups count as errors).
"""

from __future__ import annotations

import asyncio
import shutil
import time

import numpy as np
import pytest
import torch

from encoder_server.cluster_cache import decode_entry, encode_entry
from encoder_server.embedding_cache import CachedEmbedding
from mimo_epd.testing.mooncake_master import MooncakeMaster, master_binary
from mimo_epd.testing.redis_server import RedisServer, free_port
from mimo_epd.testing.servers import scrape, start_server
from tests.conftest import encode_image, textured


def test_the_value_codec_serves_only_an_intact_entry_for_its_own_key():
    for t in (torch.randn(5, 8), torch.randn(3, 4).to(torch.bfloat16)):
        e = CachedEmbedding(t, (1, 6, 10), {"timestamps_s": [0.0, 1.5], "end_s": 2.0})
        raw = encode_entry("k1", e)
        back = decode_entry("k1", raw)
        assert back is not None and torch.equal(back.embedding, t) and back.grid_thw == (1, 6, 10)
        assert back.meta == e.meta and back.embedding.dtype == t.dtype
        assert decode_entry("k2", raw) is None  # another key's value is never served
        flipped = bytearray(raw)
        flipped[-3] ^= 1
        assert decode_entry("k1", bytes(flipped)) is None
        assert decode_entry("k1", raw[:-4]) is None and decode_entry("k1", b"junk") is None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if master_binary() is None or shutil.which("redis-server") is None:
        pytest.skip("needs the mooncake-transfer-engine wheel's mooncake_master and redis-server")
    d = tmp_path_factory.mktemp("fleet")
    master, redis = MooncakeMaster(d), RedisServer(d)
    master.start()
    redis.start()
    ports = [free_port(), free_port()]
    args = ["--embedding-store", master.url, "--embedding-lease", redis.url, "--embedding-store-segment-bytes"]
    args += [str(64 << 20), "--cache-bytes", str(64 << 20), "--decode-workers", "1"]
    nodes = [start_server([*args, "--metrics-port", str(p)]) for p in ports]
    yield list(zip(nodes, ports)), master
    for n in nodes:
        n.stop()
    master.stop()
    redis.stop()


def _encode(address: str, data: bytes) -> np.ndarray:
    import grpc

    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        item = (
            encoder_pb2_grpc.EncoderStub(ch)
            .Encode(encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(data=data)]), timeout=60)
            .items[0]
        )
    return np.frombuffer(item.embedding.data, "<f4").reshape(tuple(item.embedding.shape))


def _count(port: int, name: str) -> float:
    return scrape(port).get(name, 0.0)


def _encoded(port: int) -> float:
    return _count(port, "encoder_batch_items_sum")


def _wait_connected(*ports: int) -> None:
    """Until every encoder's store client is up (it connects in the background): its lookups stop erring."""
    deadline = time.monotonic() + 60
    for p in ports:
        while _count(p, "encoder_cluster_cache_connected") < 1:
            assert time.monotonic() < deadline, "the embedding store did not connect"
            time.sleep(0.1)


def test_an_image_encoded_on_one_node_is_a_fleet_hit_on_the_other(fleet):
    ((a, pa), (b, pb)), _ = fleet
    png = encode_image(textured(96, 128, seed=41), "PNG")
    _wait_connected(pa, pb)
    before = _encoded(pb)
    rows_a = _encode(a.address, png)
    for _ in range(100):  # the write is asynchronous: it lands within milliseconds
        if _count(pa, 'encoder_cluster_cache_total{event="writes"}') >= 1:
            break
        time.sleep(0.05)
    rows_b = _encode(b.address, png)
    assert np.array_equal(rows_a, rows_b)
    assert _encoded(pb) == before  # no forward on B
    assert _count(pb, 'encoder_cluster_cache_total{event="hits"}') >= 1
    assert _count(pb, 'encoder_cache_lookups_total{result="fleet_hit"}') >= 1


def test_concurrent_misses_across_the_fleet_encode_once(fleet):
    import grpc

    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    ((a, pa), (b, pb)), _ = fleet
    png = encode_image(textured(160, 96, seed=42), "PNG")
    _wait_connected(pa, pb)
    before = _encoded(pa) + _encoded(pb)

    async def go():
        chans = [grpc.aio.insecure_channel(n.address) for n in (a, b)]
        stubs = [encoder_pb2_grpc.EncoderStub(c) for c in chans]
        req = encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(data=png)])
        replies = await asyncio.gather(*(stubs[i % 2].Encode(req, timeout=60) for i in range(16)))
        for c in chans:
            await c.close()
        return [r.items[0].embedding.data for r in replies]

    rows = asyncio.run(go())
    assert len(set(rows)) == 1  # every request got the same rows
    assert _encoded(pa) + _encoded(pb) - before == 1  # one forward item in the fleet
    served = sum(_count(p, 'encoder_cluster_cache_total{event="lease_waits_served"}') for p in (pa, pb))
    assert served >= 1


def test_an_encoder_keeps_serving_when_the_store_is_down(tmp_path):
    if master_binary() is None:
        pytest.skip("needs the mooncake-transfer-engine wheel's mooncake_master")
    port = free_port()
    s = start_server(
        ["--embedding-store", f"mooncake://127.0.0.1:{free_port()}", "--metrics-port", str(port), "--cache-bytes", "0"]
    )
    try:
        png = encode_image(textured(64, 64, seed=43), "PNG")
        assert _encode(s.address, png).shape[0] > 0
        assert _count(port, 'encoder_cluster_cache_total{event="errors"}') >= 1
    finally:
        assert s.stop() == 0


def test_the_store_connects_in_the_background_and_calls_never_wait_for_it(tmp_path):
    """Before its master is up, a get or put fails at once (a miss, a dropped write) instead of waiting on
    Mooncake's setup; the helper connects once the master answers, and the same store then serves."""
    if master_binary() is None:
        pytest.skip("needs the mooncake-transfer-engine wheel's mooncake_master")
    from encoder_server.cluster_cache import MooncakeEmbeddingStore

    master = MooncakeMaster(tmp_path)
    store = MooncakeEmbeddingStore(master.url, 16 << 20, retry_s=0.5)
    try:
        t0 = time.monotonic()
        for call in (lambda: store.get("k"), lambda: store.put("k", b"v")):
            with pytest.raises(OSError, match="not connected"):
                call()
        assert time.monotonic() - t0 < 0.5 and not store.connected
        master.start()
        assert store.wait_connected(60), "the helper never connected to a live master"
        t0 = time.monotonic()
        assert store.put("k", b"value") is True and store.get("k") == b"value"
        assert time.monotonic() - t0 < 2.0
    finally:
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < 10
        master.stop()
