"""The headless Locust command line every load test here runs (encoder, generate, chaos)."""

from __future__ import annotations

import sys
from pathlib import Path


def locust_command(
    locustfile: Path,
    *,
    users: int,
    spawn_rate: float,
    host: str,
    csv_prefix: Path,
    stop_timeout_s: int,
    run_time: str | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """`python -m locust` headless, summary only, stats to `<csv_prefix>_*.csv`; without `run_time` it runs until
    stopped (the chaos campaign ends it)."""
    cmd = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless"]
    cmd += ["--users", str(users), "--spawn-rate", str(spawn_rate)]
    if run_time is not None:
        cmd += ["--run-time", run_time]
    cmd += ["--host", host, "--csv", str(csv_prefix), "--only-summary", "--stop-timeout", str(stop_timeout_s)]
    return cmd + list(extra)
