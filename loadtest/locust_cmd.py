"""The headless Locust command line every load test here runs (encoder, generate, chaos), and where its CSV files
go (`results_dir`)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def results_dir(csv_dir: str, prefix: str) -> Iterator[Path]:
    """Where a load test's Locust CSV files go: `--csv-dir` when given (kept), else a temporary directory that is
    removed when the test ends (its figures are in the JSON it prints)."""
    if csv_dir:
        path = Path(csv_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield Path(d)
