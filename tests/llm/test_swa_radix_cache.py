"""The SWA-aware radix cache: the cases of docs/caches.md, the known failure modes of peer systems, and a
property-based test of the pool accounting invariant with a no-pseudo-hit check.

Every slot handed out is tagged with the token prefix whose KV it would hold; a match must return
slots whose tags equal the query's prefixes (a wrong slot = a pseudo-hit = wrong attention)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_backend.kv import RequestKV, SlotPool, SWARadixCache

W = 8


class Harness:
    """Pools + cache + slot tags + the requests in flight."""

    def __init__(self, full=400, swa=120, window=W, page=1):
        self.full_pool, self.swa_pool = SlotPool("full", full, page), SlotPool("swa", swa)
        self.cache = SWARadixCache(self.full_pool, self.swa_pool, window, page)
        self.tag_full: dict[int, tuple] = {}
        self.tag_swa: dict[int, tuple] = {}
        self.running: list[RequestKV] = []

    def start(self, tokens):
        r = RequestKV(self.cache, tokens, release_interval=4)
        self.check_match(tokens, r)
        self.running.append(r)
        return r

    def compute(self, r: RequestKV, new_tokens):
        full, swa = r.extend(list(new_tokens))
        for k, (f, s) in enumerate(zip(full, swa)):
            prefix = tuple(r.tokens[: len(r.tokens) - len(new_tokens) + k + 1])
            self.tag_full[f] = prefix
            self.tag_swa[s] = prefix

    def check_match(self, tokens, r: RequestKV):
        n = r.cached_tokens
        for p in range(n):
            assert self.tag_full[r.full[p]] == tuple(tokens[: p + 1]), "pseudo-hit in the full pool"
        for p in range(max(0, n - self.cache.window), n):
            assert r.swa[p] is not None, "window-unsafe match"
            assert self.tag_swa[r.swa[p]] == tuple(tokens[: p + 1]), "pseudo-hit in the SWA pool"

    def finish(self, r: RequestKV, cache_result=True):
        r.finish(cache_result)
        self.running.remove(r)

    def check_accounting(self):
        acc = self.cache.accounting()
        inflight_full = sum(r.own_full_slots() for r in self.running)
        inflight_swa = sum(r.own_swa_live() for r in self.running)
        for name, pool, inflight in (("full", self.full_pool, inflight_full), ("swa", self.swa_pool, inflight_swa)):
            held = getattr(acc, name)
            total = pool.available() + held.evictable + held.protected + inflight
            assert total == pool.size, (name, pool.available(), held, inflight)


def toks(n, seed=0, vocab=50):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_case1_evicted_last_window_cuts_the_match_back():
    h = Harness()
    a, b = toks(30), toks(10, seed=99)
    r = h.start(a)
    h.compute(r, a)
    h.finish(r)
    # Everything before the last W tokens was released at finish; the last W are live: a full hit.
    assert h.cache.match_prefix(a).length == 30
    r = h.start(a + b)
    assert r.cached_tokens == 30
    h.compute(r, b)
    h.finish(r)
    assert h.cache.evict_swa(1) == W  # LRU: the node of `a` (internal now) loses its SWA: a tombstone
    m = h.cache.match_prefix(a)
    assert m.raw_length == 30 and m.length == 0  # its last W tokens have no SWA: nothing window-safe
    assert h.cache.match_prefix(a + b).length == 40  # the deeper node still holds the window it needs
    h.check_accounting()


def test_case2_shared_system_prompt_while_running_and_after():
    h = Harness()
    system = toks(24, seed=1)
    first = h.start(system + toks(5, seed=2))
    h.compute(first, system + toks(5, seed=2))
    first.checkpoint()  # chunked prefill puts what it computed into the tree while it keeps running
    second = h.start(system + toks(6, seed=3))
    assert second.cached_tokens == 24
    h.compute(second, toks(6, seed=3))
    h.check_accounting()
    h.finish(first)
    third = h.start(system + toks(7, seed=4))
    assert third.cached_tokens == 24
    for r in list(h.running):
        h.finish(r)
    h.check_accounting()


def test_case3_prefix_shorter_than_window_with_live_slots_hits():
    h = Harness()
    a = toks(W - 3, seed=5)
    r = h.start(a)
    h.compute(r, a)
    h.finish(r)
    assert h.cache.match_prefix(a + [1, 2]).length == W - 3


def test_case4_locked_nodes_survive_eviction_then_become_evictable():
    h = Harness()
    a = toks(20, seed=6)
    r = h.start(a)
    h.compute(r, a)
    h.finish(r)
    holder = h.start(a + [7])  # locks the prefix (full: whole path, SWA: last W)
    assert holder.cached_tokens == 20
    h.cache.evict_full(10**6)
    h.cache.evict_swa(10**6)
    assert h.cache.match_prefix(a).length == 20
    h.finish(holder, cache_result=False)
    h.cache.evict_full(10**6)
    assert h.cache.match_prefix(a).length == 0 and h.cache.token_count() == 0
    h.check_accounting()


def test_case5_swa_eviction_of_internal_node_keeps_children_reachable():
    h = Harness()
    base = toks(12, seed=7)
    x, y = base + toks(10, seed=8), base + toks(10, seed=9)
    for seq in (x, y):
        r = h.start(seq)
        h.compute(r, seq[r.cached_tokens :])
        h.finish(r)
    internal = h.cache.root.children[(base[0],)]  # children are keyed by their first page (page size 1)
    assert len(internal.key) == 12 and len(internal.children) == 2
    # Tombstone the shared internal node only (the leaves hold each sequence's last window).
    h.cache.swa_pool.free([s for s in internal.swa if s is not None])
    internal.swa = [None] * len(internal.swa)
    for seq in (x, y):
        m = h.cache.match_prefix(seq)
        assert m.length == 22  # the leaf covers the last W=8 tokens: still window-safe
        r = h.start(seq)
        h.finish(r, cache_result=False)
    assert h.cache.match_prefix(base).length == 0  # ending inside the tombstone is not window-safe


def test_case6_long_decode_keeps_swa_bounded():
    h = Harness(full=2000, swa=200)
    prompt = toks(20, seed=10)
    r = h.start(prompt)
    h.compute(r, prompt)
    r.release_out_of_window()
    peak = 0
    for i in range(10 * W):
        h.compute(r, [i % 50])
        r.step()
        r.window_slots()  # every in-window token still has its SWA slot
        peak = max(peak, r.own_swa_live())
    assert peak <= W + r.release_interval + 1
    h.finish(r)
    h.check_accounting()


def test_repair_of_tombstoned_node_serves_the_fresh_slots():
    h = Harness()
    a, b = toks(20, seed=11), toks(10, seed=12)
    for seq in (a, a + b):
        r = h.start(seq)
        h.compute(r, seq[r.cached_tokens :])
        h.finish(r)
    h.cache.evict_swa(1)  # tombstones the internal node of `a`
    assert h.cache.match_prefix(a).length == 0
    r2 = h.start(a)  # recomputes everything
    h.compute(r2, a)
    h.finish(r2)
    assert h.cache.stats.repairs > 0
    again = h.start(a + [3])
    assert again.cached_tokens == 20  # repaired, and check_match verified the slot tags (no stale mapping)
    h.finish(again)
    h.check_accounting()


def test_lock_underflow_is_an_error_not_silent():
    h = Harness()
    a = toks(10, seed=12)
    r = h.start(a)
    h.compute(r, a)
    h.finish(r)
    with pytest.raises(RuntimeError, match="underflow"):
        h.cache.unlock(h.cache.match_prefix(a).node)


def test_double_free_is_caught():
    p = SlotPool("full", 4)
    s = p.alloc(2)
    p.free(s)
    with pytest.raises(RuntimeError, match="freed twice"):
        p.free(s)


def test_page_size_rounds_matches_down():
    h = Harness(page=4)
    a = toks(14, seed=13)
    r = h.start(a)
    h.compute(r, a)
    h.finish(r)
    assert h.cache.match_prefix(a).length == 12


class _AsMatch:
    """A running request's whole sequence seen as a match (to check its slots after a checkpoint)."""

    def __init__(self, r: RequestKV):
        self.full, self.cached_tokens = r.full, len(r.tokens)
        self.swa = r.swa


OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "compute", "decode", "finish", "abort", "evict_swa", "evict_full"]),
        st.integers(0, 10**6),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.sampled_from([1, 2, 4]), st.sampled_from([0, 12]))
def test_property_accounting_invariant_and_no_pseudo_hits(ops, page, checkpoint):
    """free + evictable + protected + in-flight == total for both pools after every operation, and every
    match returns slots holding exactly the query's prefixes — under a tiny SWA pool and heavy eviction,
    for page sizes 1, 2 and 4, with denser SWA checkpoints off and on."""
    h = Harness(full=300, swa=60, page=page)
    h.cache.swa_checkpoint_interval = checkpoint
    prefixes = [toks(10, seed=s, vocab=6) for s in range(3)]  # few, short vocab: lots of sharing
    for op, x in ops:
        rng = random.Random(x)
        try:
            if op == "start" and len(h.running) < 4:
                seq = prefixes[x % 3][: rng.randrange(1, 11)] + toks(rng.randrange(0, 12), seed=x, vocab=6)
                r = h.start(seq)
                if len(seq) > r.cached_tokens:
                    h.compute(r, seq[r.cached_tokens :])
                r.release_out_of_window()
            elif op == "compute" and h.running:
                r = h.running[x % len(h.running)]
                h.compute(r, toks(rng.randrange(1, 6), seed=x, vocab=6))
                r.release_out_of_window()
                if x % 3 == 0:
                    r.checkpoint()
                    h.check_match(r.tokens, _AsMatch(r))
            elif op == "decode" and h.running:
                r = h.running[x % len(h.running)]
                for i in range(rng.randrange(1, 10)):
                    h.compute(r, [i % 6])
                    r.step()
            elif op in ("finish", "abort") and h.running:
                h.finish(h.running[x % len(h.running)], cache_result=(op == "finish"))
            elif op == "evict_swa":
                h.cache.evict_swa(x % 40)
            elif op == "evict_full":
                h.cache.evict_full(x % 80)
        except Exception as e:  # only pool exhaustion may interrupt an operation
            from llm_backend.kv import PoolExhausted

            assert isinstance(e, PoolExhausted), e
            h.cache.evict_swa(10**6)
            h.cache.evict_full(10**6)
        h.check_accounting()
    for r in list(h.running):
        h.finish(r)
    h.check_accounting()


