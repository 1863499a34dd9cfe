"""The README's quick start, as a user runs it: `mimo-epd serve` started as the README says (only on free
ports instead of 50051/8000, so tests never collide), then each quick-start command through the installed
`mimo-epd` console script, checking its exit status and output; then the load test against that server
(zero failures), the error paths a user meets first, and a quiet shutdown.

The README's `https://example.com/cat.png` needs the internet, which tests do not have; a `data:` URI takes
its place (the same URL path through the server, no network)."""

import base64
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from mimo_epd.testing.media_server import MediaServer, jpeg_bytes, photo_like
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

MIMO_EPD = str(Path(sys.executable).parent / "mimo-epd")  # the console script, as in `.venv/bin/mimo-epd`


class Node:
    def __init__(self):
        self.proc = subprocess.Popen(
            [MIMO_EPD, "serve", "--port", "0", "--http-port", "0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=lambda: [self.stderr.append(x) for x in self.proc.stderr], daemon=True)
        self._reader.start()
        self.address = None
        for line in self.proc.stdout:
            if line.startswith("ready "):
                self.address = line.split()[1]
                break
        if self.address is None:
            self.proc.kill()
            raise RuntimeError("serve did not start: " + "".join(self.stderr)[-3000:])
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(10)  # all of stderr read
        return rc


@pytest.fixture(scope="module")
def node():
    n = Node()
    yield n
    n.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("quickstart")
    (d / "photo.jpg").write_bytes(jpeg_bytes(photo_like(480, 640, seed=3)))
    return d


def cli(*args, cwd, timeout=300):
    return subprocess.run([MIMO_EPD, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_health(node, workdir):
    r = cli("health", "--server", node.address, cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{node.address}: SERVING"


def test_encode_a_file_and_a_url_to_safetensors(node, workdir):
    jpg = base64.b64encode(jpeg_bytes(photo_like(64, 96, seed=5))).decode()
    data_uri = f"data:image/jpeg;base64,{jpg}"
    r = cli("encode", "--server", node.address, "photo.jpg", data_uri, "--out", "emb.safetensors", cwd=workdir)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert [x["item"] for x in lines] == ["photo.jpg", f"data:image/jpeg;{len(base64.b64decode(jpg))} bytes"]
    for x in lines:
        assert len(x["key"]) == 32 and x["num_tokens"] > 0 and x["dim"] > 0 and x["dtype"] == "float32"
        assert x["num_tokens"] == np.prod(x["grid_thw"]) // 4
    assert "saved 2 embeddings to emb.safetensors" in r.stderr
    with safe_open(str(workdir / "emb.safetensors"), "np") as f:
        meta = f.metadata()
        items = json.loads(meta["items"])
        assert [(i["item"], i["key"]) for i in items] == [(x["item"], x["key"]) for x in lines]
        for x in lines:
            assert f.get_tensor(x["key"]).shape == (x["num_tokens"], x["dim"])
    # encoding the same file again is a cache hit with the same key
    again = json.loads(cli("encode", "--server", node.address, "photo.jpg", cwd=workdir).stdout)
    assert again["key"] == lines[0]["key"] and again["cache_hit"]


def test_generate_with_an_image(node, workdir):
    r = cli(
        "generate", "--server", node.address, "--prompt", "What is in the picture?", "--image", "photo.jpg", cwd=workdir
    )
    assert r.returncode == 0, r.stderr
    final = json.loads(r.stderr.strip().splitlines()[-1])
    assert final["media_tokens"] > 0 and final["completion_tokens"] > 0 and final["prompt_tokens"] > 0
    assert r.stdout.endswith("\n")


def test_loadtest_against_serve_has_zero_failures(node, workdir):
    r = cli(
        "loadtest",
        "encoder",
        "--server",
        node.address,
        "--run-time",
        "10s",
        "--users",
        "2",
        "--csv-dir",
        str(workdir / "lt"),
        cwd=workdir,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["requests"] > 0 and summary["failures"] == 0 and summary["failures_by_status"] == {}


def test_loadtest_urls_against_serve_name_the_allowlist_flag(node, workdir):
    r = cli("loadtest", "encoder", "--server", node.address, "--urls", "--run-time", "2s", cwd=workdir)
    assert r.returncode == 2
    assert "refuses the load test's media URLs" in r.stderr and "--url-allowlist 127.0.0.1/32" in r.stderr, r.stderr


def test_unknown_health_service_lists_the_known_ones(node, workdir):
    r = cli("health", "--server", node.address, "--service", "nosuch", cwd=workdir)
    assert r.returncode == 1
    assert "unknown service 'nosuch'" in r.stderr and "'mimo_epd.v1.Encoder'" in r.stderr, r.stderr
    assert "'mimo_epd.v1.Generator'" in r.stderr


def test_a_refused_url_names_the_item_and_the_policy(node, workdir):
    with MediaServer({"a.jpg": (workdir / "photo.jpg").read_bytes()}) as media:
        url = media.url("a.jpg")
        r = cli("encode", "--server", node.address, "photo.jpg", url, cwd=workdir)
    assert r.returncode == 1 and r.stdout == ""
    assert f"PERMISSION_DENIED: item 1 ({url}):" in r.stderr and "--url-allowlist" in r.stderr, r.stderr


def test_ctrl_c_shuts_down_quietly(node):
    rc = node.stop()
    log = "".join(node.stderr)
    assert rc == 0, log[-3000:]
    shutdown = log[log.index("shutting down: routers first") :]
    # the node stopping its own encoders is not an encoder failure (under heavy CPU load a health check may
    # still time out while serving; that is a real event, so only the shutdown is checked)
    assert "left the ring" not in shutdown, shutdown
    assert "fork_posix" not in log and "skipping fork() handlers" not in log  # gRPC's fork-handler notice
