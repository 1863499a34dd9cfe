"""`bench scheduler --quick` and `bench routing --quick`: one JSON object with the ratios, a PNG next to it,
no grades."""

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from mimo_epd.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def _run(argv):
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli(argv) == 0
    return json.loads(buf.getvalue())


def _no_grades(d):
    text = json.dumps(d)
    assert '"goal' not in text and "goal_met" not in text


def test_bench_scheduler_quick(tmp_path):
    d = _run(["bench", "scheduler", "--quick", "--out-dir", str(tmp_path)])
    assert d["bench"] == "scheduler" and set(d["config"]["policies"]) == {
        "fcfs",
        "uncached_first",
        "uncached_first_buckets",
    }
    r = d["ratios"]
    assert r["policy"] == "uncached_first_buckets"
    for k in ("long_ttft_p90_vs_fcfs", "short_ttft_p99_vs_fcfs"):
        assert 0 < r[f"{k}_ci_lo"] <= r[f"{k}_ci_hi"] and r[k] > 0
        assert r[f"{k}_seeds"]["per_seed"] == [pytest.approx(r[f"{k}_seeds"]["mean"], abs=1e-3)]
    assert set(r["by_load"]["0.8"]) == {"uncached_first", "uncached_first_buckets"}
    assert d["config"]["seeds"] == [0]
    for png in ("bench_scheduler.png", "bench_scheduler_ttft.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert json.loads((tmp_path / "bench_scheduler.json").read_text())["ratios"] == r
    _no_grades(d)
    # --merge unites pieces run at different loads (here the same run relabelled as 90%)
    other = json.loads(json.dumps(d).replace('"0.8"', '"0.9"').replace("@0.8", "@0.9"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench_scheduler.json").write_text(json.dumps(other))
    m = _run(
        ["bench", "scheduler", "--out-dir", str(tmp_path / "m"), "--merge"]
        + [str(tmp_path / "bench_scheduler.json"), str(tmp_path / "b" / "bench_scheduler.json")]
    )
    assert m["config"]["loads"] == [0.8, 0.9] and set(m["ratios"]["by_load"]) == {"0.8", "0.9"}
    assert m["ratios"]["long_ttft_p90_vs_fcfs"] == r["long_ttft_p90_vs_fcfs"]
    assert (tmp_path / "m" / "bench_scheduler.png").stat().st_size > 1000


def test_bench_routing_quick(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    d = _run(["bench", "routing", "--quick", "--out-dir", str(tmp_path)])
    r = d["ratios"]
    assert (r["workers"], r["load"]) == (8, 0.8)
    for k in (
        "affinity_cached_vs_round_robin",
        "affinity_cached_vs_sglang_gateway",
        "affinity_cached_vs_best_peer",
        "affinity_ttft_p90_vs_best_peer",
    ):
        assert r[k] > 0 and r[f"{k}_ci_lo"] <= r[f"{k}_ci_hi"]
    assert r["by_point"]["8/0.8"]["affinity_cached_vs_round_robin"] == r["affinity_cached_vs_round_robin"]
    assert {p["policy"] for p in d["points"]} == {"affinity", "round_robin", "least_load", "cache_aware", "kv_cost"}
    assert (tmp_path / "bench_routing.png").stat().st_size > 1000
    _no_grades(d)


def test_bench_tier_ttft_quick(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    d = _run(["bench", "tier-ttft", "--quick", "--out-dir", str(tmp_path)])
    assert set(d["runs"]) == {"round_robin", "affinity"}
    for pol, modes in d["runs"].items():
        assert set(modes) == {"recompute", "tiers", "tiers_no_overlap", "tiers_free"}
        assert all(m["requests"] == d["config"]["requests"] > 0 for m in modes.values())
        assert "hit_tokens_by_tier" not in modes["recompute"]
        t = modes["tiers"]
        assert sum(t["hit_tokens_by_tier"].values()) >= t["hit_tokens"]  # tiers count whole units, capped after
        assert modes["tiers_free"]["tier_loads"]["load_s"] == 0
        nol = modes["tiers_no_overlap"]["tier_loads"]
        assert nol["exposed_s"] == pytest.approx(nol["load_s"], abs=1e-3)
        assert d["ratios"][f"{pol}_ttft_p90_tiers_vs_recompute"] > 0
    # with the store written at insert, round robin finds what the other worker computed
    assert d["runs"]["round_robin"]["tiers"]["hit_tokens_by_tier"]["store"] > 0
    assert json.loads((tmp_path / "bench_tier_ttft.json").read_text())["ratios"] == d["ratios"]
    _no_grades(d)
