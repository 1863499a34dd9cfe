"""Fetch fairness through the real server: inline and path items never wait behind slow URL downloads,
and one slow host holds at most --fetch-per-host of the --fetch-concurrency fetch slots.

The assertions are about order, not time: an item must be answered while the slow downloads it used to
queue behind are still in progress (the media server has received them and not yet answered any)."""

from __future__ import annotations

import time

import grpc
import pytest

from mimo_epd.v1 import encoder_pb2 as pb
from tests.conftest import encode_image, start_server, textured
from tests.encoder.media import MediaServer
from tests.integration.test_encoder_server import stub

pytestmark = pytest.mark.integration

JPEG = encode_image(textured(120, 160, seed=31), "JPEG")
SLOW_S = 6.0


@pytest.fixture(scope="module")
def slow_host():
    m = MediaServer({"photo.jpg": JPEG}, slow_s=SLOW_S, host="127.0.0.1").start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def fast_host():
    m = MediaServer({"photo.jpg": encode_image(textured(130, 170, seed=32), "JPEG")}, host="127.0.0.2").start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "p.jpg").write_bytes(encode_image(textured(140, 150, seed=33), "JPEG"))
    return d


@pytest.fixture(scope="module")
def server(local_dir):
    s = start_server(
        [
            "--url-allowlist",
            "127.0.0.0/8",
            "--fetch-concurrency",
            "2",
            "--fetch-per-host",
            "1",
            "--fetch-timeout-s",
            "60",
            "--decode-workers",
            "0",
            "--cache-bytes",
            "0",
            "--allowed-local-dir",
            str(local_dir),
        ]
    )
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)[-2000:]


def wait_for(cond, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def slow_urls(host: MediaServer, tag: str, n: int) -> list[str]:
    return [f"{host.url}/slow-{tag}-{i}" for i in range(n)]


def test_inline_and_path_items_do_not_wait_behind_slow_urls(server, slow_host, local_dir):
    enc, _ = stub(server.address)
    urls = slow_urls(slow_host, "a", 2)  # both fetch slots busy, were the per-host cap absent
    slow = [enc.Encode.future(pb.EncodeRequest(items=[pb.MediaItem(url=u)]), timeout=120) for u in urls]
    try:
        wait_for(lambda: sum(slow_host.hits[u.rsplit("/", 1)[1]] for u in urls) >= 1, "a slow download to start")
        inline = enc.Encode(pb.EncodeRequest(items=[pb.MediaItem(data=JPEG)]), timeout=60).items[0]
        path = enc.Encode(pb.EncodeRequest(items=[pb.MediaItem(path=str(local_dir / "p.jpg"))]), timeout=60).items[0]
        assert inline.num_tokens > 0 and path.num_tokens > 0
        assert sum(slow_host.finished.values()) == 0, "the inline/path items waited for a slow download"
    finally:
        for f in slow:
            assert f.result().items[0].num_tokens > 0  # the slow ones still succeed


def test_one_slow_host_cannot_take_every_fetch_slot(server, slow_host, fast_host):
    enc, _ = stub(server.address)
    urls = slow_urls(slow_host, "b", 3)
    slow = [enc.Encode.future(pb.EncodeRequest(items=[pb.MediaItem(url=u)]), timeout=120) for u in urls]
    try:
        wait_for(lambda: sum(slow_host.hits[u.rsplit("/", 1)[1]] for u in urls) >= 1, "a slow download to start")
        time.sleep(0.5)  # give a second slow download the chance to start, were the cap not enforced
        started = sum(slow_host.hits[u.rsplit("/", 1)[1]] for u in urls)
        assert started == 1, f"{started} downloads from one host at once with --fetch-per-host 1"
        r = enc.Encode(pb.EncodeRequest(items=[pb.MediaItem(url=f"{fast_host.url}/photo.jpg")]), timeout=60)
        assert r.items[0].num_tokens > 0
        assert sum(slow_host.finished[u.rsplit("/", 1)[1]] for u in urls) == 0, "the fast host waited for the slow one"
    finally:
        for f in slow:
            assert f.result().items[0].num_tokens > 0


def test_more_items_than_max_pending_is_invalid_not_retry():
    s = start_server(["--max-pending", "3", "--decode-workers", "0"])
    try:
        enc, _ = stub(s.address)
        with pytest.raises(grpc.RpcError) as ei:
            enc.Encode(pb.EncodeRequest(items=[pb.MediaItem(data=JPEG)] * 4), timeout=60)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
        assert "--max-pending 3" in ei.value.details() and "4 items" in ei.value.details()
        assert len(enc.Encode(pb.EncodeRequest(items=[pb.MediaItem(data=JPEG)] * 3), timeout=60).items) == 3
    finally:
        assert s.stop() == 0
