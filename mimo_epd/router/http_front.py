"""The router's HTTP front (`serve --http-port`): the LLM worker's HTTP API (OpenAI chat completions,
completions, models, SGLang-native /generate, health, metrics) on the node's public address.

Every request is forwarded as-is to the worker's own HTTP port and its response streamed back chunk by
chunk as it arrives (SSE streams stay streams). A client that disconnects cancels its handler, which
closes the upstream connection, so the worker sees the disconnect and aborts the request (its KV freed).
When the worker cannot be reached (not started yet, restarting, gone) the answer is a 503 in the OpenAI
error format.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) and the ones aiohttp sets itself on each side.
_SKIP_REQUEST = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection",
                 "content-length", "accept-encoding"}
_SKIP_RESPONSE = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "server",
                  "date"}


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "service_unavailable_error" if status == 503 else "server_error",
                      "param": None, "code": None}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


class HTTPFront:
    def __init__(self, upstream: Callable[[], str | None], timeout_s: float = 3600.0, max_body_mb: int = 512):
        """`upstream()` is the worker's current `host:port` (None while it is not up)."""
        self.upstream = upstream
        self.timeout_s = timeout_s
        self.max_body = max_body_mb << 20
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def start(self, host: str, port: int) -> int:
        # No total timeout: a long generation streams for as long as it runs; connecting must be quick.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        runner, session, self._runner, self._session = self._runner, self._session, None, None
        if runner is not None:
            await runner.cleanup()
        if session is not None:
            await session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        target = self.upstream()
        if not target:
            return _error(503, "the LLM worker is not running (starting or restarting); retry shortly")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQUEST}
        body = await request.read()
        try:
            up = await self._session.request(request.method, f"http://{target}{request.path_qs}", data=body or None,
                                             headers=headers, allow_redirects=False)
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            log.warning("LLM worker %s unreachable: %s", target, e)
            return _error(503, f"the LLM worker is unreachable: {type(e).__name__}")
        done = False
        try:
            resp = web.StreamResponse(status=up.status, reason=up.reason,
                                      headers={k: v for k, v in up.headers.items() if k.lower() not in _SKIP_RESPONSE})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            done = True
            return resp
        except aiohttp.ClientError as e:  # the worker went away mid-response: nothing more to send
            log.warning("LLM worker %s broke off a response: %s", target, e)
            raise
        finally:
            if done:
                up.release()  # the connection goes back to the pool
            else:
                up.close()  # cut: the worker sees the disconnect and aborts the request
