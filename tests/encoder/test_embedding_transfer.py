"""Embeddings over Mooncake's transfer engine (encoder --embedding-transfer, worker --encoder-transfer): the rows a
worker receives equal the gRPC reply's; an encoder killed between Encode and Transfer costs one fallback and frees
the worker's buffer at once; a hold that nobody takes expires; a worker's generation with media is the same
either way, and its metrics say which transport carried the bytes."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import torch

from mimo_epd.common.transfer_buffer import ALIGN, RangeAllocator
from mimo_epd.testing.redis_server import free_port
from mimo_epd.testing.servers import scrape, start_server
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc, generator_pb2, generator_pb2_grpc
from tests.conftest import encode_image, textured

mooncake = pytest.importorskip("mooncake.engine")

TRANSFER = ["--embedding-transfer", "tcp", "--embedding-transfer-staging-bytes", str(32 << 20)]


def test_ranges_are_first_fit_aligned_and_merge_when_freed():
    r = RangeAllocator(4 * ALIGN)
    a, b, c = r.alloc(1), r.alloc(ALIGN + 1), r.alloc(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and r.alloc(1) is None
    r.free(b)
    assert r.alloc(3 * ALIGN) is None  # two free pages, not three
    r.free(a)
    assert r.alloc(3 * ALIGN) == 0  # a and b merged
    r.free(0)
    r.free(c)
    assert r.used_bytes == 0 and r.alloc(4 * ALIGN) == 0


def _rows(item) -> torch.Tensor:
    return torch.frombuffer(bytearray(item.embedding.data), dtype=getattr(torch, item.embedding.dtype)).view(
        *item.embedding.shape
    )


async def _encode(address: str, images: list[bytes], hold: bool):
    async with grpc.aio.insecure_channel(address) as ch:
        req = encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(data=d) for d in images], hold=hold)
        return await encoder_pb2_grpc.EncoderStub(ch).Encode(req, timeout=60)


async def _scenario(a, b) -> None:
    from llm_backend.server.media_transfer import EmbeddingReceiver, MediaTransferFailed

    images = [encode_image(textured(96, 64 + 32 * i, seed=60 + i)) for i in range(3)]
    receiver = EmbeddingReceiver(16 << 20, "127.0.0.1")
    try:
        want = await _encode(b.address, images, hold=False)
        got = await _encode(b.address, images, hold=True)
        assert all(it.HasField("held") and not it.embedding.data for it in got.items)
        assert {it.held.encoder for it in got.items} == {b.address}
        moved, n, _ = await receiver.take(got.items, timeout=30)
        assert n == sum(len(it.embedding.data) for it in want.items) and receiver.buf.ranges.used_bytes == 0
        for i, it in enumerate(want.items):
            assert torch.equal(moved[i], _rows(it))

        # the encoder dies between Encode and Transfer: the take fails at once and frees the buffer
        held = await _encode(a.address, images, hold=True)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(MediaTransferFailed) as ei:
            await receiver.take(held.items, timeout=30)
        assert ei.value.reason == "failed" and a.address in str(ei.value)
        assert time.monotonic() - t0 < 10 and receiver.buf.ranges.used_bytes == 0

        # a Transfer for a hold that expired (--embedding-transfer-hold-s 1) is refused, never another item's rows
        stale = await _encode(b.address, images[:1], hold=True)
        await asyncio.sleep(2.5)
        with pytest.raises(MediaTransferFailed, match="not here"):
            await receiver.take(stale.items, timeout=30)
        assert receiver.buf.ranges.used_bytes == 0
    finally:
        await receiver.close()


def test_rows_over_the_transfer_engine_equal_the_reply_and_survive_a_killed_encoder():
    a = start_server([*TRANSFER, "--decode-workers", "1"])
    port = free_port()
    b = start_server(
        [*TRANSFER, "--decode-workers", "1", "--embedding-transfer-hold-s", "1", "--metrics-port", str(port)]
    )
    try:
        asyncio.run(_scenario(a, b))
        m = scrape(port)
        assert m['encoder_transfer_total{event="sent"}'] == 3
        assert m['encoder_transfer_total{event="expired"}'] == 1 and m["encoder_transfer_held_bytes"] == 0
        assert m['encoder_transfer_bytes_total{transport="mooncake"}'] > 0
    finally:
        a.stop()
        b.stop()


def _generate(address: str, img: bytes) -> list[int]:
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    req = generator_pb2.GenerateRequest(
        prompt="Describe:",
        media=[encoder_pb2.MediaItem(data=img)],
        sampling=generator_pb2.SamplingOptions(max_tokens=8),
    )
    return [t for m in stub.Generate(req, timeout=120) if m.HasField("delta") for t in m.delta.token_ids]


def test_a_worker_generates_the_same_with_rows_over_the_transfer_engine():
    enc = start_server([*TRANSFER, "--decode-workers", "1"])
    base = ["--model", "tiny-random", "--encoder", enc.address, "--kv-cache-tokens", "4096"]
    base += ["--swa-cache-tokens", "1024", "--torch-threads", "1"]
    plain = start_server(base, "llm")
    # hidden 256 x float32: 1 KiB a row; a 128 KiB buffer takes the small image's 30 rows, not the big one's 256
    moved = start_server([*base, "--encoder-transfer", "tcp", "--encoder-transfer-buffer-bytes", str(128 << 10)], "llm")
    try:
        img = encode_image(textured(160, 128, seed=71), "JPEG")
        assert _generate(moved.address, img) == _generate(plain.address, img)
        m = scrape(int(moved.http_address.rsplit(":", 1)[1]))
        assert m['llm_media_bytes_total{transport="mooncake"}'] == 30 * 1024
        assert m.get('llm_media_bytes_total{transport="grpc"}', 0) == 0
        big = encode_image(textured(448, 448, seed=72), "JPEG")  # no room: asked again as bytes, the same output
        assert _generate(moved.address, big) == _generate(plain.address, big)
        m = scrape(int(moved.http_address.rsplit(":", 1)[1]))
        assert m['llm_media_transfer_fallbacks_total{reason="no_room"}'] == 1
        assert m['llm_media_bytes_total{transport="grpc"}'] == 256 * 1024
        p = scrape(int(plain.http_address.rsplit(":", 1)[1]))
        assert p['llm_media_bytes_total{transport="grpc"}'] > 0
    finally:
        for s in (moved, plain, enc):
            s.stop()


def _total(metrics: dict[str, float], name: str, *labels: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(name) and all(x in k for x in labels))


def test_serve_moves_media_rows_over_the_transfer_engine_and_survives_a_killed_encoder():
    """`serve --embedding-transfer tcp --llm-encoder-transfer tcp`: the flags reach every process, the node's
    encoder router forwards `hold` and names the encoder, and after one encoder is killed every generation with
    media still succeeds (moved from the other encoder, or as bytes once)."""
    import os

    from mimo_epd.testing.redis_server import free_ports_from
    from tests.integration.test_node import encoders_of

    port = free_ports_from(3)  # the node's metrics, then its two encoders'
    node = start_server(
        [
            *TRANSFER,
            "--encoders",
            "2",
            "--llm-model",
            "tiny-random",
            "--llm-workers",
            "1",
            "--llm-encoder-transfer",
            "tcp",
            "--llm-encoder-transfer-buffer-bytes",
            str(8 << 20),
            "--llm-kv-cache-tokens",
            "4096",
            "--llm-swa-cache-tokens",
            "1024",
            "--http-port",
            "-1",
            "--metrics-port",
            str(port),
        ],
        "serve",
        timeout=240,
    )
    try:
        for i in range(3):
            assert len(_generate(node.address, encode_image(textured(120, 96 + 16 * i, seed=80 + i), "JPEG"))) == 8
        m = scrape(port)
        assert _total(m, "llm_media_bytes_total", 'transport="mooncake"') > 0
        assert _total(m, "llm_media_bytes_total", 'transport="grpc"') == 0
        assert _total(m, "encoder_transfer_total", 'event="sent"') == 3
        victim = next(iter(encoders_of(node).values()))
        os.kill(victim, signal.SIGKILL)
        for i in range(6):
            assert len(_generate(node.address, encode_image(textured(120, 96, seed=90 + i), "JPEG"))) == 8
    finally:
        node.stop()
