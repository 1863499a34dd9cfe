"""The node's shared-memory embedding cache segment: its default name (`mimo-epd-<launcher pid>`), and the
removal of segments whose launcher died without removing them (a SIGKILL never unlinks its own)."""

from __future__ import annotations

import os
import time

from mimo_epd.common.parent import pid_alive

SEGMENT_PREFIX = "mimo-epd-"


def segment_name(pid: int) -> str:
    """The node cache's name when `--shm-cache-name` is not given: the launcher's pid, so a stale one can be told."""
    return f"{SEGMENT_PREFIX}{pid}"


def remove_stale_segments(
    shm_dir: str = "/dev/shm", min_age_s: float = 60.0, names: list[str] | None = None
) -> list[str]:
    """Removes node caches (`mimo-epd-<pid>`, of `names` or all) whose launcher is dead: one killed by SIGKILL
    never unlinks its own. Its encoders remove it as they exit (see run_encoder); this covers nodes whose every
    process was killed. A segment younger than `min_age_s` is left alone (its launcher may live in another pid
    namespace sharing /dev/shm, just started). Returns the names removed."""
    removed: list[str] = []
    try:
        candidates = os.listdir(shm_dir) if names is None else names
    except OSError:
        return removed
    for name in candidates:
        pid = name[len(SEGMENT_PREFIX) :] if name.startswith(SEGMENT_PREFIX) else ""
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if time.time() - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:  # gone already (another encoder was faster), or not ours
            pass
    return removed
