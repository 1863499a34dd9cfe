"""Decode behaviour through the real gRPC server: a killed decode process, truncated files, every
documented format, tiny and elongated images and video frames, Ctrl-C."""

from __future__ import annotations

import os
import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mimo_epd.v1 import encoder_pb2 as pb
from mimo_epd.v1 import encoder_pb2_grpc
from tests.conftest import encode_image, start_server, textured

JPEG = encode_image(textured(240, 320, seed=1), "JPEG", quality=90)


def stubs(address: str):
    ch = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)])
    return encoder_pb2_grpc.EncoderStub(ch), health_pb2_grpc.HealthStub(ch)


def encode(address: str, *items: pb.MediaItem, timeout: float = 120) -> pb.EncodeResponse:
    return stubs(address)[0].Encode(pb.EncodeRequest(items=list(items)), timeout=timeout)


def expect_error(address: str, code: grpc.StatusCode, fragment: str, *items: pb.MediaItem) -> str:
    with pytest.raises(grpc.RpcError) as ei:
        encode(address, *items)
    assert ei.value.code() == code, ei.value.details()
    assert fragment.lower() in ei.value.details().lower(), ei.value.details()
    return ei.value.details()


def decode_workers(server_pid: int) -> list[int]:
    """The server's decode processes: its children started by multiprocessing's spawn (the resource tracker,
    also a child, runs `resource_tracker`)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read().rsplit(") ", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat[1]) == server_pid and stat[0] != "Z" and b"spawn_main" in cmd:
            out.append(int(name))
    return sorted(out)


def settled_workers(server_pid: int, n: int = 2, timeout_s: float = 60.0) -> list[int]:
    """The decode processes once `n` of them run (a replaced pool starts its processes a moment after the old one
    is reaped), or what there is when the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = decode_workers(server_pid)
        if len(pids) >= n or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server():
    s = start_server(["--decode-workers", "2", "--max-items-per-request", "16"])
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)[-3000:]


# ------------------------------------------------------------------------------- 1. a decode process dies
def test_sigkilled_decode_process_is_replaced_and_requests_keep_succeeding(server):
    before = encode(server.address, pb.MediaItem(data=JPEG)).items[0]
    workers = decode_workers(server.proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)  # what the OOM killer does
    # Several requests, distinct bytes (no cache hits), several items each.
    for i in range(4):
        items = [pb.MediaItem(data=encode_image(textured(200 + i, 300, seed=10 + i * 3 + j), "JPEG")) for j in range(3)]
        r = encode(server.address, *items)
        assert [it.num_tokens for it in r.items] and all(it.num_tokens > 0 for it in r.items)
    again = encode(
        server.address,
        pb.MediaItem(data=encode_image(textured(240, 320, seed=1), "JPEG", quality=90, comment=b"not a cache hit")),
    ).items[0]
    assert np.array_equal(np.frombuffer(again.embedding.data, "<f4"), np.frombuffer(before.embedding.data, "<f4"))
    _, health = stubs(server.address)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    now = settled_workers(server.proc.pid)
    assert len(now) == 2 and workers[0] not in now
    assert any("replaced the decode processes" in line for line in server.stderr_lines)


def test_decode_process_killed_while_requests_are_in_flight(server):
    big = [pb.MediaItem(data=encode_image(textured(1500, 2000, seed=40 + j), "PNG")) for j in range(4)]
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(encode, server.address, *big[i : i + 2]) for i in (0, 2)]
        time.sleep(0.5)
        workers = decode_workers(server.proc.pid)
        assert workers
        os.kill(workers[-1], signal.SIGKILL)
        results = [f.result() for f in futs]
    assert all(it.num_tokens > 0 for r in results for it in r.items)
    # The pool was replaced and decodes again (the previous test checks the process count after an idle kill).
    assert any("replaced the decode processes" in x for x in server.stderr_lines)
    later = encode(server.address, pb.MediaItem(data=encode_image(textured(200, 300, seed=77), "JPEG"))).items[0]
    assert later.num_tokens > 0


