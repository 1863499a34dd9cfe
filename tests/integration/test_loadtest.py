"""A few-second headless Locust run against a real encoder completes with 0 failures."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_headless_locust_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mimo_epd", "loadtest", "encoder", "--users", "2", "--spawn-rate", "2",
                        "--run-time", "4s", "--csv-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["failures"] == 0 and summary["requests"] > 0
    assert summary["qps"] > 0 and summary["p90_ms"] > 0
    assert set(summary["by_task"]) == {"Encode url", "Encode bytes"}
    assert (tmp_path / "locust_stats.csv").exists() and (tmp_path / "locust_stats_history.csv").exists()
