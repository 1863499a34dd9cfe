"""The shared KV tier on a real Mooncake Store: a `mooncake_master` from the wheel on free loopback ports, the
workers' stores set up over TCP with the master's HTTP metadata server. The same rules as the Redis tier
(tests/llm/test_kv_tiers.py): pages written by one worker are read by another with the outputs of a cold run, a
page without its window never replaces one with it, corrupted values are misses, and a master killed mid-run
costs hits only (requests never fail; once it is back, hits come back)."""

from __future__ import annotations

import time

import pytest
import torch

from llm_backend import LLM
from llm_backend.kv.events import block_hashes
from llm_backend.kv.tiers.store import PageData
from mimo_epd.testing.mooncake_master import MooncakeMaster, master_binary
from tests.llm.test_kv_tiers import SP, cold, model, workload  # noqa: F401 - module fixtures reused

OPTS = dict(kv_cache_tokens=160, swa_cache_tokens=200, page_size=4, chunk_size=16, release_interval=4, max_running=2)
STORE = dict(kv_store_segment_bytes=16 << 20, kv_store_buffer_bytes=4 << 20, kv_store_retry_s=0.5)


@pytest.fixture
def mooncake_master(tmp_path):
    if master_binary() is None:
        pytest.skip("the mooncake-transfer-engine-non-cuda wheel is not installed (a dependency in pyproject.toml)")
    master = MooncakeMaster(tmp_path)
    master.start()
    master.stores = []  # closed before the master stops (a client outliving it retries its RPCs for seconds)
    yield master
    for store in master.stores:
        store.close()
    master.stop()


def worker(model, master, **kw):  # noqa: F811
    llm = LLM(model, kv_store=master.url, **OPTS, **STORE, **kw)
    master.stores.append(llm.tiers.store)
    assert llm.tiers.store.wait_connected(30), "the Mooncake store did not connect"
    return llm


def generate(llm, prompts):
    outs = []
    for i in range(0, len(prompts), 2):
        res = llm.generate(prompt_token_ids=prompts[i : i + 2], sampling_params=SP)
        assert all(o.finish_reason == "length" for o in res)
        outs += [o.output_token_ids for o in res]
    return outs


@pytest.mark.parametrize("write", ["evict", "insert"])
def test_page_written_by_one_worker_is_read_by_another(model, cold, mooncake_master, write):  # noqa: F811
    prompts = workload()
    a = worker(model, mooncake_master, kv_store_write=write)
    assert generate(a, prompts) == cold
    if write == "evict":
        a.cache.evict_full(10**9)  # everything leaves worker A: its pages go to the store
    a.tiers.store.flush()
    assert a.tiers.store.stats.puts > 0 and a.tiers.store.stats.errors == 0
    b = worker(model, mooncake_master, kv_store_write=write)  # a fresh worker: empty tree (A keeps serving)
    assert generate(b, prompts) == cold
    s = b.stats()
    assert s["kv_tier_hit_store"] > 0 and s["kv_tier_pages_s2d"] > 0 and s["kv_store_hits"] > 0
    assert s["kv_store_corrupt"] == 0 and s["kv_store_up"] == 1


def test_a_page_without_its_window_never_replaces_one_with_it(mooncake_master):
    from llm_backend.kv.tiers import open_store

    store = open_store(mooncake_master.url, "nx-test", segment_bytes=16 << 20, buffer_bytes=1 << 20)
    mooncake_master.stores.append(store)
    assert store.wait_connected(30)
    k, v = torch.ones(4, 1, 2), torch.zeros(4, 1, 2)
    store.bind({("full", 0): ([4, 1, 2], [4, 1, 2]), ("swa", 1): ([8, 1, 2], [8, 1, 2])}, torch.float32)
    store.put(PageData(7, full={0: (k, v)}, swa={1: (k, v)}, has_window=True))
    store.flush()
    store.put(PageData(7, full={0: (k, v)}, has_window=False))  # the same prefix again, as a path only
    store.flush()
    page, missing = store.get_many([7, 99])
    assert page is not None and page.has_window and torch.equal(page.swa[1][0], k) and missing is None
    store.put(PageData(8, full={0: (k, v)}, has_window=False))
    store.flush()
    store.put(PageData(8, full={0: (k, v)}, swa={1: (k, v)}, has_window=True))  # a window upgrades a path page
    store.flush()
    assert store.get_many([8])[0].has_window
    assert store.stats.errors == 0 and store.stats.misses == 1


