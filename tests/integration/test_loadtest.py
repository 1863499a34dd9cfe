"""Headless Locust runs: a few seconds against a real encoder complete with 0 failures, and failed requests
are reported grouped by gRPC status. (The run against `serve`, the README's server, is in
tests/cli/test_quickstart.py.)"""

import json
import os
import subprocess
import sys

import pytest

from loadtest.run import LOCUSTFILE, failures_by_status
from mimo_epd.testing.media_server import MediaServer, generate_pool
from mimo_epd.testing.servers import start_server
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_headless_locust_run_with_urls_bytes_and_audio(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mimo_epd",
            "loadtest",
            "encoder",
            "--users",
            "2",
            "--spawn-rate",
            "2",
            "--run-time",
            "4s",
            "--urls",
            "--audio-fraction",
            "0.3",
            "--csv-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["failures"] == 0 and summary["requests"] > 0 and summary["failures_by_status"] == {}
    assert summary["qps"] > 0 and summary["p90_ms"] > 0
    # a third of the requests carry a 2-8 s audio clip (AUDIO items) instead of an image
    assert set(summary["by_task"]) == {"Encode url", "Encode bytes", "Encode audio"}
    assert summary["audio_fraction"] == 0.3
    assert (tmp_path / "locust_stats.csv").exists() and (tmp_path / "locust_stats_history.csv").exists()


def test_failed_requests_are_grouped_by_status(tmp_path):
    """A real Locust run whose URL items all 404 on the media server: the failures CSV, as the load test reads
    it, gives NOT_FOUND with the server's message, and the bytes items still succeed."""
    images = generate_pool([(240, 320)], per_size=1)
    (tmp_path / "images").mkdir()
    for name, data in images.items():
        (tmp_path / "images" / name).write_bytes(data)
    server = start_server(["--url-allowlist", "127.0.0.1/32", "--cache-bytes", "0"], cwd=ROOT)
    try:
        with MediaServer(images) as media:
            env = {
                **os.environ,
                "MIMO_EPD_MEDIA_URLS": media.url("missing.jpg"),
                "MIMO_EPD_IMAGES_DIR": str(tmp_path / "images"),
            }
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "locust",
                    "-f",
                    str(LOCUSTFILE),
                    "--headless",
                    "--users",
                    "2",
                    "--spawn-rate",
                    "2",
                    "--run-time",
                    "3s",
                    "--host",
                    server.address,
                    "--csv",
                    str(tmp_path / "locust"),
                    "--only-summary",
                ],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
    finally:
        server.stop()
    assert (tmp_path / "locust_failures.csv").exists(), r.stderr[-3000:]
    counts, examples = failures_by_status(tmp_path / "locust_failures.csv")
    assert set(counts) == {"NOT_FOUND"} and counts["NOT_FOUND"] > 0, (counts, examples)
    assert examples["NOT_FOUND"].startswith("Encode url: item 0:") and "404" in examples["NOT_FOUND"], examples
    rows = (tmp_path / "locust_failures.csv").read_text().strip().splitlines()
    assert len(rows) == 2, rows  # header + one row: the per-request tokens are masked, so equal failures group
