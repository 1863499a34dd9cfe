"""`mimo-epd bench routing-live --quick`: one JSON object with every run's figures, the SGLang gateway's (or the
reason it could not run), and the ratios; affinity keeps more of the cache than round_robin on the same
multi-turn workload. Figures are the benchmark's; this checks their shape and the ordering that must hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_routing_live_quick():
    r = subprocess.run(
        [sys.executable, "-m", "mimo_epd", "bench", "routing-live", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert "goal" not in r.stdout
    runs = out["policies"]
    assert set(runs) == {"affinity", "round_robin"}
    for name, run in runs.items():
        assert run["requests"] == out["requests"] == 12 and run["errors"] == 0, (name, run)
        assert sum(run["requests_per_worker"]) == 12 and run["prediction"]["requests"] == 12
        assert run["ttft_p90_ms"] >= run["ttft_p50_ms"] > 0 and run["qps"] > 0
        assert run["front_overhead"]["through_ms"] > 0 and run["front_overhead"]["direct_ms"] > 0
    # sessions stick to their worker: every later turn reuses the earlier ones (round_robin alternates workers)
    # (12 requests on a worker pair both runs share: a turn or two either way moves the fractions by ~0.01-0.03,
    # so the smoke checks affinity is not worse beyond that; the full benchmark measures the difference)
    assert runs["affinity"]["cached_fraction"] >= runs["round_robin"]["cached_fraction"] - 0.05
    assert runs["affinity"]["cached_fraction"] > 0.3
    a, rr = runs["affinity"]["cached_fraction"], runs["round_robin"]["cached_fraction"]
    assert out["ratios"]["affinity_cached_vs_round_robin"] == pytest.approx(a / rr, abs=0.01)
    gw = out["sglang_gateway"]
    if "error" in gw:
        assert gw["error"] and out["ratios"]["affinity_cached_vs_sglang_gateway"] is None
    else:
        assert gw["requests"] == 12 and gw["errors"] == 0 and gw["version"]
        assert out["ratios"]["affinity_cached_vs_sglang_gateway"] > 0
