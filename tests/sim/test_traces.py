"""Trace parsing: Mooncake hash ids become shared prefixes; the long-context mix covers its buckets."""

import json
from pathlib import Path

import pytest

from llm_backend.sim.trace import BUCKETS, length_class, long_context_mix
from mimo_epd.data import open_text
from mimo_epd.sim.traces import DEFAULT_TRACE, mooncake_requests, session_key

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_trace(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 250, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 900, "input_length": 600, "output_length": 3, "hash_ids": [0, 9]},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def test_mooncake_rows_become_unit_prompts_with_shared_prefixes(small_trace):
    a, b, c = mooncake_requests(small_trace, unit=16)
    assert (a.arrival, b.arrival, c.arrival) == (0.0, 0.25, 0.9)
    assert (a.prompt_len, a.output_len) == (1100, 5)
    assert len(a.prompt) == 1024 // 16 + -(-(1100 - 1024) // 16)  # two whole blocks, then the partial third
    assert b.prompt[:64] == a.prompt[:64] and b.prompt[64:69] == a.prompt[64:69]  # blocks 0, 1 and the start of 2
    assert c.prompt[:32] == a.prompt[:32] and c.prompt[32] != a.prompt[32]  # only block 0 shared
    assert len(set(a.prompt)) == len(a.prompt)  # deterministic distinct ids inside a prompt
    exact = mooncake_requests(small_trace, unit=1)
    assert len(exact[0].prompt) == 1100 and exact[1].prompt[:1024] == exact[0].prompt[:1024]
    with pytest.raises(ValueError, match="must divide"):
        mooncake_requests(small_trace, unit=100)


def test_bad_trace_lines_are_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": []}\n')
    with pytest.raises(SystemExit, match="line 1"):
        mooncake_requests(str(p))


def test_session_sampling_keeps_every_turn_of_a_conversation():
    path = DEFAULT_TRACE
    with open_text(path) as f:
        rows = [json.loads(x) for x in f]
    reqs = mooncake_requests(str(path), sessions=0.02)
    assert 100 < len(reqs) < 800
    keys = [session_key(r["hash_ids"]) for r in rows]
    sampled_lengths = sorted(q.prompt_len for q in reqs)
    from mimo_epd.sim.traces import in_sample

    expected = sorted(r["input_length"] for r, k in zip(rows, keys) if in_sample(k, 0.02))
    assert sampled_lengths == expected
    assert reqs[-1].arrival > 3000  # spread over the whole hour


def test_long_context_mix_covers_the_buckets_and_is_poisson():
    reqs = long_context_mix(2000, rate_per_s=4.0, seed=7, unit=128)
    classes = [length_class(r.prompt_len) for r in reqs]
    shares = {name: classes.count(name) / len(reqs) for name, _, _ in BUCKETS}
    assert shares["0-64K"] == pytest.approx(0.8, abs=0.04)
    assert shares["64K-256K"] == pytest.approx(0.15, abs=0.03)
    assert shares["256K-1M"] == pytest.approx(0.05, abs=0.02)
    assert all(len(r.prompt) == -(-r.prompt_len // 128) for r in reqs)
    assert max(r.prompt_len for r in reqs) < 1 << 20
    gaps = [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)
    assert long_context_mix(50, 4.0, seed=7) == long_context_mix(50, 4.0, seed=7)
    assert long_context_mix(50, 4.0, seed=7) != long_context_mix(50, 4.0, seed=8)
