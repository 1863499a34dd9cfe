"""Limits and client input through the real server: a reply over --max-message-mb is refused before the
forward (INVALID_ARGUMENT naming the sizes), and paths the filesystem cannot open (a NUL byte, a
component over NAME_MAX, a path over PATH_MAX) are INVALID_ARGUMENT naming the item, never INTERNAL."""

from __future__ import annotations

import socket

import grpc
import pytest

from mimo_epd.testing.servers import scrape
from mimo_epd.v1 import encoder_pb2 as pb
from tests.conftest import encode_image, start_server, textured
from tests.integration.test_encoder_server import encode, expect_error

pytestmark = pytest.mark.integration

# 480x640 -> grid 1x34x46 -> 391 tokens x 256 (tiny tower) x 4 bytes = 391 KiB of embedding per image
IMAGES = [encode_image(textured(480, 640, seed=60 + i), "JPEG") for i in range(3)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "ok.jpg").write_bytes(IMAGES[0])
    (d / "subdir").mkdir()
    return d


@pytest.fixture(scope="module")
def server(local_dir):
    port = free_port()
    s = start_server(
        [
            "--max-message-mb",
            "1",
            "--decode-workers",
            "0",
            "--allowed-local-dir",
            str(local_dir),
            "--metrics-port",
            str(port),
        ]
    )
    s.metrics_port = port
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)[-2000:]


def encoded_items(server) -> float:
    return scrape(server.metrics_port).get("encoder_batch_items_sum", 0.0)


def test_reply_over_max_message_is_refused_before_the_forward(server):
    before = encoded_items(server)
    details = expect_error(
        server.address, grpc.StatusCode.INVALID_ARGUMENT, "--max-message-mb", *[pb.MediaItem(data=b) for b in IMAGES]
    )
    assert details.startswith("item 2: "), details  # the item that pushed the reply over the limit
    assert "391 tokens x 256 x 4 bytes" in details and "1 MiB" in details, details
    assert encoded_items(server) - before <= 2, "the refused item was run through the tower anyway"
    # Two of them fit in 1 MiB and are answered.
    r = encode(server.address, *[pb.MediaItem(data=b) for b in IMAGES[:2]])
    assert [it.num_tokens for it in r.items] == [391, 391]


def test_reply_over_max_message_from_cache_hits_is_refused_too(server):
    encode(server.address, pb.MediaItem(data=IMAGES[0]))  # cached now; the rest of the request as well
    details = expect_error(
        server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        "--max-message-mb",
        *[pb.MediaItem(data=IMAGES[0]) for _ in range(3)],
    )
    assert "item 2: " in details


@pytest.mark.parametrize(
    "name,make,fragment",
    [
        ("nul-byte", lambda d: f"{d}/ok\x00.jpg", "NUL byte"),
        ("long-component", lambda d: f"{d}/{'x' * 300}.jpg", "NAME_MAX"),
        ("long-path", lambda d: f"{d}/" + "a/" * 2100 + "x.jpg", "PATH_MAX"),
        ("directory", lambda d: f"{d}/subdir", "no such file"),
    ],
)
def test_unopenable_paths_are_client_errors_naming_the_item(server, local_dir, name, make, fragment):
    code = grpc.StatusCode.NOT_FOUND if name == "directory" else grpc.StatusCode.INVALID_ARGUMENT
    details = expect_error(
        server.address, code, fragment, pb.MediaItem(data=IMAGES[1]), pb.MediaItem(path=make(local_dir))
    )
    assert details.startswith("item 1: "), details
    assert encode(server.address, pb.MediaItem(path=str(local_dir / "ok.jpg"))).items[0].num_tokens == 391
