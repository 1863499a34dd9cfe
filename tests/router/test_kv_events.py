"""KV events against the real SWA radix cache: after any sequence of requests and evictions, the publisher's
block states equal what the tree holds, the index built from its change log equals the mirror, and the
index's prediction equals the cache's own window-safe match at block granularity."""

from __future__ import annotations

import random

import pytest

from llm_backend.kv import RequestKV, SlotPool, SWARadixCache
from llm_backend.kv.events import ABSENT, STORED, USABLE, KVEventPublisher, block_hashes
from mimo_epd.router.index import MemoryIndex, predict_tokens


def tree_blocks(cache: SWARadixCache, B: int) -> dict[int, int]:
    """Every block the tree holds and whether a match may end on it, computed from scratch."""
    out = {}
    stack = [(c, [], []) for c in cache.root.children.values()]
    while stack:
        node, toks, swa = stack.pop()
        toks, swa = toks + node.key, swa + node.swa
        hashes = block_hashes(toks, B)
        start = len(toks) - len(node.key)
        for e in range((start // B + 1) * B, len(toks) + 1, B):
            safe = all(s is not None for s in swa[max(0, e - cache.window) : e])
            out[hashes[e // B - 1]] = USABLE if safe else STORED
        stack.extend((c, toks, swa) for c in node.children.values())
    return out


def run_request(cache, tokens, rng):
    r = RequestKV(cache, tokens[:-1], release_interval=4)
    rest = tokens[r.cached_tokens :]
    for i in range(0, len(rest), 7):  # chunked "prefill"
        if not cache.make_room(8 + cache.page_size, 8):
            r.finish(False)
            return
        r.extend(rest[i : i + 7])
        r.release_out_of_window()
        if rng.random() < 0.3:
            r.checkpoint()
    r.finish(rng.random() < 0.9)


@pytest.mark.parametrize("page,block,window", [(1, 4, 4), (1, 16, 8), (4, 8, 6)])
def test_mirror_and_index_follow_the_tree(page, block, window):
    rng = random.Random(page * 100 + block)
    cache = SWARadixCache(SlotPool("full", 320, page), SlotPool("swa", 90), window, page)
    pub = KVEventPublisher(cache, block)
    index, since, epoch = MemoryIndex(), 0, ""
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    for step in range(250):
        op = rng.random()
        if op < 0.7:
            seq = rng.choice(prefixes)[: rng.randrange(1, 41)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 30))
            ]
            run_request(cache, seq, rng)
        elif op < 0.85:
            cache.evict_full(rng.randrange(1, 40))
        else:
            cache.evict_swa(rng.randrange(1, 30))
        assert pub.blocks == tree_blocks(cache, block), f"step {step}"
        reset, since, hashes, states = pub.changes_since(epoch, since)
        epoch = pub.epoch
        index.apply("w", reset, hashes, states)
        assert {h: s["w"] for h, s in index._by_hash.items()} == pub.blocks
        probe = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        predicted = predict_tokens(index.states(block_hashes(probe, block), ["w"])["w"], block, len(probe))
        expected = max([e for e in range(block, len(probe), block) if cache.peek_prefix_length(probe[:e]) == e] + [0])
        assert predicted == expected


def test_evicted_pages_leave_the_index():
    cache = SWARadixCache(SlotPool("full", 200), SlotPool("swa", 200), 4)
    pub = KVEventPublisher(cache, 4)
    tokens = list(range(1, 41))
    run_request(cache, tokens, random.Random(0))
    index = MemoryIndex()
    reset, seq, h, s = pub.changes_since("", 0)
    assert reset
    index.apply("w", reset, h, s)
    hashes = block_hashes(tokens, 4)
    assert predict_tokens(index.states(hashes, ["w"])["w"], 4, 41) >= 36
    cache.evict_full(1000)
    _, _, h2, s2 = pub.changes_since(pub.epoch, seq)
    assert set(s2) == {ABSENT} and set(h2) >= set(hashes[:9])
    index.apply("w", False, h2, s2)
    assert index.blocks("w") == 0 and predict_tokens(index.states(hashes, ["w"])["w"], 4, 41) == 0


def test_swa_eviction_makes_blocks_unusable_but_keeps_them():
    cache = SWARadixCache(SlotPool("full", 200), SlotPool("swa", 200), 4)
    pub = KVEventPublisher(cache, 4)
    tokens = list(range(1, 41))
    run_request(cache, tokens, random.Random(0))
    usable_before = sum(v == USABLE for v in pub.blocks.values())
    cache.evict_swa(1000)  # trims, then tombstones: the leaf goes, a tombstone leaf is removed
    assert pub.blocks == tree_blocks(cache, 4)
    assert sum(v == USABLE for v in pub.blocks.values()) < usable_before


def test_chained_hash_names_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different parents
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # the partial block is not named
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, known=a[:1]) == a
    big = block_hashes([300 + (1 << 39)] * 4, 4)  # media placeholder ids hash like tokens
    assert big != block_hashes([300] * 4, 4)


async def test_a_feed_that_stalls_past_its_ttl_rewrites_the_whole_index():
    """A relay starved past --member-ttl-s finds its worker's record (and index) gone: the delta it was writing
    sits on nothing, so it asks for a full snapshot, and the index ends equal to the worker's mirror (before the
    fix it kept only the blocks stored after the stall, for good)."""
    import asyncio

    import grpc

    from llm_backend.kv.events import KVEventsService
    from mimo_epd.router.discovery import WorkerFeed
    from mimo_epd.router.state import MemoryState
    from mimo_epd.v1 import kv_events_pb2_grpc

    class GatedState(MemoryState):  # its writes can be held back, as a starved relay's are
        def __init__(self):
            super().__init__()
            self.gate = asyncio.Event()
            self.gate.set()

        async def apply(self, *a, **kw):
            await self.gate.wait()
            return await super().apply(*a, **kw)

    rng = random.Random(7)
    cache = SWARadixCache(SlotPool("full", 400, 1), SlotPool("swa", 200), 8, 1)
    pub = KVEventPublisher(cache, 4)
    server = grpc.aio.server()
    servicer = type("S", (KVEventsService, kv_events_pb2_grpc.KVEventsServicer), {})(pub)
    kv_events_pb2_grpc.add_KVEventsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    state = GatedState()
    feed = WorkerFeed(state, f"127.0.0.1:{port}", {"kind": "llm"}, ttl_s=0.3, wait_ms=50).start()

    def indexed() -> dict[int, int]:
        got = state.index.states(list(pub.blocks), [feed.id])[feed.id]
        return {h: s for h, s in zip(pub.blocks, got) if s != ABSENT}

    async def until(cond, timeout=10.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while not cond() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return cond()

    try:
        for _ in range(6):
            run_request(cache, [rng.randrange(30) for _ in range(24)], rng)
        assert pub.blocks and await until(lambda: indexed() == pub.blocks)
        state.gate.clear()  # the relay stalls ...
        await asyncio.sleep(0.1)
        run_request(cache, [rng.randrange(30) for _ in range(24)], rng)  # ... with a delta in hand
        await asyncio.sleep(0.5)
        assert feed.id not in await state.members()  # its record expired, the index was dropped
        state.gate.set()
        assert await until(lambda: feed.resyncs == 1 and indexed() == pub.blocks), (feed.resyncs, len(indexed()))
    finally:
        await feed.stop()
        await server.stop(0)


async def test_an_answer_moves_the_log_a_step_and_wakes_a_long_poll_with_the_load_after_it():
    """`answered()`: the position a final answer reports is one past the blocks it cached, and a long poll waiting
    there returns at once (no block changed) with the load read then: the reply that brings a router to the
    answer's position never carries a load counting the answered request."""
    import asyncio

    cache = SWARadixCache(SlotPool("full", 200), SlotPool("swa", 200), 4)
    pub = KVEventPublisher(cache, 4)
    running = [{"running_tokens": 40, "running": 1}]
    pub.load_fn = lambda: {"queued_tokens": 0, "waiting": 0, **running[-1]}
    run_request(cache, list(range(1, 41)), random.Random(0))
    _, seq, _, _ = pub.changes_since("", 0)
    poll = asyncio.ensure_future(pub.wait_for_change(seq, 30.0))
    await asyncio.sleep(0.05)
    assert not poll.done()  # nothing changed: the poll waits
    running.append({"running_tokens": 0, "running": 0})  # the engine finished the request
    position = pub.answered()
    await asyncio.wait_for(poll, 2.0)  # woken by the answer, not by its 30-s limit
    reset, seq2, hashes, _ = pub.changes_since(pub.epoch, seq)
    assert position == f"{pub.epoch}:{seq + 1}" and seq2 == seq + 1 and not reset and hashes == []
    assert pub.load()["running_tokens"] == 0
