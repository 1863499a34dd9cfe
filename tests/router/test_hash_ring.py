import random

import pytest

from mimo_epd.router.hash_ring import HashRing

NODES = [f"127.0.0.1:{5000 + i}" for i in range(5)]
KEYS = [f"key-{i}" for i in range(20_000)]


def test_deterministic_and_balanced():
    a, b = HashRing(NODES), HashRing(reversed(NODES))
    counts = {n: 0 for n in NODES}
    for k in KEYS:
        assert a.owner(k) == b.owner(k)
        counts[a.owner(k)] += 1
    share = [c / len(KEYS) for c in counts.values()]
    assert max(share) < 0.3 and min(share) > 0.1  # 160 vnodes: each of 5 nodes gets 20% +- 10 points


def test_removing_one_of_n_moves_about_one_nth_and_only_its_keys():
    ring = HashRing(NODES)
    before = {k: ring.owner(k) for k in KEYS}
    gone = NODES[2]
    ring.remove(gone)
    after = {k: ring.owner(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)  # nothing else moves
    assert all(after[k] != gone for k in KEYS)
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # ~1/5
    ring.add(gone)  # rejoin: exactly the same keys come back
    assert {k: ring.owner(k) for k in KEYS} == before


def test_alive_filter_equals_removal():
    ring = HashRing(NODES)
    alive = set(NODES) - {NODES[0]}
    smaller = HashRing(alive)
    for k in random.Random(0).sample(KEYS, 2000):
        assert ring.owner(k, alive) == smaller.owner(k)
    assert ring.owner("x", alive=set()) is None


def test_owners_lists_each_node_once():
    ring = HashRing(NODES)
    order = list(ring.owners("some-key"))
    assert sorted(order) == sorted(NODES) and order[0] == ring.owner("some-key")
    assert list(HashRing().owners("k")) == []
    with pytest.raises(ValueError):
        HashRing(vnodes=0)
