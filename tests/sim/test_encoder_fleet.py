"""The encoder fleet simulator (`mimo-epd sim encoders`): its rules on a hand-made trace, and the CLI's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mimo_epd.sim.encoder_fleet import simulate

COSTS = SimpleNamespace(hidden=4096, node_cache_mib=64, segment_mib=64, store_ms=2.0, encode_ms_per_1k_tokens=40.0)


def test_the_lease_and_the_fleet_cache_follow_the_live_rules():
    tokens = [1000] * 10
    reqs = [
        (0.000, 0, [5]),  # node 0 encodes item 5: 40 ms
        (0.001, 1, [5]),  # node 1 misses while node 0 encodes: the lease makes it wait instead of encoding
        (0.010, 0, [5]),  # node 0's own encode in flight: waited for (the in-flight table), both modes
        (1.000, 2, [5]),  # node 2 later: a fleet-cache hit; node-local: a third encode
        (1.100, 1, [5]),  # node 1: its cache holds it in both modes
    ]
    local, fleet = simulate(reqs, tokens, 3, False, COSTS), simulate(reqs, tokens, 3, True, COSTS)
    assert (local["encodes"], fleet["encodes"]) == (3, 1)
    assert fleet["lease_waits_served"] == 1 and local["lease_waits_served"] == 0
    assert local["hit_rate"] == pytest.approx(1 / 5) and fleet["hit_rate"] == pytest.approx(2 / 5)
    # node 1 waited for node 0's encode (ends at 40 ms) plus a store read, from 1 ms: 41 ms
    assert fleet["p90_ms"] <= 41.0 + 1e-6 and local["p90_ms"] == pytest.approx(40.0)


def test_the_cli_prints_both_modes_per_fleet_size():
    out = subprocess.run(
        [sys.executable, "-m", "mimo_epd", "sim", "encoders", "--quick"], capture_output=True, text=True, check=True
    )
    res = json.loads(out.stdout)
    assert list(res["nodes"]) == ["2", "4"]
    for v in res["nodes"].values():
        assert set(v) == {"requests", "node_local", "fleet", "ratios"}
        assert (
            v["fleet"]["hit_rate"] >= v["node_local"]["hit_rate"]
            and v["fleet"]["encodes"] <= v["node_local"]["encodes"]
        )
