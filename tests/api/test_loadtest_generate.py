"""`mimo-epd loadtest generate` against the `serve` it starts: a few seconds of the images workload over
HTTP and gRPC, zero failures, a summary with QPS, TTFT and end-to-end percentiles and tokens/s."""

import json
import subprocess
import sys

import pytest

from loadtest.generate import summarize
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_generate_loadtest_against_serve(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mimo_epd",
            "loadtest",
            "generate",
            "--users",
            "2",
            "--spawn-rate",
            "2",
            "--run-time",
            "6s",
            "--workload",
            "images",
            "--grpc-share",
            "0.5",
            "--max-tokens",
            "4",
            "--csv-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["loadtest"] == "generate" and s["requests"] > 0 and s["failures"] == 0 and s["failures_by_status"] == {}
    assert s["qps"] > 0 and s["p90_ms"] >= s["p50_ms"] > 0 and s["ttft_ms"]["p90_ms"] > 0
    assert (
        s["completion_tokens"]
        == 4 * s["by_api"]["http"]["requests"] + s["by_api"].get("grpc", {}).get("completion_tokens", 0)
        and s["tokens_per_s"] > 0
    )
    assert set(s["by_api"]) <= {"http", "grpc"} and "http" in s["by_api"]
    assert (tmp_path / "locust_stats.csv").exists()


def test_summary_groups_failures_by_status():
    recs = [
        {"api": "http", "start": 0.0, "end": 1.0, "e2e_ms": 1000.0, "ttft_ms": 100.0, "tokens": 4, "error": None},
        {
            "api": "http",
            "start": 0.5,
            "end": 2.0,
            "e2e_ms": 1500.0,
            "ttft_ms": None,
            "tokens": 0,
            "error": "HTTP 429: overloaded",
        },
        {
            "api": "grpc",
            "start": 1.0,
            "end": 2.0,
            "e2e_ms": 900.0,
            "ttft_ms": None,
            "tokens": 0,
            "error": "grpc UNAVAILABLE: down",
        },
    ]
    s = summarize(recs)
    assert s["requests"] == 3 and s["failures"] == 2 and s["qps"] == 1.5 and s["tokens_per_s"] == 2.0
    assert s["failures_by_status"] == {"HTTP 429": 1, "grpc UNAVAILABLE": 1}
    assert s["p50_ms"] == 1000.0 and s["ttft_ms"]["p50_ms"] == 100.0


def loadtest_generate(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mimo_epd", "loadtest", "generate", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_generate_loadtest_drives_every_http_api(tiny_worker, tmp_path):
    """`--apis chat,completions,responses,messages` against a worker's own HTTP API (the chat workload: this worker
    has no encoder): each API gets requests, none fails, tokens are counted per API."""
    r = loadtest_generate(
        *("--http", f"http://{tiny_worker.http_address}", "--apis", "chat,completions,responses,messages"),
        *("--users", "2", "--spawn-rate", "2", "--run-time", "6s", "--max-tokens", "4"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["failures"] == 0 and s["requests"] >= 8
    assert set(s["by_api"]) == {"http", "http-completions", "http-responses", "http-messages"}
    for api, part in s["by_api"].items():
        assert part["requests"] > 0 and 0 < part["completion_tokens"] <= 4 * part["requests"], api
        assert part["ttft_ms"]["p50_ms"] is not None, api


def test_generate_loadtest_refuses_an_unknown_api():
    r = loadtest_generate("--http", "http://127.0.0.1:9", "--apis", "chat,soap", timeout=120)
    assert r.returncode == 2 and "--apis" in r.stderr and "soap" in r.stderr
