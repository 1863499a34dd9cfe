"""CPU facts of processes: CPU seconds from /proc/<pid>/stat (Linux) and the cores this process may use. The
benchmarks' CPU accounting and the encoder's forward tuner (the decode processes' CPU use, the cores to
share) read them the same way."""

from __future__ import annotations

import os
from collections.abc import Iterable

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(pid: int) -> list[str] | None:
    """The fields after "pid (comm) " of /proc/<pid>/stat (the comm may hold spaces); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pids: Iterable[int], children: bool = False) -> float:
    """user + system CPU seconds of `pids` (with `children`: their reaped children's too); gone ones count 0."""
    end = 15 if children else 13  # utime stime [cutime cstime]
    total = 0
    for pid in pids:
        st = stat_fields(pid)
        if st:
            total += sum(int(v) for v in st[11:end])
    return total / TICK


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's cpuset, `taskset`), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
