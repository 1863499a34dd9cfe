"""Nothing outlives a node killed by SIGKILL: its encoders, their decode processes and its LLM worker exit
(`mimo_epd.common.parent`), and its shared-memory cache segment goes with them (`remove_stale_segments`,
called by the last encoders on their way out and by the next `serve` at start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mimo_epd.launcher import remove_stale_segments, segment_name
from mimo_epd.testing.servers import start_server
from tests.conftest import ROOT


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return sorted(set(out))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------ the parent-death hook
_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from mimo_epd.common import parent as p
    if sys.argv[1] == "thread":            # the portable fallback: no prctl
        p._set_pdeathsig = lambda signum: False
    signal.signal(signal.SIGTERM, lambda *a: (print("drained", flush=True), os._exit(0)))
    print("marked" if p.marked_parent() else "unmarked", flush=True)
    if p.marked_parent():
        p.exit_with_parent(interval_s=0.1, signum=signal.SIGTERM, parent=p.marked_parent())
    print("ready", flush=True)
    time.sleep(60)
""")
_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from mimo_epd.common.parent import child_env
    env = child_env() if sys.argv[2] == "marked" else None
    c = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1]], env=env, stdout=sys.stderr)  # the test reads it
    print(c.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("how", ["prctl", "thread"])
def test_a_marked_child_gets_sigterm_when_its_parent_is_sigkilled(how, tmp_path):
    out = tmp_path / "child.out"
    with out.open("w") as f:
        parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT, how, "marked", _CHILD],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
        )
        child = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while "ready" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert "ready" in out.read_text(), out.read_text()
        parent.kill()
        parent.wait()
        t = time.monotonic()
        while _alive(child) and time.monotonic() - t < 10:
            time.sleep(0.05)
        assert not _alive(child), f"child {child} still running 10 s after its parent's SIGKILL ({how})"
        # it left through its SIGTERM handler (the servers' drain), not by being killed outright
        assert out.read_text().split() == ["marked", "ready", "drained"], out.read_text()
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_unmarked_child_is_not_tied_to_its_parent(tmp_path):
    # `mimo-epd encoder` started from a shell (no MIMO_EPD_PARENT_PID) must survive the shell
    out = tmp_path / "child.out"
    with out.open("w") as f:
        parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT, "prctl", "unmarked", _CHILD],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
        )
        child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while "ready" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.read_text().split() == ["unmarked", "ready"], out.read_text()
        parent.kill()
        parent.wait()
        time.sleep(1.0)
        assert _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------------------------ stale segments
def test_remove_stale_segments_only_takes_segments_of_dead_launchers(tmp_path):
    dead, dead2 = _dead_pid(), _dead_pid()
    old = time.time() - 3600
    names = {
        "dead_old": segment_name(dead),
        "dead_young": segment_name(dead2),
        "live": segment_name(os.getppid()),
        "named": "my-cache",
        "arena": f"mimo-epd-decode-{dead}-x",
    }
    for key, name in names.items():
        if key == "dead_young":
            continue
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    assert remove_stale_segments(str(tmp_path), min_age_s=60) == [names["dead_old"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["live"], names["named"], names["arena"]])
    # a young segment of a dead pid (another pid namespace may have just created it) stays, unless asked
    (tmp_path / names["dead_young"]).write_bytes(b"x")
    assert remove_stale_segments(str(tmp_path), min_age_s=60) == []
    assert remove_stale_segments(str(tmp_path), min_age_s=0, names=[names["dead_young"]]) == [names["dead_young"]]


# ------------------------------------------------------------------------------------ a real node
@pytest.mark.integration
def test_sigkilled_serve_leaves_no_process_and_no_segment():
    srv = start_server(
        ["--encoders", "1", "--decode-workers", "1", "--http-port", "-1", "--shm-cache-bytes", str(64 << 20)],
        subcommand="serve",
        timeout=240,
        cwd=ROOT,
    )
    pid = srv.proc.pid
    seg = Path("/dev/shm") / segment_name(pid)
    family = _descendants(pid)
    try:
        # encoder, its decode process, LLM worker
        assert len(family) >= 3, family
        assert seg.exists()
        srv.proc.kill()
        srv.proc.wait()
        t = time.monotonic()
        exited: dict[int, float] = {}
        while time.monotonic() - t < 30 and len(exited) < len(family):
            for p in family:
                if p not in exited and not _alive(p):
                    exited[p] = round(time.monotonic() - t, 2)
            time.sleep(0.05)
        left = [p for p in family if p not in exited]
        assert not left, f"still running 30 s after serve's SIGKILL: {left}; exited: {exited}"
        # the encoder removed the cache of its dead launcher on its way out
        assert not seg.exists(), f"{seg} left behind"
    finally:
        for p in family:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if seg.exists():
            seg.unlink()