def test_no_stale_swa_mapping_after_the_tree_evicts_unlocked_prefix_slots():
    """A running request must not keep (and later "repair" the tree with) SWA slots of its matched prefix
    that lie outside its locked window: the tree may evict them and the pool hand them to another request."""
    h = Harness(full=400, swa=60)
    a = toks(30, seed=21)
    r = h.start(a)
    h.compute(r, a)
    r.checkpoint()  # the tree owns all 30 tokens with live SWA
    h.finish(r)
    holder = h.start(a + [1])  # matches 30; locks SWA only over the last W
    assert holder.cached_tokens == 30
    assert all(s is None for s in holder.swa[: 30 - W])
    h.cache.evict_swa(10**6)  # frees every unlocked SWA slot of the prefix
    other = h.start(toks(25, seed=22))
    h.compute(other, other.tokens[other.cached_tokens :] or toks(25, seed=22))  # reuses the freed slots
    h.compute(holder, [2, 3])
    h.finish(holder)  # must not hand the tree slots that `other` now owns
    h.finish(other)
    h.check_accounting()
    h.cache.evict_swa(10**6)
    h.cache.evict_full(10**6)
    h.check_accounting()


def test_swa_eviction_trims_to_node_ends_first_even_under_a_lock():
    """Pass 1 of SWA eviction keeps the last W tokens of every node: a checkpointed chunk locked by its running
    request loses the SWA it no longer needs, the request's window and the cached prompt's end stay hittable."""
    h = Harness(full=400, swa=120)
    a = toks(40, seed=31)
    r = h.start(a)
    h.compute(r, a)
    r.checkpoint()  # the chunk goes into the tree with all 40 SWA slots live; r locks it
    assert h.cache.accounting().swa.protected == 40
    freed = h.cache.evict_swa(1)
    assert freed == 40 - W  # trimmed to its last W, though locked; nothing tombstoned
    h.check_accounting()
    h.compute(r, [5, 6])  # the running request continues over its intact window
    h.finish(r)
    again = h.start(a + [9])
    assert again.cached_tokens == 40  # the prompt's end is still window-safe
    h.finish(again)
    h.check_accounting()


