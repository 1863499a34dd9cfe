"""The encoder server as users run it: a subprocess on a free loopback port, spoken to over gRPC.

Two servers: `server` with the default URL policy (every private address refused), and
`url_server` that may fetch from 127.0.0.1 only (`--url-allowlist 127.0.0.1/32`), to fetch from a
real local aiohttp media server. No traffic leaves the machine: refusals are decided before connecting.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from mimo_epd.common.content_key import bytes_digest
from mimo_epd.v1 import encoder_pb2 as pb
from mimo_epd.v1 import encoder_pb2_grpc
from tests.conftest import ROOT, encode_image, start_server, textured

pytestmark = pytest.mark.integration

JPEG = encode_image(textured(480, 640, seed=1), "JPEG", quality=90)


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def local_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "photo.jpg").write_bytes(JPEG)
    return d


@pytest.fixture(scope="module")
def server(local_dir):
    s = start_server(
        [
            "--max-item-bytes",
            "3000000",
            "--max-image-pixels",
            "6000000",
            "--max-items-per-request",
            "8",
            "--allowed-local-dir",
            str(local_dir),
            "--decode-workers",
            "2",
        ]
    )
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)[-2000:]


@pytest.fixture(scope="module")
def media_server():
    """A real HTTP server on 127.0.0.1 serving test media, redirects, errors and a slow endpoint."""
    png = encode_image(textured(300, 400, seed=2), "PNG")

    async def slow(_req):
        await asyncio.sleep(5)
        return web.Response(body=JPEG, content_type="image/jpeg")

    def respond(make):
        async def handler(_req):
            return make()

        return handler

    def redirect(location):
        async def handler(_req):
            raise web.HTTPFound(location)

        return handler

    app = web.Application()
    app.router.add_get("/photo.jpg", respond(lambda: web.Response(body=JPEG, content_type="image/jpeg")))
    app.router.add_get("/photo.png", respond(lambda: web.Response(body=png, content_type="image/png")))
    app.router.add_get("/to-photo", redirect("/photo.jpg"))
    app.router.add_get("/to-metadata", redirect("http://169.254.169.254/latest/meta-data/"))
    app.router.add_get("/to-private", redirect("http://10.0.0.1/x.jpg"))
    app.router.add_get("/slow", slow)
    app.router.add_get("/server-error", respond(lambda: web.Response(status=503)))

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


@pytest.fixture(scope="module")
def url_server(media_server):
    s = start_server(["--url-allowlist", "127.0.0.1/32", "--fetch-timeout-s", "1.5", "--decode-workers", "1"])
    yield s
    assert s.stop() == 0


def stub(address: str):
    ch = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)])
    return encoder_pb2_grpc.EncoderStub(ch), health_pb2_grpc.HealthStub(ch)


def encode(address: str, *items: pb.MediaItem, timeout: float = 60) -> pb.EncodeResponse:
    enc, _ = stub(address)
    return enc.Encode(pb.EncodeRequest(items=list(items)), timeout=timeout)


def assert_serving(address: str) -> None:
    _, health = stub(address)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    # ...and it still encodes.
    assert encode(address, pb.MediaItem(data=JPEG)).items[0].num_tokens == 391


def emb_array(item: pb.ItemEmbedding) -> np.ndarray:
    assert item.embedding.dtype == "float32"
    return np.frombuffer(item.embedding.data, dtype="<f4").reshape(list(item.embedding.shape))


def expect_error(address: str, code: grpc.StatusCode, fragment: str, *items: pb.MediaItem) -> str:
    with pytest.raises(grpc.RpcError) as ei:
        encode(address, *items)
    err = ei.value
    assert err.code() == code, err.details()
    assert fragment.lower() in err.details().lower(), err.details()
    return err.details()


# ----------------------------------------------------------------------------------- happy paths
def test_jpeg_shapes_follow_grid_math(server):
    r = encode(server.address, pb.MediaItem(data=JPEG, modality=pb.IMAGE)).items[0]
    # 480x640 -> smart_resize (factor 28) -> 476x644 -> grid 34x46 patches -> 391 tokens after 2x2 merge.
    assert list(r.grid_thw) == [1, 34, 46]
    assert r.num_tokens == 34 * 46 // 4
    assert list(r.embedding.shape) == [391, 256]
    assert len(r.embedding.data) == 391 * 256 * 4
    assert len(r.content_key) == 32
    assert np.isfinite(emb_array(r)).all()


def test_same_image_twice_same_key_identical_embedding(server):
    img = encode_image(textured(333, 517, seed=7), "JPEG")
    a = encode(server.address, pb.MediaItem(data=img)).items[0]
    b = encode(server.address, pb.MediaItem(data=img)).items[0]
    assert a.content_key == b.content_key
    assert a.embedding.data == b.embedding.data
    assert not a.cache_hit and b.cache_hit
    other = encode(server.address, pb.MediaItem(data=encode_image(textured(333, 517, seed=8), "JPEG"))).items[0]
    assert other.content_key != a.content_key
    assert not np.allclose(emb_array(other), emb_array(a))


def test_png_with_alpha_is_composited_on_white(server):
    rgba = np.zeros((200, 300, 4), np.uint8)
    rgba[..., :3] = textured(200, 300, seed=3)  # colour under a fully transparent alpha: must not show
    transparent = Image.fromarray(rgba, "RGBA")
    buf = io.BytesIO()
    transparent.save(buf, "PNG")
    white = encode_image(np.full((200, 300, 3), 255, np.uint8), "PNG")
    a, b = encode(server.address, pb.MediaItem(data=buf.getvalue()), pb.MediaItem(data=white)).items
    assert a.content_key != b.content_key
    np.testing.assert_array_equal(emb_array(a), emb_array(b))


def test_cmyk_jpeg(server):
    cmyk = encode_image(textured(240, 320, seed=4), "JPEG", mode="CMYK")
    assert Image.open(io.BytesIO(cmyk)).mode == "CMYK"
    r = encode(server.address, pb.MediaItem(data=cmyk)).items[0]
    assert list(r.grid_thw) == [1, 18, 22]


def test_exif_rotation_is_applied(server):
    arr = textured(480, 640, seed=5)
    plain = encode_image(arr, "JPEG", quality=95)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": a landscape file that is shown as portrait
    rotated = encode_image(arr, "JPEG", quality=95, exif=exif.tobytes())
    upright = encode_image(np.ascontiguousarray(np.rot90(arr, k=-1)), "JPEG", quality=95)
    a, b, c = encode(
        server.address, pb.MediaItem(data=plain), pb.MediaItem(data=rotated), pb.MediaItem(data=upright)
    ).items
    assert list(a.grid_thw) == [1, 34, 46]
    assert list(b.grid_thw) == [1, 46, 34]
    assert list(b.grid_thw) == list(c.grid_thw)


def test_data_uri(server):
    png = encode_image(textured(100, 150, seed=6), "PNG")
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    a = encode(server.address, pb.MediaItem(url=uri)).items[0]
    b = encode(server.address, pb.MediaItem(data=png)).items[0]
    assert a.content_key == b.content_key and a.embedding.data == b.embedding.data


def test_local_path_under_allowed_dir(server, local_dir):
    a = encode(server.address, pb.MediaItem(path=str(local_dir / "photo.jpg"))).items[0]
    b = encode(server.address, pb.MediaItem(data=JPEG)).items[0]
    assert a.content_key == b.content_key  # same bytes, same key, whatever the source


def test_sixteen_concurrent_requests(server):
    images = [encode_image(textured(200 + 10 * i, 300, seed=100 + i), "JPEG") for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(lambda b: encode(server.address, pb.MediaItem(data=b), pb.MediaItem(data=JPEG)), images)
        )
    assert len(results) == 16
    keys = {r.items[0].content_key for r in results}
    assert len(keys) == 16
    for i, r in enumerate(results):
        assert r.items[0].grid_thw[1] == round((200 + 10 * i) / 28) * 2  # patches of 14 px
        assert r.items[1].num_tokens == 391


def test_url_from_local_http_server(url_server, media_server, server):
    a = encode(url_server.address, pb.MediaItem(url=f"{media_server}/photo.jpg")).items[0]
    b = encode(server.address, pb.MediaItem(data=JPEG)).items[0]
    assert a.content_key == b.content_key  # a URL and inline bytes of the same file share the key
    np.testing.assert_array_equal(emb_array(a), emb_array(b))
    assert a.timings.fetch_ms > 0
    r = encode(url_server.address, pb.MediaItem(url=f"{media_server}/to-photo")).items[0]  # allowed redirect
    assert r.content_key == a.content_key


def test_content_hash_checked_and_used_for_cache(url_server, media_server):
    good = bytes_digest(JPEG)
    r = encode(url_server.address, pb.MediaItem(url=f"{media_server}/photo.jpg", content_hash=good)).items[0]
    # A URL that would fail answers from the cache when the client names content already encoded.
    hit = encode(url_server.address, pb.MediaItem(url=f"{media_server}/missing.jpg", content_hash=good)).items[0]
    assert hit.cache_hit and hit.content_key == r.content_key
    # A hash not in the cache: the bytes are fetched and checked against it.
    expect_error(
        url_server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        "does not match",
        pb.MediaItem(url=f"{media_server}/photo.png", content_hash=bytes_digest(b"other bytes")),
    )
    expect_error(
        url_server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        "32 hex digits",
        pb.MediaItem(data=JPEG, content_hash="nothex"),
    )


# ----------------------------------------------------------------------------------- errors
BAD_CASES = [
    ("empty", lambda: pb.MediaItem(data=b""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("truncated", lambda: pb.MediaItem(data=JPEG[: len(JPEG) // 2]), grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
    (
        "garbage",
        lambda: pb.MediaItem(data=b"\x00not an image at all" * 10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unsupported",
    ),
    (
        "unsupported-format",
        lambda: pb.MediaItem(data=encode_image(textured(64, 64), "PPM")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unsupported",
    ),
    (
        "too-many-bytes",
        lambda: pb.MediaItem(
            data=encode_image(np.random.default_rng(0).integers(0, 255, (1200, 1200, 3), np.uint8), "PNG")
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "larger than the limit",
    ),
    (
        "too-many-pixels",
        lambda: pb.MediaItem(data=encode_image(np.zeros((2100, 3000, 3), np.uint8), "PNG")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "over the limit",
    ),
    (
        "aspect",
        lambda: pb.MediaItem(data=encode_image(textured(28, 6000), "PNG")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "aspect ratio",
    ),
    ("no-source", lambda: pb.MediaItem(), grpc.StatusCode.INVALID_ARGUMENT, "no source"),
    ("path-outside", lambda: pb.MediaItem(path="/etc/passwd"), grpc.StatusCode.PERMISSION_DENIED, "outside"),
    ("path-missing", lambda: pb.MediaItem(path="/nonexistent/x.jpg"), grpc.StatusCode.PERMISSION_DENIED, "outside"),
    ("bad-scheme", lambda: pb.MediaItem(url="file:///etc/passwd"), grpc.StatusCode.INVALID_ARGUMENT, "scheme"),
]


@pytest.mark.parametrize("name,make,code,fragment", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_item_fails_request_naming_index_and_server_keeps_serving(server, name, make, code, fragment):
    details = expect_error(server.address, code, fragment, pb.MediaItem(data=JPEG), make())
    assert details.startswith("item 1: "), details
    assert_serving(server.address)


def test_too_many_items(server):
    expect_error(
        server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        "over the limit of 8",
        *[pb.MediaItem(data=JPEG) for _ in range(9)],
    )
    expect_error(server.address, grpc.StatusCode.INVALID_ARGUMENT, "no items")
    assert_serving(server.address)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x.jpg",
        "http://10.0.0.1/x.jpg",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/x.jpg",
        "http://192.168.1.1:8080/x.jpg",
        "http://[::ffff:127.0.0.1]/x.jpg",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://localhost:9/x.jpg",
    ],
)
def test_private_urls_refused_by_default(server, url):
    expect_error(server.address, grpc.StatusCode.PERMISSION_DENIED, "refused by policy", pb.MediaItem(url=url))


def test_redirect_to_refused_host_is_refused(url_server, media_server):
    expect_error(
        url_server.address,
        grpc.StatusCode.PERMISSION_DENIED,
        "metadata",
        pb.MediaItem(url=f"{media_server}/to-metadata"),
    )
    expect_error(
        url_server.address,
        grpc.StatusCode.PERMISSION_DENIED,
        "10.0.0.1",
        pb.MediaItem(url=f"{media_server}/to-private"),
    )
    assert_serving(url_server.address)


def test_fetch_errors_map_to_statuses(url_server, media_server):
    expect_error(
        url_server.address, grpc.StatusCode.NOT_FOUND, "HTTP 404", pb.MediaItem(url=f"{media_server}/missing.jpg")
    )
    expect_error(
        url_server.address, grpc.StatusCode.UNAVAILABLE, "HTTP 503", pb.MediaItem(url=f"{media_server}/server-error")
    )
    t0 = time.monotonic()
    expect_error(
        url_server.address,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "longer than 1.5s",
        pb.MediaItem(url=f"{media_server}/slow"),
    )
    assert time.monotonic() - t0 < 4.5
    assert_serving(url_server.address)


# ----------------------------------------------------------------------------------- CLI
def test_cli_encode_health_and_out_file(server, tmp_path):
    from safetensors.numpy import load_file

    f = tmp_path / "a.jpg"
    f.write_bytes(JPEG)
    out = tmp_path / "emb.safetensors"
    cli = [sys.executable, "-m", "mimo_epd"]
    r = subprocess.run(
        [*cli, "encode", "--server", server.address, str(f), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.splitlines()[0])
    assert line["num_tokens"] == 391 and line["dim"] == 256 and line["grid_thw"] == [1, 34, 46]
    assert set(line["timings_ms"]) == {"fetch", "decode", "preprocess", "queue", "encode"}
    tensors = load_file(str(out))
    assert tensors[line["key"]].shape == (391, 256)
    assert subprocess.run([*cli, "health", "--server", server.address], cwd=ROOT, timeout=60).returncode == 0
    dead = subprocess.run(
        [*cli, "health", "--server", "127.0.0.1:1", "--timeout", "2"], cwd=ROOT, timeout=60, capture_output=True
    )
    assert dead.returncode == 1
    bad = subprocess.run(
        [*cli, "encode", "--server", server.address, "http://10.0.0.1/x.jpg"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "PERMISSION_DENIED" in bad.stderr


def test_reflection_lists_the_encoder_service(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    ch = grpc.insecure_channel(server.address)
    stub_ = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(
        stub_.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    )
    names = {s.name for s in resp.list_services_response.service}
    assert "mimo_epd.v1.Encoder" in names and "grpc.health.v1.Health" in names


# ----------------------------------------------------------------------------------- shutdown
def test_sigterm_finishes_in_flight_work_and_exits_zero():
    import socket

    from mimo_epd.testing.servers import scrape

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    s = start_server(
        [
            "--decode-workers",
            "1",
            "--grace-period-s",
            "60",
            "--no-pipeline",
            "--no-jpeg-draft",
            "--metrics-port",
            str(metrics_port),
        ]
    )
    big = [pb.MediaItem(data=encode_image(textured(1500, 2000, seed=40 + i), "JPEG")) for i in range(24)]
    enc, _ = stub(s.address)
    fut = enc.Encode.future(pb.EncodeRequest(items=big), timeout=120)
    try:
        # SIGTERM only once the server has admitted the request (a request still being uploaded when the
        # server stops is refused by gRPC, which is not what this test is about).
        deadline = time.monotonic() + 30
        while scrape(metrics_port).get("encoder_pending_items", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not fut.done()
    finally:
        rc = s.stop()  # never leave the server behind, even when the assertion fails
    try:
        resp = fut.result()
    except grpc.RpcError as e:
        pytest.fail(
            f"the in-flight request failed ({e.code()}: {e.details()}); server exit code {rc}; its log:\n"
            + "".join(s.stderr_lines)[-3000:]
        )
    assert len(resp.items) == 24 and all(it.num_tokens > 0 for it in resp.items)
    assert rc == 0, "".join(s.stderr_lines)[-2000:]
    with pytest.raises(grpc.RpcError) as ei:
        encode(s.address, pb.MediaItem(data=JPEG), timeout=3)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


def test_backpressure_resource_exhausted_then_recovers():
    s = start_server(["--max-pending", "3", "--decode-workers", "1", "--cache-bytes", "0"])
    try:
        enc, _ = stub(s.address)
        big = [encode_image(textured(1200, 1600, seed=500 + i), "JPEG") for i in range(12)]
        futures = [enc.Encode.future(pb.EncodeRequest(items=[pb.MediaItem(data=b)]), timeout=120) for b in big]
        codes = []
        for f in futures:
            try:
                f.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                assert "--max-pending" in e.details()
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes
        assert codes.count(grpc.StatusCode.OK) >= 3, codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        # Load gone: everything is served again.
        for b in big[:4]:
            assert encode(s.address, pb.MediaItem(data=b)).items[0].num_tokens > 0
    finally:
        assert s.stop() == 0


# ----------------------------------------------------------------------------------- video
@pytest.fixture(scope="module")
def video_bytes(tmp_path_factory):
    from mimo_epd.testing.video_gen import make_test_video

    path = tmp_path_factory.mktemp("v") / "two_minutes.mp4"
    make_test_video(str(path), 120, width=320, height=180, preset="ultrafast")
    return path.read_bytes()


def test_video_item_through_grpc_with_timestamps_and_cache(server, video_bytes):
    item = pb.MediaItem(data=video_bytes, modality=pb.VIDEO, video=pb.VideoOptions(max_frames=64))
    r = encode(server.address, item, pb.MediaItem(data=JPEG), timeout=300)
    v, img = r.items
    assert v.video.frames_total == 3600 and v.video.frames_sampled == 64 and v.video.duration_s == 120
    assert v.grid_thw[0] == 32 and len(v.timestamps_s) == 32
    assert v.num_tokens == v.grid_thw[0] * v.grid_thw[1] * v.grid_thw[2] // 4
    assert list(v.embedding.shape) == [v.num_tokens, 256] and img.num_tokens == 391
    assert v.timestamps_s[0] == 0 and 118 < v.timestamps_s[-1] <= 120
    again = encode(server.address, item, timeout=300).items[0]
    assert (
        again.cache_hit
        and again.embedding.data == v.embedding.data
        and list(again.timestamps_s) == list(v.timestamps_s)
    )
    other = encode(
        server.address,
        pb.MediaItem(data=video_bytes, modality=pb.VIDEO, video=pb.VideoOptions(max_frames=32)),
        timeout=300,
    ).items[0]
    assert not other.cache_hit and other.content_key != v.content_key  # sampling is part of the key
    assert other.grid_thw[0] == 16


def audio_only_bytes() -> bytes:
    import tempfile

    import av

    with tempfile.NamedTemporaryFile(suffix=".m4a") as f:
        with av.open(f.name, "w", format="mp4") as c:
            st = c.add_stream("aac", rate=44100)
            for i in range(10):
                frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
                frame.sample_rate, frame.pts = 44100, i * 1024
                for pkt in st.encode(frame):
                    c.mux(pkt)
            for pkt in st.encode():
                c.mux(pkt)
        return open(f.name, "rb").read()


@pytest.mark.parametrize(
    "name,make,fragment",
    [
        ("audio-only", lambda vb: audio_only_bytes(), "no video stream"),
        ("empty", lambda vb: b"", "empty"),
        ("truncated", lambda vb: vb[: len(vb) // 50], "video"),
        ("corrupted", lambda vb: b"\x00" * 4096 + vb[4096:], "video"),
        ("garbage", lambda vb: b"\x00garbage" * 500, "video"),
    ],
)
def test_bad_videos_get_clear_errors_and_server_keeps_serving(server, video_bytes, name, make, fragment):
    details = expect_error(
        server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        fragment,
        pb.MediaItem(data=JPEG),
        pb.MediaItem(data=make(video_bytes), modality=pb.VIDEO),
    )
    assert details.startswith("item 1: ")
    assert_serving(server.address)


def test_video_limits(server, video_bytes):
    expect_error(
        server.address,
        grpc.StatusCode.INVALID_ARGUMENT,
        "--video-max-frames",
        pb.MediaItem(data=video_bytes, modality=pb.VIDEO, video=pb.VideoOptions(max_frames=5000)),
    )


def test_sigkilled_encoder_leaves_no_shm_arena_and_no_decode_workers():
    import glob
    import signal as _signal

    s = start_server(["--decode-workers", "2"])
    pid = s.proc.pid
    try:
        assert encode(s.address, pb.MediaItem(data=JPEG)).items[0].num_tokens == 391  # through the shm slots
        assert not glob.glob(f"/dev/shm/mimo-epd-decode-{pid}-*")
        children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        assert len(children) >= 2  # the decode workers
    finally:
        s.proc.send_signal(_signal.SIGKILL)
        s.proc.wait(30)
    assert not glob.glob(f"/dev/shm/mimo-epd-decode-{pid}-*")
    deadline = time.monotonic() + 15
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.3)
        alive = [
            c for c in alive if os.path.exists(f"/proc/{c}") and "Z" not in open(f"/proc/{c}/stat").read().split()[2]
        ]
    assert not alive, f"decode workers outlived their server: {alive}"
