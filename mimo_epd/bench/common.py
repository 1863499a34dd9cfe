"""Shared pieces of the benchmarks: server subprocesses, closed-loop load, latency statistics."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ServerProcess:
    address: str
    proc: subprocess.Popen
    stderr_lines: list[str] = field(default_factory=list)
    http_address: str = ""  # from an `http HOST:PORT` line before `ready` (servers with an HTTP API)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(
    args: list[str], subcommand: str = "encoder", timeout: float = 180, cwd: str | None = None
) -> ServerProcess:
    """Starts `mimo-epd <subcommand> --port 0 ARGS` and waits for its ready line (the benchmarks and the
    integration tests start every server this way)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mimo_epd", subcommand, "--port", "0", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log: list[str] = []
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + timeout
    http = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("http "):
            http = line.split()[1]
        if line.startswith("ready "):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return ServerProcess(line.split()[1], proc, log, http_address=http)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"server {' '.join(args)} did not start: {''.join(log)[-2000:]}")


def scrape(port: int) -> dict[str, float]:
    """Prometheus text from 127.0.0.1:port/metrics -> {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"^(\S+)\s+(\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def latency_stats(latencies_s: list[float], wall_s: float) -> dict:
    a = np.array(latencies_s) * 1e3
    return {
        "requests": len(a),
        "seconds": round(wall_s, 3),
        "qps": round(len(a) / wall_s, 3),
        "avg_ms": round(float(a.mean()), 2),
        "p50_ms": round(float(np.percentile(a, 50)), 2),
        "p90_ms": round(float(np.percentile(a, 90)), 2),
        "p99_ms": round(float(np.percentile(a, 99)), 2),
    }


async def closed_loop(send, n: int, concurrency: int) -> tuple[list[float], float, int]:
    """`concurrency` clients each send their next request as soon as the previous answer arrives, until
    `n` requests have been sent. `send(i)` is a coroutine. Returns (latencies, wall seconds, failures)."""
    latencies: list[float] = []
    failures = 0
    counter = iter(range(n))

    async def client() -> None:
        nonlocal failures
        for i in counter:
            t0 = time.perf_counter()
            try:
                await send(i)
                latencies.append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - counted and reported
                failures += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start, failures
