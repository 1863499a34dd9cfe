"""One way to start an HTTP server (the LLM worker's API, the router's front): the edge limits as flags
(`EdgeConfig`), the connection guard, CORS and the `Server` header.

- Body: `--max-request-mb` caps a request body after decompression (see `http_edge.read_body`; aiohttp's own
  decompression is off so the cap holds while a body inflates). The default fits the largest legitimate
  request: one media item at the encoder's default `--max-item-bytes` (64 MiB) inline as base64 (4/3 of it,
  85 MiB) plus its text.
- Connections (`GuardedHandler`, aiohttp's request handler with two additions): a client must deliver a
  request's headers within `--header-timeout-s` of its first byte, else the connection is closed (a slowloris
  holds nothing for long, and one that never sends a byte is held to the same deadline); an idle keep-alive
  connection is closed after `--keepalive-timeout-s`. Idle connections (none of its requests in flight) never
  stand in a working request's way: a client address holds at most `--max-connections-per-client`
  connections, and a new one past that closes the client's least recently active idle connection; only when
  every one of them is busy with a request is the new one answered 429 (with Retry-After) and closed. Over all
  clients at most `--max-idle-connections` idle connections stay open, the oldest closed first.
- Every 429 and 503 carries `Retry-After`.
- CORS is off unless `--allowed-origins` names origins (comma-separated, `*` for any): then a request from a
  listed origin gets `Access-Control-Allow-Origin`, and a preflight (`OPTIONS` with
  `Access-Control-Request-Method`) is answered 204 with the allowed methods and headers.
- Every response says `Server: mimo-epd` (not the Python and aiohttp versions).

Invariant: a connection enters the accounting in `connection_made` and leaves it once (`forget`: when it is lost,
or when it is closed to make room), so the counts never drift; a refused connection is never counted.
"""

from __future__ import annotations

import json
import logging
import ssl as ssl_mod
from collections import defaultdict

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .flags import dataclass, flag

log = logging.getLogger(__name__)
SERVER_NAME = "mimo-epd"
_G = "HTTP edge"


@dataclass
class EdgeConfig:
    max_request_mb: int = flag(
        100, "largest HTTP request body, in MiB after decompression (larger: 413)", _G, name="max_request_mb"
    )
    max_json_depth: int = flag(64, "deepest nesting of a JSON request body (deeper: 400)", _G)
    header_timeout_s: float = flag(10.0, "seconds a client may take to send a request's headers", _G)
    keepalive_timeout_s: float = flag(15.0, "seconds an idle keep-alive HTTP connection stays open", _G)
    max_connections_per_client: int = flag(
        256,
        "open HTTP connections per client address (0 = no limit); past it the client's oldest idle connection is "
        "closed to make room, and only when every one is busy with a request is the new one answered 429 "
        "(Retry-After) and closed",
        _G,
    )
    max_idle_connections: int = flag(
        1024,
        "idle HTTP connections (keep-alive between requests, or not yet sending one) kept open over all clients; "
        "past it the oldest idle ones are closed first (0 = no limit)",
        _G,
    )
    allowed_origins: str = flag(
        "", "CORS: comma-separated origins allowed to call the HTTP API from a browser ('*' = any; empty = off)", _G
    )

    @property
    def max_request_bytes(self) -> int:
        return self.max_request_mb << 20

    def validate(self) -> None:
        if self.max_request_mb < 1:
            raise ValueError(f"--max-request-mb must be at least 1, got {self.max_request_mb}")
        if self.max_json_depth < 4:
            raise ValueError(f"--max-json-depth must be at least 4, got {self.max_json_depth}")
        if self.header_timeout_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("--header-timeout-s and --keepalive-timeout-s must be positive")
        if self.max_connections_per_client < 0 or self.max_idle_connections < 0:
            raise ValueError("--max-connections-per-client and --max-idle-connections must be >= 0")


EDGE_FIELDS = frozenset(EdgeConfig.__dataclass_fields__)

_REFUSED = (
    b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Server: " + SERVER_NAME.encode() + b"\r\nContent-Length: %d\r\n\r\n%s"
)


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with a header deadline and the guard's connection accounting (module docstring)."""

    def __init__(self, manager, *, guard: GuardedServer, **kw):
        super().__init__(manager, **kw)
        self._guard = guard
        self._peer: str | None = None
        self._partial_since: float | None = None
        self.last_active = 0.0

    def idle(self) -> bool:
        """No request in flight or queued: between keep-alive requests, silent, or still sending headers."""
        return self._current_request is None and not self._messages

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        ip = peer[0] if isinstance(peer, tuple) and peer else "?"
        g = self._guard
        if g.per_client and len(g.conns[ip]) >= g.per_client and not g.close_oldest_idle(g.conns[ip]):
            body = json.dumps(
                {
                    "error": {
                        "message": f"too many connections from this client, each busy with a request "
                        f"(--max-connections-per-client {g.per_client})",
                        "type": "rate_limit_error",
                        "param": None,
                        "code": "too_many_connections",
                    }
                }
            ).encode()
            transport.write(_REFUSED % (len(body), body))
            transport.close()
            g.refused += 1
            return
        self._peer = ip
        self.last_active = self._loop.time()
        g.conns[ip][self] = None
        g.all[self] = None
        super().connection_made(transport)
        # A connection that never sends a byte is held to the header deadline too.
        self._partial_since = self.last_active
        self._loop.call_later(g.header_timeout_s, self._header_deadline)
        g.trim_idle()

    def forget(self) -> None:
        """Out of the guard's accounting (closed, or being closed to make room): counted once, never twice."""
        g, ip = self._guard, self._peer
        if ip is None:
            return
        g.conns[ip].pop(self, None)
        if not g.conns[ip]:
            del g.conns[ip]
        g.all.pop(self, None)
        self._peer = None

    def connection_lost(self, exc) -> None:
        self.forget()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.last_active = self._loop.time()
        before = self._request_count
        super().data_received(data)
        if self._request_count != before or self._current_request is not None or self._messages:
            self._partial_since = None  # headers complete: the body phase is the handler's
        elif data and self._partial_since is None:
            self._partial_since = self._loop.time()
            self._loop.call_later(self._guard.header_timeout_s, self._header_deadline)

    def _header_deadline(self) -> None:
        since = self._partial_since
        if since is None or self.transport is None or self._current_request is not None or self._messages:
            return
        if self._loop.time() - since >= self._guard.header_timeout_s * 0.999:
            self._guard.header_timeouts += 1
            self.transport.close()


