"""Ctrl-C on `serve` (SIGINT to the terminal's whole process group) with a stream in flight: the node stops accepting,
lets it run for --drain-timeout-s, then ends it with the documented error event and `[DONE]`; its log has no
traceback and no warning, and its last line says the node stopped."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_ctrl_c_drains_and_ends_open_streams_with_the_error_event():
    proc = subprocess.Popen(
        [sys.executable, "-m", "mimo_epd", "serve", "--port", "0", "--http-port", "0", "--drain-timeout-s", "1"]
        + ["--llm-torch-threads", "1", "--shm-cache-bytes", str(32 << 20)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's: killpg is Ctrl-C
    )
    log: list[str] = []
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    http = None
    for line in proc.stdout:
        if line.startswith("http "):
            http = line.split()[1]
        if line.startswith("ready "):
            break
    assert http, "".join(log)[-2000:]
    events: list[str] = []
    started = threading.Event()

    def stream():
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(
            f"http://{http}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                if raw.strip():
                    events.append(raw.decode().strip())
                    started.set()

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(60)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 0
    client.join(30)
    assert not client.is_alive()
    assert 1 < len(events) < 3000 and events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"], error
    for _ in range(50):  # the stderr reader may still be catching up with the exited process
        if log and "node stopped" in log[-1]:
            break
        time.sleep(0.1)
    text = "".join(log)
    assert "node stopped" in log[-1], text[-2000:]
    assert "Traceback" not in text and " WARNING " not in text, text[-3000:]
