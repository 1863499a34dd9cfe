"""Process measurements from /proc: CPU seconds and resident memory of a process and its descendants, and
starting a peer server module the way `bench.common.start_server` starts ours (a `ready HOST:PORT` line)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from mimo_epd.common.proc_stat import cpu_seconds
from mimo_epd.common.proc_stat import stat_fields as _stat
from mimo_epd.testing.servers import ServerProcess


def descendants(pid: int) -> list[int]:
    """pid and every live process below it."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                children.setdefault(int(st[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of pid and its live descendants (each process's own, reaped children's
    included through cutime/cstime)."""
    return cpu_seconds(descendants(pid), children=True)


def tree_rss_bytes(pid: int) -> int:
    """Current resident set of pid and its live descendants."""
    total = 0
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class RssSampler:
    """Samples the resident set of a process tree every `interval_s` in a thread; `.peak` is the highest seen
    (a child's peak is invisible to getrusage of the parent until it is reaped)."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.2):
        self.pid = pid or os.getpid()
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tree = True

    def _sample(self) -> int:
        return tree_rss_bytes(self.pid) if self._tree else _status_kb("VmRSS:") * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self.peak = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak resident set of this process over a block, without a sampling thread: the kernel's high-water mark
    (VmHWM) is reset on entry by writing 5 to /proc/self/clear_refs and read on exit. Where that reset is not
    allowed, a sampler of this process's VmRSS is used instead. `.peak` and `.before` are bytes."""

    def __init__(self):
        self.peak = self.before = 0
        self._sampler: RssSampler | None = None

    def __enter__(self) -> "PeakRss":
        self.before = _status_kb("VmRSS:") * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._sampler = RssSampler(os.getpid(), 0.02)
            self._sampler._tree = False
            self._sampler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._sampler is not None:
            self._sampler.__exit__(*exc)
            self.peak = self._sampler.peak
        else:
            self.peak = _status_kb("VmHWM:") * 1024


def start_peer(module: str, args: list[str], timeout: float = 180) -> ServerProcess:
    """Starts `python -m MODULE ARGS` and waits for its `ready HOST:PORT` line on stdout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    log: list[str] = []
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ready "):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return ServerProcess(line.split()[1], proc, log)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"peer {module} did not start: {''.join(log)[-2000:]}")
