"""Routing policies: each formula of docs/routing.md on small hand-made views."""

from __future__ import annotations

import pytest

from mimo_epd.router.policies import Candidate, PolicyConfig, RequestView, make_policy

REQ = RequestView(num_tokens=1000, block_size=16, block_hashes=tuple(range(62)))


def C(w, matched=0, queued=0, running=0, in_flight=0):
    return Candidate(w, matched, queued, running, in_flight)


def test_affinity_prefers_the_cache_until_load_outweighs_it():
    p = make_policy("affinity")
    # 80% match on the busier worker beats an idle worker with nothing cached (2*0.8 - 1 > 0)
    assert p.rank(REQ, [C("a", 800, 0, 3000), C("b", 0, 0, 1000)])[0] == "a"
    # a small match does not pull the request onto the busiest worker
    assert p.rank(REQ, [C("a", 100, 0, 3000), C("b", 0, 0, 1000)])[0] == "b"
    # weights are flags
    p = make_policy("affinity", PolicyConfig(match_weight=0.5))
    assert p.rank(REQ, [C("a", 800, 0, 3000), C("b", 0, 0, 0)])[0] == "b"


def test_affinity_queued_prefill_term():
    # a has 50% of the prompt cached but a long prefill queue; b is cold with nothing queued, both decode the same
    cands = [C("a", 500, 20000, 1000), C("b", 0, 0, 1000)]
    assert make_policy("affinity").rank(REQ, cands)[0] == "a"  # off by default: the match fraction decides
    # a's pending prefill (500 + 20000) is the largest, b's (1000) 5% of it: 2*0.5 - 1 - 1.5 < -0.05 - 1.5*0.05
    p = make_policy("affinity", PolicyConfig(queued_prefill_weight=1.5))
    assert p.rank(REQ, cands)[0] == "b"
    # with nothing queued anywhere the term only counts the uncached tokens: the hit wins again
    assert p.rank(REQ, [C("a", 500, 0, 1000), C("b", 0, 0, 1000)])[0] == "a"


def test_affinity_spreads_idle_cold_requests_and_ranks_everyone():
    p = make_policy("affinity")
    firsts = [p.rank(REQ, [C("a"), C("b"), C("c")]) for _ in range(3)]
    assert {r[0] for r in firsts} == {"a", "b", "c"}
    assert all(sorted(r) == ["a", "b", "c"] for r in firsts)


def test_round_robin_and_least_load():
    rr = make_policy("round_robin")
    cands = [C("a", 900), C("b"), C("c")]
    assert [rr.rank(REQ, cands)[0] for _ in range(4)] == ["a", "b", "c", "a"]
    ll = make_policy("least_load")
    assert ll.rank(REQ, [C("a", 0, 10, 5), C("b", 999, 100, 0), C("c", 0, 0, 1)]) == ["c", "a", "b"]


def test_cache_aware_follows_sglang_thresholds():
    p = make_policy("cache_aware")
    a = RequestView(320, 16, tuple(range(20)))
    assert p.rank(a, [C("x"), C("y")])[0] == "x"  # empty trees: smallest tree, then rotation
    p.observe(a, "x")
    # the same prefix again: match fraction 1 > 0.3 -> x, even though y's tree is smaller
    assert p.rank(a, [C("x"), C("y")])[0] == "x"
    # imbalance in requests in flight (SGLang's load): max - min > 64 and max > 1.5 min -> least loaded,
    # whatever the cache says
    assert p.rank(a, [C("x", in_flight=200), C("y", in_flight=100)])[0] == "y"
    # imbalanced by ratio but not by 64 requests: the cache still wins
    assert p.rank(a, [C("x", in_flight=60), C("y", in_flight=0)])[0] == "x"
    # tokens are not its load: 100x more queued tokens on x with equal requests in flight, the cache still wins
    assert p.rank(a, [C("x", queued=20000, in_flight=3), C("y", queued=200, in_flight=3)])[0] == "x"
    # a request sharing only 4 of 20 blocks (20% <= 0.3) goes to the smallest tree
    b = RequestView(320, 16, tuple(range(4)) + tuple(range(100, 116)))
    assert p.rank(b, [C("x"), C("y")])[0] == "y"


