"""The benchmarks' bootstrap intervals (mimo_epd.common.stats): coverage, pairing, stratification, edge cases."""

import numpy as np
import pytest

from mimo_epd.common.stats import across_seeds, p, paired_ratio, total, with_ci


def test_point_is_the_ratio_on_all_data():
    a, b = [[1.0, 2.0, 3.0, 4.0]], [[2.0, 4.0, 6.0, 8.0]]
    r = paired_ratio(a, b, total, n_boot=50)
    assert r["value"] == pytest.approx(0.5) and r["n"] == 4
    # every replicate of an exactly proportional pair is the same ratio: the interval collapses on it
    assert r["lo"] == pytest.approx(0.5) and r["hi"] == pytest.approx(0.5)


def test_pairing_shrinks_the_interval():
    rng = np.random.default_rng(1)
    base = rng.lognormal(0, 1, 2000)
    paired = paired_ratio([base * 0.8], [base], p(90), n_boot=300)
    shuffled = paired_ratio([rng.permutation(base) * 0.8], [base], p(90), n_boot=300)
    assert paired["hi"] - paired["lo"] < 1e-9  # the same indices on both sides: the ratio is exact
    assert shuffled["hi"] - shuffled["lo"] > 0.02


def test_interval_covers_the_true_ratio():
    """Independent samples with a known P90 ratio of 0.7: the 95% interval covers it in most trials."""
    rng = np.random.default_rng(7)
    hits = 0
    for trial in range(40):
        x = [rng.exponential(0.7, 1500)]
        y = [rng.exponential(1.0, 1500)]
        r = paired_ratio(x, y, p(90), n_boot=200, seed=trial)
        assert r["lo"] <= r["value"] <= r["hi"]
        hits += r["lo"] <= 0.7 <= r["hi"]
    assert hits >= 33


def test_stratified_by_seed_and_width_shrinks_with_n():
    rng = np.random.default_rng(3)
    small = paired_ratio([rng.exponential(1, 200)], [rng.exponential(1, 200)], p(90), n_boot=300)
    big = paired_ratio(
        [rng.exponential(1, 2000) for _ in range(3)], [rng.exponential(1, 2000) for _ in range(3)], p(90), n_boot=300
    )
    assert big["n"] == 6000 and small["n"] == 200
    assert (big["hi"] - big["lo"]) < (small["hi"] - small["lo"]) / 2


def test_undefined_and_mismatched():
    r = paired_ratio([[]], [[]], p(90))
    assert r["value"] is None and r["lo"] is None
    r = paired_ratio([[1.0, 2.0]], [[0.0, 0.0]], total)
    assert r["value"] is None
    with pytest.raises(ValueError, match="paired"):
        paired_ratio([[1.0, 2.0]], [[1.0]], total)
    with pytest.raises(ValueError, match="seeds"):
        paired_ratio([[1.0]], [[1.0], [2.0]], total)


def test_across_seeds_and_with_ci():
    s = across_seeds([0.6, 0.7, 0.8])
    assert s["mean"] == pytest.approx(0.7) and s["min"] == 0.6 and s["max"] == 0.8
    assert s["lo"] == pytest.approx(0.7 - 4.303 * 0.1 / 3**0.5) and s["hi"] > 0.8
    one = across_seeds([0.5, None])
    assert one["mean"] == 0.5 and one["lo"] is None and one["per_seed"] == [0.5, None]
    out: dict = {}
    with_ci(out, "x_vs_y", {"value": 0.12345, "lo": 0.1, "hi": None})
    assert out == {"x_vs_y": 0.123, "x_vs_y_ci_lo": 0.1, "x_vs_y_ci_hi": None}


def test_one_percentile_definition():
    """Every report computes percentiles through mimo_epd/common/stats.py (a P90 means the same in every JSON)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    own = []
    for pkg in ("mimo_epd", "llm_backend", "loadtest", "encoder_server"):
        for f in (root / pkg).rglob("*.py"):
            if f.name == "stats.py" and f.parent.name == "common":
                continue
            text = f.read_text()
            if "np.percentile(" in text or "np.quantile(" in text or "statistics.quantiles(" in text:
                own.append(str(f.relative_to(root)))
    assert not own, f"percentiles computed outside mimo_epd/common/stats.py: {own}"


def test_percentile_and_summary():
    from mimo_epd.common.stats import percentile, summary

    assert percentile([], 90) == 0.0 and percentile([1, 2, 3, 4], 50) == 2.5
    s = summary([0.001, 0.002, 0.003], 1e3, 2, "_ms")
    assert s == {"p50_ms": 2.0, "p90_ms": 2.8, "p99_ms": 2.98, "avg_ms": 2.0}
    assert summary([], suffix="_ms")["p90_ms"] is None