@pytest.mark.parametrize("k,resumes_at", [(0, 0), (16, 16)])
def test_denser_checkpoint_keeps_the_window_before_a_nodes_last_multiple_of_k(k, resumes_at):
    """A next turn that re-sends a cached prompt but diverges before its end (token 20 of 30): trimming keeps the
    window before the node's last multiple of K (16), so the match resumes there; without checkpoints only the node
    end's window is left and the match falls back to the node start."""
    h = Harness(full=400, swa=120)
    h.cache.swa_checkpoint_interval = k
    a = toks(30, seed=41)
    r = h.start(a)
    h.compute(r, a)
    r.checkpoint()  # a prompt chunk: the tree gets all 30 tokens with live SWA
    h.finish(r)
    h.cache.evict_swa(1)  # pass 1 trims the node
    node = h.cache.root.children[(a[0],)]
    live = {j for j, s in enumerate(node.swa) if s is not None}
    assert live == set(range(30 - W, 30)) | (set(range(16 - W, 16)) if k else set())
    assert h.cache.window_ends(node) == ([30, 16] if k else [30])
    h.check_accounting()
    nxt = h.start(a[:20] + toks(6, seed=42))  # start() checks the hit's slots hold exactly this prefix's KV
    assert nxt.cached_tokens == resumes_at
    h.finish(nxt)
    h.check_accounting()


@pytest.mark.parametrize("k,page", [(8, 1), (10, 4), (-16, 1)])
def test_checkpoint_interval_must_be_a_page_multiple_above_the_window(k, page):
    h = Harness(page=page)
    with pytest.raises(ValueError, match="multiple of the page size"):
        h.cache.swa_checkpoint_interval = k


def test_split_of_a_locked_node_leaves_no_swa_lock_behind():
    """A request's checkpointed chunk is split by a second request matching part of it: after both finish no
    node keeps an SWA lock (a copied count would stay on the head forever and block its eviction)."""
    h = Harness(full=400, swa=120)
    a = toks(20, seed=41)
    r1 = h.start(a)
    h.compute(r1, a)
    r1.checkpoint()  # the 20 tokens are one tree node, SWA-locked by r1 over its last W
    r2 = h.start(a[:6] + [1, 2])  # matches 6: the node splits into 6 + 14, the lock stays on the 14-token tail
    assert r2.cached_tokens == 6
    locks = {len(n.key): n.swa_locks for n in h.cache._nodes()}
    assert locks == {6: 1, 14: 1}  # head: r2's lock only; tail: r1's (its 14 tokens cover r1's window of W)
    h.finish(r2)
    h.finish(r1)
    assert all(n.swa_locks == 0 and n.full_locks == 0 for n in h.cache._nodes())
    h.cache.evict_swa(10**6)
    h.cache.evict_full(10**6)
    assert h.cache.token_count() == 0  # nothing pinned: everything could be evicted
    h.check_accounting()


# --------------------------------------------------------------------------- LRU order, tombstones, statistics
def _insert_fresh(h: Harness, tokens, live_from: int = 0):
    """Inserts `tokens` with fresh slots (SWA live from `live_from` on) straight into the tree."""
    full = h.full_pool.alloc(len(tokens))
    swa = [None] * live_from + h.swa_pool.alloc(len(tokens) - live_from)
    return h.cache.insert(list(tokens), full, swa)


def test_split_orders_the_head_before_its_tail_in_swa_eviction():
    """A split leaves head and tail with the same stamp; the parent must still be evicted first, or SWA eviction
    tombstones the leaf and removes it (with its full KV) while its equally old parent keeps its SWA."""
    h = Harness()
    a = list(range(100, 120))
    _insert_fresh(h, a, live_from=12)  # one 20-token leaf, SWA live over its last W = 8
    m = h.cache.match_prefix(a[:15] + [1])  # the walk splits it 15 + 5; the window-safe cut is 0: no refresh
    assert m.raw_length == 15 and m.length == 0
    head = h.cache.root.children[(100,)]
    assert len(head.key) == 15 and head.last_access == next(iter(head.children.values())).last_access
    h.cache.evict_swa(1)
    assert head.tombstone and h.cache.token_count() == 20  # the parent went first; the leaf keeps its full KV
    assert h.cache.stats.full_evicted == 0
    h.check_accounting()


def test_insert_refreshes_the_stamps_of_the_path_it_walks():
    h = Harness()
    a, b = list(range(100, 120)), list(range(200, 220))
    _insert_fresh(h, a, live_from=12)
    _insert_fresh(h, b, live_from=12)
    assert _insert_fresh(h, a, live_from=12) == 20  # a again (recomputed): duplicates freed, the path is used
    h.cache.evict_full(1)  # the least recently used leaf goes: b
    h.cache.path_to(a)
    with pytest.raises(KeyError):
        h.cache.path_to(b)
    h.check_accounting()


