"""A child process that must not outlive the process that started it (even when that one dies by SIGKILL).

`exit_with_parent` is called at the start of the child. On Linux the kernel delivers a signal the moment the
parent dies (`prctl(PR_SET_PDEATHSIG)`); elsewhere, or when prctl is unavailable, a daemon thread polls the
parent pid. Either way a child whose parent is already gone when it gets there acts at once.

`serve` marks the children it starts (encoders, LLM workers) with `PARENT_ENV` = its pid: they get SIGTERM
(their graceful drain) when it dies. A standalone `mimo-epd encoder` run from a shell has no mark and is not
tied to the shell.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["PARENT_ENV", "child_env", "exit_with_parent", "marked_parent", "pid_alive"]

PARENT_ENV = "MIMO_EPD_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_env(env: dict | None = None) -> dict:
    """The environment for a child that should exit with this process (read back by `marked_parent`)."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def marked_parent() -> int | None:
    """The pid of the `serve` that started this process and asked it to exit with it; None when this process
    was not started that way, or when its parent is not that process (the mark was inherited from further up)."""
    value = os.environ.get(PARENT_ENV, "")
    if not value.isdigit():
        return None
    pid = int(value)
    # Still marked but re-parented: the parent died before we got here (then act at once), or the variable
    # came from an ancestor through some other process (not ours to act on). A dead pid tells them apart.
    if os.getppid() != pid and pid_alive(pid):
        return None
    return pid


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie does not: a SIGKILLed `serve` stays one until whoever started it reaps it.
    No pid <= 0 runs (kill(0) would signal our own process group). The one implementation (shm_cache uses it)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:  # gone since kill(0), or no /proc at all (not Linux: kill(0) answered)
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return True


def _set_pdeathsig(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_parent(interval_s: float = 1.0, signum: int | None = None, parent: int | None = None) -> None:
    """Makes this process leave when `parent` (default: the current parent) dies, even by SIGKILL.

    `signum` None: `os._exit(0)` (a pool worker that holds nothing worth cleaning up; it would otherwise
    block on its task queue forever). A signal (e.g. SIGTERM): delivered to this process, so that its
    handler runs the normal shutdown (drain, release shared memory)."""
    parent = os.getppid() if parent is None else parent

    def leave() -> None:
        if signum is None:
            os._exit(0)
        os.kill(os.getpid(), signum)

    # The kernel's signal is immediate, but it is tied to the parent *thread* that forked us and is only
    # set from here on: the check after it covers a parent that died before this line.
    kernel = signum is not None and _set_pdeathsig(signum)
    if os.getppid() != parent:
        leave()
        return
    if kernel:
        return

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                leave()
                if signum is None:
                    return
                time.sleep(30.0)  # the handler had its chance: do not stay behind
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
