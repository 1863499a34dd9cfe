"""Server subprocesses for the benchmarks, the load tests and the integration tests: start one `mimo-epd`
command on free ports and wait for its ready line, stop it, and read its /metrics."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field


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
    raise RuntimeError(f"server {' '.join(args)} did not start: {''.join(x for x in log if 'mimo' in x)[-6000:]}")


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