def test_corrupted_pages_are_refused_and_recomputed(model, cold, mooncake_master):  # noqa: F811
    prompts = workload()
    a = worker(model, mooncake_master)
    assert generate(a, prompts) == cold
    store = a.tiers.store
    store.flush()
    P = a.config.page_size
    hashes = sorted({h for p in prompts for h in block_hashes(p[: len(p) - len(p) % P], P)})
    keys = [store.key(h) for h in hashes]
    present = [k for k, e in zip(keys, store.client.batch_is_exist(keys)) if e == 1]
    assert present
    for i, key in enumerate(present):
        v = bytearray(store.client.get(key))
        if i % 3 == 0:
            v[-1] ^= 0xFF  # payload flipped: checksum mismatch
        elif i % 3 == 1:
            v = v[: len(v) // 2]  # truncated
        else:
            v[:4] = b"XXXX"  # not a page
        assert store.client.upsert(key, bytes(v)) == 0
    b = worker(model, mooncake_master)
    assert generate(b, prompts) == cold  # every corrupt page is a miss: recomputed
    s = b.stats()
    assert s["kv_store_corrupt"] > 0 and s["kv_store_errors"] == 0


def wait_up(store, timeout_s=60.0) -> None:
    """Until a page written through `store` reads back (the client re-registered with a restarted master)."""
    deadline = time.monotonic() + timeout_s
    probe = 1 << 62
    while time.monotonic() < deadline:
        if store.up:
            store.put(PageData(probe, full={}, has_window=False))
            store.flush()
            if store.client.batch_is_exist([store.key(probe)]) == [1]:
                return
            probe += 1
        time.sleep(0.2)
    raise AssertionError("the store did not come back after the master restarted")


def test_master_killed_and_restarted_mid_run_costs_hits_only(model, cold, mooncake_master):  # noqa: F811
    first, second = workload(seed=0), workload(seed=1)
    a, b = worker(model, mooncake_master), worker(model, mooncake_master)
    assert generate(a, first) == cold
    a.tiers.store.flush()
    assert generate(b, first) == cold and b.stats()["kv_store_hits"] > 0
    hits_before = b.stats()["kv_store_hits"]
    mooncake_master.stop()  # SIGKILL: every key's metadata is gone with it
    cold2 = generate(LLM(model, prefix_cache=False, **OPTS), second)
    assert generate(a, second) == cold2  # requests keep succeeding on a dead store
    assert generate(b, second[:4]) == cold2[:4]
    assert b.stats()["kv_store_errors"] >= 1
    # Down is a state with a retry clock (kv_store_retry_s): probe now rather than rely on the last failure being
    # recent (a slow machine can spend longer than the retry period between it and this line).
    assert b.tiers.store.get_many([1]) == [None] and b.stats()["kv_store_up"] == 0
    mooncake_master.start()  # same ports, empty
    wait_up(a.tiers.store)
    wait_up(b.tiers.store)
    third = workload(seed=2)
    cold3 = generate(LLM(model, prefix_cache=False, **OPTS), third)
    assert generate(a, third) == cold3
    a.tiers.store.flush()
    assert generate(b, third) == cold3
    s = b.stats()
    assert s["kv_store_hits"] > hits_before, "hits did not come back after the restart"
    assert s["kv_store_up"] == 1 and s["kv_store_corrupt"] == 0


def test_a_master_that_is_down_at_start_never_stops_the_worker(model, cold):  # noqa: F811
    """Mooncake's setup against a dead master retries for 90 s holding the GIL (every thread stops); the store only
    calls it once the master's port answers, so a worker started before its master serves at once, from recompute."""
    from mimo_epd.testing.redis_server import free_port

    if master_binary() is None:
        pytest.skip("the mooncake-transfer-engine-non-cuda wheel is not installed")
    t0 = time.monotonic()
    llm = LLM(model, kv_store=f"mooncake://127.0.0.1:{free_port()}", **OPTS, **STORE)
    time.sleep(1.0)  # the writer thread tries to connect meanwhile
    assert generate(llm, workload()) == cold
    assert time.monotonic() - t0 < 30 and llm.stats()["kv_store_up"] == 0
    llm.tiers.store.close()


@pytest.mark.parametrize(
    "url, says",
    [
        ("mooncake://", "expected mooncake://"),
        ("mooncake://m:50051?bogus=1", "unknown option"),
        ("mooncake://m?replicas=0", "replicas"),
        ("memcached://m:11211", "redis://, rediss://, unix:// or mooncake://"),
    ],
)
def test_a_bad_store_url_is_refused_naming_it(url, says):
    from llm_backend.config import LLMConfig

    with pytest.raises(ValueError, match=says):
        LLMConfig(kv_store=url).validate()


def test_url_defaults_follow_the_master():
    from llm_backend.kv.tiers.mooncake_store import parse_url

    c = parse_url("mooncake://127.0.0.1")
    assert c["master"] == "127.0.0.1:50051" and c["metadata"] == "http://127.0.0.1:8080/metadata"
    assert c["protocol"] == "tcp" and c["local"] == "127.0.0.1" and c["replicas"] == 1
