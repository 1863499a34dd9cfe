"""The benchmarks on both real shared stores side by side (`--kv-store local`: a throwaway redis-server and
mooncake_master): bounded runs, shape and consistency only (no timing asserts). The two stores hold the same
pages under the same replay, so their hit tokens must agree exactly; the measured transport figures are
reported for each."""

import json
import shutil
import subprocess
import sys

import pytest

from mimo_epd.testing.mooncake_master import master_binary
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or master_binary() is None,
    reason="needs redis-server (Debian) and the mooncake-transfer-engine-non-cuda wheel",
)


def run(*args, timeout=400) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "mimo_epd", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("{")]
    assert len(lines) == 1, r.stdout[-2000:]
    return json.loads(lines[0])


def test_prefix_cache_l3_on_redis_and_mooncake_side_by_side():
    out = run("prefix-cache", "--tiers", "--quick", "--requests", "60", "--kv-store", "local")
    modes, ratios = out["modes"], out["ratios"]
    assert set(out["config"]["tiers"]["stores"]) == {"redis", "mooncake"}
    for pol in ("round_robin", "affinity"):
        redis, mooncake = modes[f"l1_l2_l3_{pol}"], modes[f"l1_l2_l3_{pol}_mooncake"]
        assert mooncake["hit_tokens"] == redis["hit_tokens"], pol  # same pages, same replay
        assert mooncake["store"]["hits"] == redis["store"]["hits"], pol
        assert mooncake["tiers"]["pages_to_store"] == redis["tiers"]["pages_to_store"] > 0
        for m in (redis, mooncake):
            s = m["store"]
            assert s["errors"] == 0 and s["corrupt"] == 0 and s["dropped"] == 0 and s["puts"] > 0
            assert s["write_bytes_per_s"] > 0 and s["load_ms_per_page"]["samples"] > 0
    assert ratios["l3_mooncake_vs_redis"] == 1.0 and ratios["l3_affinity_mooncake_vs_redis"] == 1.0


def test_tier_ttft_prices_each_measured_store(tmp_path):
    out = run("tier-ttft", "--quick", "--kv-store", "local", "--out-dir", str(tmp_path))
    figures = out["config"]["store_figures"]
    assert set(figures) == {"redis", "mooncake"}
    for f in figures.values():
        assert f["read_bytes_per_s"] > 0 and f["write_bytes_per_s"] > 0 and 0 < f["lookup_ms"]["p50"]
    for pol in ("round_robin", "affinity"):
        runs = out["runs"][pol]
        assert {"tiers_redis", "tiers_mooncake"} <= set(runs)
        for s in ("redis", "mooncake"):
            assert runs[f"tiers_{s}"]["hit_tokens"] > 0 and runs[f"tiers_{s}"]["ttft_s"]["p50"] > 0
        assert f"{pol}_ttft_p90_mooncake_vs_redis" in out["ratios"]