def test_inserting_a_fully_released_sequence_leaves_no_tombstone_leaf():
    h = Harness()
    a = list(range(100, 120))
    _insert_fresh(h, a[:10], live_from=2)
    before = h.full_pool.available()
    assert _insert_fresh(h, a, live_from=20) == 10  # the new 10 tokens come with no SWA at all
    assert h.cache.token_count() == 10  # no leaf that no window-safe match could end in
    assert h.full_pool.available() == before  # its full slots were freed, not leaked
    assert all(not n.tombstone for n in h.cache._nodes())
    h.check_accounting()


def test_full_eviction_counts_cascaded_tombstone_removals_once():
    h = Harness()
    base, x = list(range(100, 112)), list(range(200, 210))
    _insert_fresh(h, base, live_from=4)
    _insert_fresh(h, base + x, live_from=12)  # base becomes the parent of a 10-token leaf
    parent = h.cache.root.children[(100,)]
    h.cache.swa_pool.free([s for s in parent.swa if s is not None])
    parent.swa = [None] * len(parent.swa)  # an internal tombstone: removed as soon as it becomes a leaf
    before = h.full_pool.available()
    freed = h.cache.evict_full(1)
    assert freed == 22 == h.full_pool.available() - before  # the leaf, then its tombstone parent
    assert h.cache.stats.full_evicted == 22 and h.cache.token_count() == 0
    h.check_accounting()


def _tree_state(cache: SWARadixCache):
    return sorted(
        (tuple(n.key), tuple(n.full), tuple(n.swa), n.last_access, n.full_locks, n.swa_locks) for n in cache._nodes()
    )


@pytest.mark.parametrize("page", [1, 2, 4])
def test_peek_prefix_length_is_read_only_and_equals_match_prefix(page):
    h = Harness(page=page)
    rng = random.Random(page)
    prefixes = [toks(16, seed=s, vocab=5) for s in range(3)]
    for k in range(12):  # a tree with splits, trimmed and tombstoned nodes
        seq = prefixes[k % 3][: rng.randrange(4, 17)] + toks(rng.randrange(0, 10), seed=100 + k, vocab=5)
        r = h.start(seq)
        if len(seq) > r.cached_tokens:
            h.compute(r, seq[r.cached_tokens :])
        h.finish(r)
        if k % 4 == 3:
            h.cache.evict_swa(15)
    queries = [
        prefixes[q % 3][: rng.randrange(0, 17)] + toks(rng.randrange(0, 8), seed=500 + q, vocab=5) for q in range(60)
    ]
    nonzero = 0
    for q in queries:
        before, stats_before = _tree_state(h.cache), (h.cache.stats.lookups, h.cache.stats.hit_tokens)
        peeked = h.cache.peek_prefix_length(q)
        assert _tree_state(h.cache) == before  # no split, no stamp, no lock
        assert (h.cache.stats.lookups, h.cache.stats.hit_tokens) == stats_before
        assert peeked == h.cache.match_prefix(q).length
        nonzero += peeked > 0
    assert nonzero > 5  # the comparison covered real hits, not only misses
    h.check_accounting()


@pytest.mark.parametrize("page", [1, 2])
def test_a_match_that_splits_a_node_stops_there_and_never_continues_into_the_tails_children(page):
    """Regression: the read-only walk decided whether a node matched whole *after* its caller had split it, so a
    match ending inside a node whose tail was shorter than the matched part went on into the tail's children at the
    wrong offset (a pseudo-hit the engine's no-pseudo-hit test caught)."""
    full, swa = SlotPool("full", 64, page), SlotPool("swa", 64)
    cache = SWARadixCache(full, swa, window=64, page_size=page)

    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = a + [9, 10]
    slots_a = [s for p in full.alloc_pages(len(a) // page) for s in full.page_slots(p)]
    cache.insert(a, slots_a, swa.alloc(len(a)))
    slots_b = slots_a + [s for p in full.alloc_pages(2 // page) for s in full.page_slots(p)]
    cache.insert(b, slots_b, [None] * len(a) + swa.alloc(2))
    probe = [1, 2, 3, 4, 5, 6, 9, 10]  # diverges after 6 tokens; [9, 10] is a child of the tail [7, 8]
    assert cache.peek_prefix_length(probe) == 6
    m = cache.match_prefix(probe)  # splits [1..8] into [1..6] + [7, 8]
    assert m.raw_length == 6 and m.length == 6
    assert cache.match_prefix(probe).raw_length == 6  # and again on the split tree
    assert cache.match_prefix(b).raw_length == len(b)
