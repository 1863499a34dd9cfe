"""`mimo-epd bench video --transport`: one video's embeddings moved from a live encoder to an LLM worker's side,
as bytes in the gRPC reply vs over Mooncake's transfer engine (encoder --embedding-transfer tcp, the worker's
registered receive buffer), on this machine's loopback.

The encoder (`mimo-epd encoder`, a real process) encodes the video once; every timed round then asks for the same
item again (the content hash is sent, so the encoder answers from its cache without reading the file): what is
timed is the transport, from the request to the rows as a tensor in the caller. Rounds alternate between the two
transports; the rows of both are checked equal to the first reply's. Reported: the rows' bytes, per-transport
median and best seconds, and `ratios.transfer_vs_grpc_seconds` (median transfer / median gRPC: below 1, the
transfer engine is faster). Over TCP on one machine both paths copy through the kernel; RDMA between machines is
where the engine's advantage is meant to be, and cannot be measured here.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch
import xxhash

from mimo_epd.testing.servers import start_server
from mimo_epd.testing.video_gen import make_test_video
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc


def _log(msg: str) -> None:
    print(f"[bench video --transport] {msg}", file=sys.stderr, flush=True)


def _rows(item) -> torch.Tensor:
    dtype = getattr(torch, item.embedding.dtype)
    return torch.frombuffer(bytearray(item.embedding.data), dtype=dtype).view(*item.embedding.shape)


async def _rounds(address: str, item: encoder_pb2.MediaItem, rounds: int, buffer: int) -> tuple[dict, bool]:
    from llm_backend.server.media_transfer import EmbeddingReceiver

    receiver = EmbeddingReceiver(buffer, "127.0.0.1")
    try:
        return await _timed(address, item, rounds, receiver)
    finally:
        await receiver.close()


async def _timed(address: str, item: encoder_pb2.MediaItem, rounds: int, receiver) -> tuple[dict, bool]:
    mb = 1 << 30
    opts = [("grpc.max_receive_message_length", mb), ("grpc.max_send_message_length", mb)]
    async with grpc.aio.insecure_channel(address, options=opts) as ch:
        stub = encoder_pb2_grpc.EncoderStub(ch)
        t0 = time.perf_counter()
        first = await stub.Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=3600)
        encode_s = time.perf_counter() - t0
        want = _rows(first.items[0])
        seconds: dict[str, list[float]] = {"grpc": [], "transfer": []}
        equal = True
        for _ in range(rounds):
            t0 = time.perf_counter()
            resp = await stub.Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=600)
            rows = _rows(resp.items[0])
            seconds["grpc"].append(time.perf_counter() - t0)
            equal &= torch.equal(rows, want)
            t0 = time.perf_counter()
            resp = await stub.Encode(encoder_pb2.EncodeRequest(items=[item], hold=True), timeout=600)
            moved, _, _ = await receiver.take(resp.items, timeout=600)
            seconds["transfer"].append(time.perf_counter() - t0)
            equal &= torch.equal(moved[0], want)
    return {
        "encode_s": encode_s,
        "rows": list(want.shape),
        "bytes": want.numel() * want.element_size(),
        **seconds,
    }, equal


def main(args) -> dict:
    minutes = 10 / 60 if args.quick else args.minutes
    rounds = 2 if args.quick else args.rounds
    cache = Path(args.cache_dir).expanduser()
    path = Path(args.file or cache / f"test-video-{round(minutes * 60)}s-640x360.mp4")
    if not path.exists():
        _log(f"generating {path}")
        make_test_video(str(path), minutes * 60)
    digest = xxhash.xxh3_128_hexdigest(path.read_bytes())
    item = encoder_pb2.MediaItem(path=str(path), modality=encoder_pb2.VIDEO, content_hash=digest)
    buffer = 1 << 30
    enc = start_server(
        [
            "--model",
            args.model,
            "--allowed-local-dir",
            str(path.parent),
            "--embedding-transfer",
            "tcp",
            "--embedding-transfer-staging-bytes",
            str(buffer),
            "--max-message-mb",
            "1024",
            "--cache-bytes",
            str(2 << 30),
        ],
        timeout=300,
    )
    try:
        res, equal = asyncio.run(_rounds(enc.address, item, rounds, buffer))
    finally:
        enc.stop()
    med = {k: statistics.median(res[k]) for k in ("grpc", "transfer")}
    _log(f"{res['bytes'] >> 20} MiB of rows: grpc {med['grpc']:.3f}s, transfer {med['transfer']:.3f}s")
    return {
        "bench": "video-transport",
        "video": {"file": path.name, "seconds": round(minutes * 60, 1), "encode_s": round(res["encode_s"], 3)},
        "rows": res["rows"],
        "bytes": res["bytes"],
        "rounds": rounds,
        "transport": "tcp on loopback (one machine)",
        "seconds": {
            k: {"median": round(med[k], 4), "best": round(min(res[k]), 4), "all": [round(x, 4) for x in res[k]]}
            for k in ("grpc", "transfer")
        },
        "gb_per_s": {k: round(res["bytes"] / med[k] / 1e9, 3) for k in med},
        "outputs_match": bool(equal),
        "ratios": {"transfer_vs_grpc_seconds": round(med["transfer"] / med["grpc"], 3)},
    }