class GuardedServer(web.Server):
    """aiohttp's low-level server making `GuardedHandler`s, and the connection accounting they share: every
    open connection by client address (`conns`) and overall (`all`), in arrival order."""

    def __init__(self, *args, edge: EdgeConfig, **kw):
        super().__init__(*args, **kw)
        self.per_client = edge.max_connections_per_client
        self.max_idle = edge.max_idle_connections
        self.header_timeout_s = edge.header_timeout_s
        self.conns: defaultdict[str, dict[GuardedHandler, None]] = defaultdict(dict)
        self.all: dict[GuardedHandler, None] = {}
        self.refused = 0
        self.header_timeouts = 0
        self.idle_closed = 0

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, guard=self, **self._kwargs)

    def close_oldest_idle(self, handlers) -> bool:
        """Closes the least recently active idle connection among `handlers`; False when every one is busy."""
        idle = [h for h in handlers if h.idle()]
        if not idle:
            return False
        oldest = min(idle, key=lambda h: h.last_active)
        oldest.forget()
        if oldest.transport is not None:
            oldest.transport.close()
        self.idle_closed += 1
        return True

    def trim_idle(self) -> None:
        """Past --max-idle-connections idle connections overall, the oldest idle ones are closed."""
        if not self.max_idle or len(self.all) <= self.max_idle:
            return
        idle = sorted((h for h in self.all if h.idle()), key=lambda h: h.last_active)
        for h in idle[: max(0, len(idle) - self.max_idle)]:
            h.forget()
            if h.transport is not None:
                h.transport.close()
            self.idle_closed += 1


class GuardedRunner(web.AppRunner):
    def __init__(self, app: web.Application, edge: EdgeConfig, **kw):
        super().__init__(app, **kw)
        self._edge = edge

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # the app started and frozen, its handler kwargs gathered
        return GuardedServer(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            edge=self._edge,
            **base._kwargs,
        )


# ---------------------------------------------------------------------------------------------- CORS, Server
def cors_middleware(allowed_origins: str):
    """None when CORS is off; else a middleware answering preflights and labelling allowed origins."""
    origins = {o.strip() for o in allowed_origins.split(",") if o.strip()}
    if not origins:
        return None
    anyone = "*" in origins

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        allowed = origin is not None and (anyone or origin in origins)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if not allowed or origin is None:
                return web.Response(status=403, text="origin not allowed")
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": request.headers.get(
                        "Access-Control-Request-Headers", "Authorization, Content-Type"
                    ),
                    "Access-Control-Max-Age": "600",
                    "Vary": "Origin",
                },
            )
        resp = await handler(request)
        if allowed and origin is not None:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Vary"] = "Origin"
        return resp

    return cors


async def _server_header(request, response) -> None:
    response.headers["Server"] = SERVER_NAME
    if response.status in (429, 503) and "Retry-After" not in response.headers:
        response.headers["Retry-After"] = "1"  # every "not now" says when to come back


def edge_app(edge: EdgeConfig, middlewares: list, keys: tuple[str, ...] = ()) -> web.Application:
    """An application with the edge's middlewares first (CORS when asked, the last-resort handler, the API-key
    check when `keys`), then `middlewares`; the body size is enforced by `http_edge.read_body`, aiohttp's own
    cap set just above it."""
    from .auth import http_middleware
    from .http_edge import last_resort

    cors = cors_middleware(edge.allowed_origins)
    app = web.Application(
        middlewares=[m for m in (cors, last_resort, http_middleware(keys)) if m is not None] + list(middlewares),
        client_max_size=edge.max_request_bytes + 1,
    )
    app.on_response_prepare.append(_server_header)
    return app


async def start_site(
    app: web.Application, host: str, port: int, edge: EdgeConfig, ssl_context: ssl_mod.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Starts `app` behind the connection guard; returns the runner and the bound port. A client that disconnects
    cancels its handler (handler_cancellation)."""
    runner = GuardedRunner(
        app,
        edge,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=5,
        auto_decompress=False,
        keepalive_timeout=edge.keepalive_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    sockets = getattr(site._server, "sockets", None)  # asyncio's or uvloop's server
    assert sockets, "the site did not bind"
    return runner, sockets[0].getsockname()[1]
