"""A local HTTP media server for benchmarks and load tests, with generated photo-like JPEGs.

`GET /img/<name>.jpg?u=<token>` returns the named image with the token appended after the JPEG's end
marker: decoders ignore it, but every distinct token gives distinct bytes, hence a distinct content key
and no cache hit, while the decode cost stays that of the real image.
"""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
from aiohttp import web


def photo_like(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth illumination, overlapping shapes, fine texture and mild sensor noise: compresses and
    decodes like a photograph (unlike flat colours or pure noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    y /= h
    x /= w
    img = np.empty((h, w, 3), np.float32)
    base = rng.uniform(40, 200, 3)
    for c in range(3):
        img[..., c] = base[c] + 50 * np.sin(2.5 * x + rng.uniform(0, 6)) * np.cos(1.7 * y + rng.uniform(0, 6))
    for _ in range(12):  # soft blobs ("objects")
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        mask = np.exp(-(((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r)))
        img += mask[..., None] * rng.uniform(-80, 80, 3)
    img += (12 * np.sin(x * w / 3.0) * np.sin(y * h / 5.0))[..., None]  # texture
    img += rng.normal(0, 3, (h, w, 1))  # sensor noise
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(arr: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


class MediaServer:
    """Serves `images` (name -> bytes) on 127.0.0.1 from a background thread."""

    def __init__(self, images: dict[str, bytes], host: str = "127.0.0.1", port: int = 0):
        self.images = images
        self.host, self.port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.requests = 0

    async def _handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = self.images.get(name)
        if body is None:
            raise web.HTTPNotFound()
        self.requests += 1
        token = request.query.get("u")
        if token:
            body = body + b"mimo-epd:" + token.encode()
        return web.Response(body=body, content_type="image/jpeg")

    def __enter__(self) -> "MediaServer":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_get("/img/{name}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())

        self._thread = threading.Thread(target=run, daemon=True, name="media-server")
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("media server did not start")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def url(self, name: str, token: str | None = None) -> str:
        u = f"http://{self.host}:{self.port}/img/{name}"
        return f"{u}?u={token}" if token else u


def generate_pool(sizes: list[tuple[int, int]], per_size: int, seed: int = 0, quality: int = 90) -> dict[str, bytes]:
    """name -> JPEG bytes, `per_size` different photo-like images of each (h, w)."""
    out = {}
    for h, w in sizes:
        for i in range(per_size):
            out[f"{w}x{h}-{i}.jpg"] = jpeg_bytes(photo_like(h, w, seed=seed + 31 * i + h + w), quality)
    return out
