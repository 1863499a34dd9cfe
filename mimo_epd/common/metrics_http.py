"""One Prometheus /metrics endpoint on aiohttp: what the node's merged metrics and the LLM router serve."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any


class MetricsServer:
    """Serves GET /metrics with the bytes `body()` returns (Prometheus text format)."""

    def __init__(self, body: Callable[[], Awaitable[bytes]], what: str, flag: str = ""):
        # `what` and `flag` name the server in errors: "the node's metrics", "--metrics-port"
        self.body, self.what, self.flag = body, what, flag
        self._runner: Any = None

    async def start(self, host: str, port: int) -> int:
        """Starts serving on host:port (0 = a free port); returns the port. A port in use raises OSError naming
        the address and the reason."""
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST

        if self._runner is not None:
            raise RuntimeError(f"{self.what}: already serving")

        async def handle(request):
            return web.Response(body=await self.body(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = self._runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await self.close()
            # "Address already in use" (asyncio's own text repeats the address); a resolver error has a negative
            # errno and its own text ("Name or service not known")
            reason = os.strerror(e.errno) if e.errno and e.errno > 0 else e.strerror or str(e)
            flag = f" ({self.flag})" if self.flag else ""
            raise OSError(f"cannot serve {self.what} on {host}:{port}{flag}: {reason}") from None
        except BaseException:
            await self.close()
            raise
        server: Any = site._server
        return server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
