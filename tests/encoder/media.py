"""A real HTTP media server on a loopback port for the encoder tests, counting the requests it gets.

A test that expects a URL to be refused asserts the counter stays 0: the refusal must happen before any
request reaches the server, not after a fetch that happened to fail."""

from __future__ import annotations

import asyncio
import collections
import threading

from aiohttp import web


class MediaServer:
    def __init__(self, files: dict[str, bytes], slow_s: float = 5.0, host: str = "127.0.0.1"):
        self.hits: collections.Counter[str] = collections.Counter()  # requests received, by name
        self.finished: collections.Counter[str] = collections.Counter()  # responses sent, by name
        self.files = files
        self.slow_s = slow_s
        self.host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())

    async def _handle(self, req: web.Request) -> web.StreamResponse:
        name = req.match_info["name"]
        self.hits[name] += 1
        if name.startswith("slow"):  # /slow, /slow-2, ...: answers after slow_s seconds
            await asyncio.sleep(self.slow_s)
            name = "photo.jpg"
        self.finished[req.match_info["name"]] += 1
        if name not in self.files:
            raise web.HTTPNotFound()
        return web.Response(body=self.files[name], content_type="application/octet-stream")

    def start(self) -> "MediaServer":
        app = web.Application()
        app.router.add_get("/{name}", self._handle)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._runner = runner
        self._thread.start()
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