# ------------------------------------------------------------------------------- 2. truncated JPEG
def test_half_a_jpeg_with_an_end_marker_is_invalid_argument(server):
    data = encode_image(textured(480, 640, seed=5), "JPEG", quality=90)
    cut = data[: len(data) // 2] + b"\xff\xd9"
    msg = expect_error(
        server.address, grpc.StatusCode.INVALID_ARGUMENT, "truncated", pb.MediaItem(data=JPEG), pb.MediaItem(data=cut)
    )
    assert msg.startswith("item 1:"), msg
    assert encode(server.address, pb.MediaItem(data=data)).items[0].num_tokens > 0


# ------------------------------------------------------------------------------- 3. every documented format
def test_every_documented_format_through_the_server(server):
    from tests.encoder.test_decode_formats import FORMATS, sample

    names = sorted(FORMATS)
    r = encode(server.address, *(pb.MediaItem(data=sample(n)) for n in names))
    assert len(r.items) == len(names)
    # 61x83 -> smart_resize (qwen2_5_vl) 56x84 -> 4x6 patches -> 6 tokens after the 2x2 merge
    assert [it.num_tokens for it in r.items] == [6] * len(names)
    png = np.frombuffer(r.items[names.index("PNG")].embedding.data, "<f4")
    for lossless in ("BMP", "TIFF", "TIFF-deflate", "WEBP"):  # same pixels, same embedding
        np.testing.assert_allclose(np.frombuffer(r.items[names.index(lossless)].embedding.data, "<f4"), png, atol=1e-5)


# ------------------------------------------------------------------------------- 4. tiny and elongated items
def test_images_smaller_than_the_factor_are_scaled_up_as_the_reference_does(server):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference

    sizes = [(10, 10), (1, 1), (20, 27), (5, 900)]
    r = encode(server.address, *(pb.MediaItem(data=encode_image(textured(h, w, seed=h + w), "PNG")) for h, w in sizes))
    for (h, w), it in zip(sizes, r.items):
        th, tw = reference(h, w, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
        assert it.num_tokens == (th // 28) * (tw // 28), (h, w)
    expect_error(
        server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        "item 1: image is 402x2; aspect ratio",
        pb.MediaItem(data=JPEG),
        pb.MediaItem(data=encode_image(textured(2, 402), "PNG")),
    )


def test_tiny_and_elongated_video_frames(server, tmp_path):
    from tests.video.test_video import tiny_video

    tiny = open(tiny_video(str(tmp_path / "tiny.mp4"), 16, 16), "rb").read()
    r = encode(server.address, pb.MediaItem(data=tiny, modality=pb.VIDEO)).items[0]
    assert r.num_tokens > 0 and r.video.frames_sampled == 4
    thin = open(tiny_video(str(tmp_path / "thin.mp4"), 402, 2), "rb").read()
    expect_error(
        server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        "item 1: video: frames are 402x2; aspect ratio",
        pb.MediaItem(data=JPEG),
        pb.MediaItem(data=thin, modality=pb.VIDEO),
    )
    assert encode(server.address, pb.MediaItem(data=JPEG)).items[0].num_tokens > 0


# ------------------------------------------------------------------------------- 5. Ctrl-C, clean startup
def test_ctrl_c_to_the_process_group_stops_cleanly_without_worker_tracebacks(tmp_path):
    """What a terminal's Ctrl-C does: SIGINT to every process of the group, the decode processes included.
    They ignore it and the server shuts them down; startup prints no warnings either."""
    import subprocess
    import sys
    import threading

    from tests.conftest import ROOT
    from tests.video.test_video import tiny_video

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mimo_epd",
            "encoder",
            "--port",
            "0",
            "--decode-workers",
            "2",
            "--video-decode-workers",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # its own group, not pytest's
    err: list[str] = []
    reader = threading.Thread(target=lambda: [err.append(x) for x in proc.stderr], daemon=True)
    reader.start()
    try:
        line = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not line.startswith("ready "):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("ready "), "".join(err)[-3000:]
        address = line.split()[1]
        assert encode(address, pb.MediaItem(data=JPEG)).items[0].num_tokens > 0
        assert len(decode_workers(proc.pid)) == 2
        video = open(tiny_video(str(tmp_path / "v.mp4"), 64, 48, frames=40), "rb").read()
        assert encode(address, pb.MediaItem(data=video, modality=pb.VIDEO)).items[0].num_tokens > 0
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    text = "".join(err)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "Warning" not in text, text[-3000:]  # e.g. torch's non-writable NumPy array warning at warm-up
