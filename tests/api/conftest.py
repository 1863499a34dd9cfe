"""Real servers for the HTTP API tests: an encoder (URL allowlist for the loopback media server, a small
item limit and a short fetch deadline so size and timeout errors can be provoked), a loopback media server
(images, a path that 404s, a socket that never answers) and an LLM worker with its HTTP API on a free port."""

from __future__ import annotations

import re
import socket
import threading
import urllib.request

import pytest

from mimo_epd.testing.media_server import MediaServer
from tests.conftest import encode_image, start_server, textured

ITEM_LIMIT = 300_000


@pytest.fixture(scope="session")
def images() -> dict[str, bytes]:
    return {
        "a.jpg": encode_image(textured(200, 300, seed=3), "JPEG"),
        "b.jpg": encode_image(textured(200, 300, seed=4), "JPEG"),
    }


@pytest.fixture(scope="session")
def media(images):
    with MediaServer(images) as m:
        yield m


@pytest.fixture(scope="session")
def silent_port():
    """A TCP port that accepts connections and never answers (a fetch there runs into its deadline)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(s.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield s.getsockname()[1]
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    s.close()


@pytest.fixture(scope="session")
def api_encoder():
    s = start_server(
        [
            "--decode-workers",
            "1",
            "--url-allowlist",
            "127.0.0.1/32",
            "--fetch-timeout-s",
            "1",
            "--max-item-bytes",
            str(ITEM_LIMIT),
        ]
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def worker(api_encoder):
    s = start_server(
        [
            "--model",
            "tiny-random",  # the byte tokenizer: the tests below reason about bytes
            "--encoder",
            api_encoder.address,
            "--http-port",
            "0",
            "--kv-cache-tokens",
            "6000",
            "--swa-cache-tokens",
            "1500",
            "--max-running",
            "2",
            "--max-waiting",
            "1",
        ],
        subcommand="llm",
    )
    assert s.http_address, "the worker printed no `http HOST:PORT` line before `ready`"
    yield s
    assert s.stop() == 0


def scrape(http_address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([^#\s]\S*)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


@pytest.fixture(scope="session")
def front(worker):
    """`mimo-epd router` with its HTTP front over the API tests' worker (the same tokenizer: tiny-random)."""
    s = start_server(
        ["--workers", f"{worker.address}/{worker.http_address}", "--http-port", "0", "--model", "tiny-random"], "router"
    )
    assert s.http_address
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="session")
def tiny_worker():
    """An LLM worker on the shipped `tiny` model (its tokenizer and chat template), HTTP on a free port: the
    Anthropic API and lm-evaluation-harness tests share it."""
    s = start_server(["--model", "tiny", "--http-port", "0", "--torch-threads", "1"], "llm")
    yield s
    assert s.stop() == 0