def test_cache_aware_trees_are_bounded():
    p = make_policy("cache_aware", PolicyConfig(tree_blocks=8))
    p.observe(RequestView(320, 16, tuple(range(20))), "x")
    assert len(p.routed.trees["x"]) == 8 and p.approx_match(RequestView(320, 16, tuple(range(20))), "x") == 0


def test_kv_cost_is_dynamo_formula():
    p = make_policy("kv_cost")
    # a: 1000-800 = 200 uncached + 160 queued -> 22.5 prefill blocks, 320 running -> 20: 42.5
    # b: 1000 uncached -> 62.5 blocks: 62.5
    assert p.rank(REQ, [C("a", 800, 160, 320), C("b")]) == ["a", "b"]
    p = make_policy("kv_cost", PolicyConfig(prefill_weight=0.1))  # decode blocks dominate
    assert p.rank(REQ, [C("a", 800, 160, 320), C("b")]) == ["b", "a"]


def test_policies_are_deterministic_and_names_are_checked():
    for name in ("affinity", "round_robin", "least_load", "cache_aware", "kv_cost"):
        runs = []
        for _ in range(2):
            p = make_policy(name)
            seq = []
            for i in range(6):
                r = RequestView(100 + i, 16, tuple(range(i)))
                order = p.rank(r, [C("a", 16 * (i % 3), i, 10), C("b", 0, 0, 5 * i)])
                p.observe(r, order[0])
                seq.append(order)
            runs.append(seq)
        assert runs[0] == runs[1], name
    with pytest.raises(ValueError, match="unknown routing policy 'x'"):
        make_policy("x")
    assert make_policy("affinity").rank(REQ, []) == []


def test_affinity_places_new_sessions_by_what_it_sent_each_worker_then_load():
    p = make_policy("affinity")
    a, b = RequestView(320, 16, tuple(range(20))), RequestView(320, 16, tuple(range(100, 120)))
    p.observe(a, "x")  # x has been sent 20 blocks, y nothing
    # a cold request (no match anywhere) goes to y although y is busier: footprint first, then load
    assert p.rank(b, [C("x", 0, 0, 0), C("y", 0, 0, 5000)])[0] == "y"
    p.observe(b, "y")
    # equal footprints: the least loaded
    c = RequestView(320, 16, tuple(range(200, 220)))
    assert p.rank(c, [C("x", 0, 0, 900), C("y", 0, 0, 100)])[0] == "y"
    # a returning session (match above the threshold) is scored as before: its cache wins over the footprint
    assert p.rank(a, [C("x", 300, 0, 900), C("y", 0, 0, 100)])[0] == "x"
    # the rule is a flag: -1 scores every request (the cold one then goes to the least loaded)
    q = make_policy("affinity", PolicyConfig(new_threshold=-1))
    q.observe(a, "y")
    assert q.rank(b, [C("x", 0, 0, 0), C("y", 0, 0, 5000)])[0] == "x"
    assert q.rank(b, [C("x", 0, 0, 5000), C("y", 0, 0, 0)])[0] == "y"


def test_affinity_trusts_its_own_record_while_the_index_lags():
    """Turn 2 of a session whose turn 1 this router sent to x, before the index has x's blocks (matched 0 for
    everyone): not a new session, x is picked on the router's own record, although y is emptier and idle."""
    p = make_policy("affinity")
    turn1 = RequestView(160, 16, tuple(range(10)))
    p.observe(turn1, "x")
    p.observe(RequestView(64, 16, tuple(range(500, 504))), "y")
    turn2 = RequestView(320, 16, tuple(range(20)))  # turn 1's 10 blocks, then 10 new ones
    assert p.rank(turn2, [C("x", 0, 0, 500), C("y", 0, 0, 0)])[0] == "x"
    # a session it never saw is new: footprint first (y has fewer blocks)
    assert p.rank(RequestView(320, 16, tuple(range(900, 920))), [C("x", 0, 0, 0), C("y", 0, 0, 500)])[0] == "y"
