"""KV tiers: greedy outputs are the same with the host tier and the shared Redis tier on as with no
cache at all, under heavy eviction of both device pools (hits that end in the host tier and in the store, a page
another worker wrote), corrupt store values are misses, a dead Redis is skipped, and the slot accounting of every
tier holds after any sequence of operations (hypothesis)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_backend import LLM, SamplingParams
from llm_backend.kv import RequestKV, SlotPool, SWARadixCache
from llm_backend.kv.tiers import MemoryKVStore, TieredRadixCache
from tests.llm.test_engine import small_model
from tests.router.conftest import redis_server  # noqa: F401 - the real redis-server fixture

SP = SamplingParams(max_tokens=5)
# Tiny model, many short steps: one intra-op thread avoids thread thrash on a shared machine (the outputs are the
# same with any thread count).
torch.set_num_threads(1)


def workload(seed=0, n=16, systems=4):
    rng = random.Random(seed)
    sys_prompts = [[rng.randrange(61) for _ in range(40)] for _ in range(systems)]
    return [sys_prompts[i % systems] + [rng.randrange(61) for _ in range(rng.randrange(3, 20))] for i in range(n)]


# Pools that hold two short requests: heavy eviction of both pools (also the TP tests' tier workload).
TINY_POOLS = dict(
    kv_cache_tokens=160, swa_cache_tokens=200, page_size=4, chunk_size=16, release_interval=4, max_running=2
)


def run(model, prompts, **kw):
    """Two requests at a time through tiny pools: heavy eviction of both pools."""
    opts = {**TINY_POOLS, **kw}
    llm = LLM(model, **opts)
    outs = []
    for i in range(0, len(prompts), 2):
        outs += [o.output_token_ids for o in llm.generate(prompt_token_ids=prompts[i : i + 2], sampling_params=SP)]
    return outs, llm


@pytest.fixture(scope="module")
def model():
    return small_model(8, 1)


@pytest.fixture(scope="module")
def cold(model):
    return run(model, workload(), prefix_cache=False)[0]


@pytest.mark.parametrize(
    "opts",
    [
        dict(host_kv_bytes=10**6),
        dict(host_kv_bytes=60_000),
        dict(host_kv_bytes=10**6, host_kv_write="through", host_kv_policy="fifo"),
        dict(host_kv_bytes=10**6, swa_backfill=True, swa_checkpoint_interval=16),
    ],
)
def test_host_tier_outputs_equal_no_cache_under_heavy_eviction(model, cold, opts):
    outs, llm = run(model, workload(), **opts)
    assert outs == cold
    st_ = llm.stats()
    assert st_["kv_tier_hit_host"] > 0 and st_["kv_tier_pages_d2h"] > 0  # hits that ended in the host tier
    assert st_["kv_load_loads"] > 0  # loaded layer by layer in the forward
    base = run(model, workload())[1].stats()["prefix_hit_tokens"]
    assert st_["prefix_hit_tokens"] > base  # the tier adds hits
    acc = llm.tiers.host_accounting()
    for k in ("host_full_pages", "host_swa"):
        assert getattr(acc, k).held + getattr(acc, k).free == getattr(acc, k).total


def test_tiers_off_is_the_plain_cache(model):
    llm = LLM(model, kv_cache_tokens=160, swa_cache_tokens=200, page_size=4, chunk_size=16)
    assert llm.tiers is None and type(llm.cache) is SWARadixCache and llm.runner.kv_loader is None
    assert not any(k.startswith("kv_tier") for k in llm.stats())


def test_layerwise_load_waits_per_layer(model):
    """Each layer's attention waits for that layer's copy only: attend(l) is called after copy l is done."""
    import torch

    from llm_backend.kv.tiers.host import HostKV
    from llm_backend.kv.tiers.loader import LayerwiseLoad, LoadPlan, LoadStats, PendingLoads
    from llm_backend.paged_attention import KVPools

    pools = KVPools(model.config, 32, 32)
    host = HostKV(pools, 32, 32)
    for layer in host.k:
        host.k[layer].normal_()
        host.v[layer].normal_()
    pending = PendingLoads()
    pending.add_host(False, [0, 1, 2, 3], [8, 9, 10, 11])
    pending.add_host(True, [5], [7])
    stats = LoadStats()
    load = LayerwiseLoad(LoadPlan(pending, pools, host), stats)
    for layer in pools.k:
        load.wait(layer)
        src, dst = ([5], [7]) if pools.sliding[layer] else ([0, 1, 2, 3], [8, 9, 10, 11])
        assert torch.equal(pools.k[layer][dst], host.k[layer][src])
        assert torch.equal(pools.v[layer][dst], host.v[layer][src])
    load.finish()
    assert stats.loads == 1 and stats.copy_s > 0 and stats.exposed_s <= stats.copy_s + 1.0


# ----------------------------------------------------------------------------------------------- shared store
def store_run(model, url, prompts, **kw):
    return run(model, prompts, kv_store=url, **kw)


@pytest.mark.parametrize("write", ["evict", "insert"])
def test_store_page_written_by_one_worker_is_loaded_by_another(model, cold, redis_server, write):  # noqa: F811
    prompts = workload()
    outs_a, a = store_run(model, redis_server.url, prompts, kv_store_write=write)
    assert outs_a == cold
    if write == "evict":
        a.cache.evict_full(10**9)  # everything leaves worker A: its pages go to Redis
    # insert: A keeps its tree; its pages went to Redis as they entered it
    a.tiers.store.flush()
    assert a.tiers.store.stats.puts > 0
    outs_b, b = store_run(model, redis_server.url, prompts, kv_store_write=write)  # a fresh worker: empty tree
    assert outs_b == cold
    s = b.stats()
    assert s["kv_tier_hit_store"] > 0 and s["kv_tier_pages_s2d"] > 0 and s["kv_store_hits"] > 0
    assert s["kv_store_corrupt"] == 0


def test_a_page_without_its_window_never_replaces_one_with_it(redis_server):  # noqa: F811
    from llm_backend.kv.tiers import RedisKVStore
    from llm_backend.kv.tiers.store import PageData

    store = RedisKVStore(redis_server.url, "nx-test")
    k, v = torch.ones(4, 1, 2), torch.zeros(4, 1, 2)
    store.expect, store.dtype = {("full", 0): ([4, 1, 2], [4, 1, 2]), ("swa", 1): ([8, 1, 2], [8, 1, 2])}, torch.float32
    store.put(PageData(7, full={0: (k, v)}, swa={1: (k, v)}, has_window=True))
    store.flush()
    store.put(PageData(7, full={0: (k, v)}, has_window=False))  # the same prefix again, as a path only
    store.flush()
    (page,) = store.get_many([7])
    assert page is not None and page.has_window and torch.equal(page.swa[1][0], k)
    store.put(PageData(8, full={0: (k, v)}, has_window=False))
    store.flush()
    store.put(PageData(8, full={0: (k, v)}, swa={1: (k, v)}, has_window=True))  # a window upgrades a path page
    store.flush()
    assert store.get_many([8])[0].has_window
    store.close()


def test_store_with_host_tier_outputs_equal(model, cold, redis_server):  # noqa: F811
    outs, llm = store_run(model, redis_server.url, workload(), host_kv_bytes=30_000)
    assert outs == cold
    llm.tiers.store.flush()
    outs2, llm2 = store_run(model, redis_server.url, workload(), host_kv_bytes=30_000)
    assert outs2 == cold and llm2.stats()["kv_tier_hit_store"] > 0


def test_corrupted_store_values_are_misses(model, cold, redis_server):  # noqa: F811
    import redis

    _, a = store_run(model, redis_server.url, workload())
    a.cache.evict_full(10**9)
    a.tiers.store.flush()
    r = redis.Redis.from_url(redis_server.url)
    keys = r.keys(b"mimo:kv:*")
    assert keys
    for i, k in enumerate(keys):
        v = bytearray(r.get(k))
        if i % 3 == 0:
            v[-1] ^= 0xFF  # payload flipped: checksum mismatch
        elif i % 3 == 1:
            v = v[: len(v) // 2]  # truncated
        else:
            v[:4] = b"XXXX"  # not a page
        r.set(k, bytes(v))
    fresh = LLM(model, kv_cache_tokens=160, swa_cache_tokens=200, page_size=4, chunk_size=16, kv_store=redis_server.url)
    hashes = [int(k.rsplit(b":", 1)[1], 16) for k in keys]
    assert fresh.tiers.store.get_many(hashes) == [None] * len(keys)
    assert fresh.tiers.store.stats.corrupt == len(keys)
    # A run over the corrupted store: the corrupt pages are misses (later hits come from pages it writes itself).
    outs, b = store_run(model, redis_server.url, workload())
    assert outs == cold and b.stats()["kv_store_corrupt"] > 0


def test_redis_killed_mid_run_requests_never_fail(model, cold, redis_server):  # noqa: F811
    prompts = workload()
    llm = LLM(
        model,
        **TINY_POOLS,
        kv_store=redis_server.url,
        kv_store_timeout_s=0.2,
    )
    outs = []
    for i in range(0, len(prompts), 2):
        if i == 8:
            redis_server.stop()
        res = llm.generate(prompt_token_ids=prompts[i : i + 2], sampling_params=SP)
        assert all(o.finish_reason == "length" for o in res)
        outs += [o.output_token_ids for o in res]
    assert outs == cold
    s = llm.stats()
    assert s["kv_store_errors"] >= 1 and s["kv_store_up"] == 0


# ----------------------------------------------------------------------------------------------- accounting
W = 8
OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "compute", "finish", "evict_full", "evict_swa", "abort"]), st.integers(0, 10**6)
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    OPS,
    st.sampled_from([1, 2, 4]),
    st.booleans(),
    st.sampled_from([None, "evict", "insert"]),
    st.sampled_from([0, 12]),
    st.booleans(),
    st.sampled_from([(24, 16), (40, 30), (160, 60)]),
)
def test_property_accounting_across_tiers(ops, page, backfill, store_write, checkpoint, write_through, host):
    """Slot accounting of the device pools and the host tier after every operation, and the device-resident nodes
    a top of the tree, under every combination of the tiers' switches and host sizes (small hosts evict)."""
    full_pool, swa_pool = SlotPool("full", 240, page), SlotPool("swa", 100)
    store = MemoryKVStore(10**9) if store_write else None
    cache = tiers = TieredRadixCache(
        full_pool,
        swa_pool,
        W,
        page,
        host_full_tokens=host[0],
        host_swa_tokens=host[1],
        swa_backfill=backfill,
        write_through=write_through,
        store=store,
        store_write=store_write or "evict",
        token_bytes=(10, 10),
    )
    cache.swa_checkpoint_interval = checkpoint
    prefixes = [[random.Random(s).randrange(6) for _ in range(40)] for s in range(3)]
    running: list[tuple[RequestKV, list[int]]] = []
    for op, x in ops:
        rng = random.Random(x)
        if op == "start" and len(running) < 3:
            toks = prefixes[x % 3][: rng.randrange(4, 40)] + [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
            r = RequestKV(cache, toks, release_interval=4)
            assert r.cached_tokens <= len(toks) and r.cached_tokens % page == 0
            assert len(r.full) == r.cached_tokens and all(s is not None for s in r.full)
            running.append((r, toks))
        elif op == "compute" and running:
            r, toks = running[x % len(running)]
            n = min(len(toks) - len(r.tokens), 1 + x % 9)
            if n > 0 and cache.make_room(n + page, n):
                try:
                    r.extend(toks[len(r.tokens) : len(r.tokens) + n])
                    r.checkpoint()
                except Exception as e:  # PoolExhausted
                    assert "pool" in str(e)
        elif op in ("finish", "abort") and running:
            r, _ = running.pop(x % len(running))
            r.finish(cache_result=op == "finish")
        elif op == "evict_full":
            cache.evict_full(1 + x % 60)
        elif op == "evict_swa":
            cache.evict_swa(1 + x % 30)
        acc = cache.accounting()
        infl_full = sum(r.own_full_slots() for r, _ in running)
        infl_swa = sum(r.own_swa_live() for r, _ in running)
        assert full_pool.available() + acc.full.evictable + acc.full.protected + infl_full == full_pool.size
        assert swa_pool.available() + acc.swa.evictable + acc.swa.protected + infl_swa == swa_pool.size
        hacc = tiers.host_accounting()
        for k in ("host_full_pages", "host_swa"):
            use = getattr(hacc, k)
            assert use.held + use.free == use.total, (k, hacc)
        # the device-resident nodes are a top of the tree; host-only nodes have a full host copy
        for n in cache._nodes():
            if n.full is None:
                assert n.host is not None and n.host.pages is not None
                assert all(c.full is None for c in n.children.values())
                assert all(s is None for s in n.swa)
    for r, _ in running:
        r.finish()
    cache.evict_full(10**9)
    cache.evict_swa(10**9)


def _tree_with_checkpoint(checkpoint: int, store=None, host: bool = True):
    """A 32-token prompt cached through one prompt chunk (all SWA live in the tree), window 8, pages of 4."""
    cache = TieredRadixCache(
        SlotPool("full", 200, 4),
        SlotPool("swa", 100),
        W,
        4,
        host_full_tokens=160 if host else 0,
        host_swa_tokens=60,
        store=store,
        store_write="insert",
        token_bytes=(10, 10),
    )
    cache.swa_checkpoint_interval = checkpoint
    return cache, cache


PROMPT = [random.Random(7).randrange(50) for _ in range(32)]
NEXT = PROMPT[:24] + [51, 52, 53, 54]  # re-sends the prompt, diverges at token 24 (inside the cached node)


def _cache_prompt(cache):
    r = RequestKV(cache, PROMPT)
    r.extend(PROMPT)
    r.checkpoint()
    r.finish()


@pytest.mark.parametrize("checkpoint,resumes_at", [(0, 0), (16, 16)])
def test_host_write_back_keeps_the_checkpoint_window(checkpoint, resumes_at):
    """Device eviction writes the node back with the windows before each point a match may end (node end and,
    with checkpoints, its last multiple of K); the next turn then resumes in the host tier at the checkpoint."""
    cache, tiers = _tree_with_checkpoint(checkpoint)
    _cache_prompt(cache)
    cache.evict_swa(1)  # trim to the kept windows
    cache.evict_full(10**6)  # everything to the host
    node = cache.root.children[tuple(PROMPT[:4])]
    assert node.full is None
    assert set(node.host.swa) == set(range(24, 32)) | (set(range(8, 16)) if checkpoint else set())
    m = RequestKV(cache, NEXT)
    assert m.cached_tokens == resumes_at and tiers.tier_stats.hit_host == resumes_at
    m.finish(cache_result=False)


@pytest.mark.parametrize("checkpoint,resumes_at", [(0, 0), (16, 16)])
def test_store_page_at_a_checkpoint_carries_its_window(checkpoint, resumes_at):
    """Written on insert, the page ending at the node's checkpoint carries the window before it: another worker
    resumes there from the store."""
    store = MemoryKVStore(10**9)
    writer, _ = _tree_with_checkpoint(checkpoint, store)
    _cache_prompt(writer)
    store.flush()
    reader, tiers = _tree_with_checkpoint(checkpoint, store, host=False)
    m = RequestKV(reader, NEXT)
    assert m.cached_tokens == resumes_at and tiers.tier_stats.hit_store == resumes_at
    m.finish(cache_result=False)


@pytest.mark.parametrize("checkpoint,resumes_at", [(0, 0), (16, 36)])
def test_engine_resumes_at_the_checkpoint_with_the_same_greedy_output(model, checkpoint, resumes_at):
    """The next turn re-sends a 40-token prompt (one prefill chunk) but diverges at token 36. After SWA trimming
    the node keeps the window before its end ([32, 40)) and, with checkpoints every 16, before 32 ([24, 32)):
    together they cover the W = 8 tokens before 36, so the engine resumes there (without, at 0) and samples
    exactly what no cache samples."""
    rng = random.Random(3)
    prompt = [rng.randrange(61) for _ in range(40)]
    nxt = prompt[:36] + [rng.randrange(61) for _ in range(6)]
    opts = dict(page_size=4, chunk_size=64, swa_checkpoint_interval=checkpoint)
    want = LLM(model, prefix_cache=False, **opts).generate(prompt_token_ids=[nxt], sampling_params=SP)
    llm = LLM(model, **opts)
    llm.generate(prompt_token_ids=[prompt], sampling_params=SP)
    llm.cache.evict_swa(1)  # SWA pressure: the cached prompt is trimmed to its kept windows
    before = llm.stats()["prefix_hit_tokens"]
    got = llm.generate(prompt_token_ids=[nxt], sampling_params=SP)
    assert llm.stats()["prefix_hit_tokens"] - before == resumes_at
    assert got[0].output_token_ids == want[0].output_token_ids


def test_default_checkpoint_interval_fits_the_page_size_and_a_set_one_is_checked(model):
    """The default (512) is fitted to a page size it does not divide; a value the user set is never changed:
    one the cache cannot use is a startup error naming the flag."""
    assert LLM(model, page_size=4).cache.swa_checkpoint_interval == 512
    assert LLM(model, page_size=48).cache.swa_checkpoint_interval == 528
    assert LLM(model, page_size=4, swa_checkpoint_interval=0).cache.swa_checkpoint_interval == 0
    with pytest.raises(ValueError, match="--swa-checkpoint-interval: .* 100 must be"):
        LLM(model, page_size=48, swa_checkpoint_interval=100)


@pytest.mark.parametrize("checkpoint,resumes_at", [(0, 0), (16, 32)])
def test_another_worker_resumes_at_a_checkpoint_page_from_redis(model, redis_server, checkpoint, resumes_at):  # noqa: F811
    """Worker A caches a 40-token prompt (one prefill chunk) and writes its pages to Redis as they enter its tree;
    worker B, empty, gets the next turn diverging at token 36: the page ending at A's checkpoint (32) carries the
    window before it, so B loads 32 tokens from Redis (real tensors) and samples what no cache samples."""
    rng = random.Random(5)
    prompt = [rng.randrange(61) for _ in range(40)]
    nxt = prompt[:36] + [rng.randrange(61) for _ in range(6)]
    opts = dict(page_size=4, chunk_size=64, swa_checkpoint_interval=checkpoint)
    want = LLM(model, prefix_cache=False, **opts).generate(prompt_token_ids=[nxt], sampling_params=SP)
    a = LLM(model, kv_store=redis_server.url, kv_store_write="insert", **opts)
    a.generate(prompt_token_ids=[prompt], sampling_params=SP)
    a.tiers.store.flush()
    b = LLM(model, kv_store=redis_server.url, kv_store_write="insert", **opts)
    got = b.generate(prompt_token_ids=[nxt], sampling_params=SP)
    s = b.stats()
    assert s["kv_tier_hit_store"] == resumes_at and s["kv_store_corrupt"] == 0
    assert got[0].output_token_ids == want[0].output_token_ids


def _host_pressure_workload(seed: int) -> None:
    """Random requests over three shared prefixes through a small host tier (write-back or write-through):
    host eviction runs often, with many nodes of equal LRU stamps."""
    rng = random.Random(seed)
    page = rng.choice([1, 2, 4])
    cache = TieredRadixCache(
        SlotPool("full", 240, page),
        SlotPool("swa", 100),
        W,
        page,
        host_full_tokens=rng.choice([24, 40, 80]),
        host_swa_tokens=rng.choice([16, 30]),
        write_through=rng.random() < 0.5,
        swa_backfill=rng.random() < 0.5,
        token_bytes=(10, 10),
    )
    prefixes = [[random.Random(s).randrange(6) for _ in range(40)] for s in range(3)]
    running: list[tuple[RequestKV, list[int]]] = []
    for _ in range(80):
        op, x = rng.choice(["start", "compute", "finish", "evict_full", "evict_swa"]), rng.randrange(10**6)
        if op == "start" and len(running) < 3:
            toks = prefixes[x % 3][: rng.randrange(4, 40)] + [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
            running.append((RequestKV(cache, toks, release_interval=4), toks))
        elif op == "compute" and running:
            r, toks = running[x % len(running)]
            n = min(len(toks) - len(r.tokens), 1 + x % 9)
            if n > 0 and cache.make_room(n + page, n):
                r.extend(toks[len(r.tokens) : len(r.tokens) + n])
                r.checkpoint()
        elif op == "finish" and running:
            running.pop(x % len(running))[0].finish()
        elif op == "evict_full":
            cache.evict_full(1 + x % 60)
        elif op == "evict_swa":
            cache.evict_swa(1 + x % 30)


def test_host_eviction_under_pressure_never_fails():
    """Host eviction once numbered the parents it re-queued from the queue's length, which could repeat the rank of
    a queued node with the same LRU stamp: the queue then compared two nodes and raised TypeError (seeds 80 and 83
    of this workload did)."""
    for seed in range(120):
        _host_pressure_workload(seed)


def _stale_window(cache, tokens: list[int], upto: int) -> set[int]:
    """Positions of the window before `upto` whose SWA slots a request matching `tokens` is given marked stale."""
    m = RequestKV(cache, tokens)
    try:
        return {p for p in range(max(0, upto - W), upto) if m.swa[p] is not None and cache.swa_pool.is_stale(m.swa[p])}
    finally:
        m.finish(cache_result=False)


def _cache_prompt_marking(cache, stale: list[int]) -> None:
    """Caches PROMPT with the SWA slots of positions `stale` marked (MTP entries never computed)."""
    r = RequestKV(cache, PROMPT)
    r.extend(PROMPT)
    cache.swa_pool.mark_stale(r.swa[p] for p in stale)
    r.checkpoint()
    r.finish()


def test_stale_marks_survive_the_host_tier():
    """A slot's stale mark (engine/speculative.py: an MTP entry never computed) goes to the host with its KV and
    comes back with it, so a hit restored from the host is exactly as valid as before; freeing clears marks."""
    cache, tiers = _tree_with_checkpoint(0)
    _cache_prompt_marking(cache, [26, 29])
    assert cache.swa_pool.stale_count == 2
    cache.evict_full(10**6)  # everything to the host: the device slots are freed, their marks with them
    node = cache.root.children[tuple(PROMPT[:4])]
    assert node.full is None and cache.swa_pool.stale_count == 0
    assert sum(cache.host_swa.is_stale(s) for s in node.host.swa.values()) == 2
    again = PROMPT + [50]
    assert _stale_window(cache, again, 32) == {26, 29} and tiers.tier_stats.hit_host == 32


def test_stale_marks_survive_the_shared_store():
    store = MemoryKVStore(10**9)
    writer, _ = _tree_with_checkpoint(0, store)
    _cache_prompt_marking(writer, [24, 31])
    store.flush()
    reader, tiers = _tree_with_checkpoint(0, store, host=False)
    assert _stale_window(reader, PROMPT + [50], 32) == {24, 31} and tiers.tier_stats.hit_store == 32


def test_store_pages_keep_their_stale_rows_on_the_wire():
    from llm_backend.kv.tiers.store import PageData, decode_page, encode_page

    k = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)
    page = PageData(7, full={0: (k, k + 1)}, swa={1: (k, k)}, has_window=True, stale=[0, 2])
    expect = {("full", 0): ([3, 2, 4], [3, 2, 4]), ("swa", 1): ([3, 2, 4], [3, 2, 4])}
    back = decode_page(encode_page(page), 7, expect, torch.float32)
    assert back is not None and back.stale == [0, 2]


def test_freeing_a_slot_clears_its_mark():
    pool = SlotPool("swa", 8)
    slots = pool.alloc(4)
    assert pool.mark_stale(slots[:2]) == 2 and pool.mark_stale(slots[:1]) == 0 and pool.stale_count == 2
    pool.free(slots[:1])
    assert pool.stale_count == 1 and not pool.is_stale(slots[0]) and pool.is_stale(slots[1])
    again = pool.alloc(1)
    assert again == slots[:1] and not pool.is_stale(again[0])  # the next owner's slot is not stale
