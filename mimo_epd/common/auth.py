"""Who may call a server: API keys on HTTP and gRPC, a separate internal key for router → worker traffic, and
optional TLS from files.

- `--api-key KEY` (or the environment variable `MIMO_EPD_API_KEY`, which keeps the key out of `ps`): every
  HTTP endpoint but the liveness `/health` wants `Authorization: Bearer KEY` (vLLM's convention; the openai
  client sends it from `api_key=`), and every gRPC method but health and reflection wants the metadata
  `authorization: Bearer KEY`. Otherwise: HTTP 401 in the OpenAI error shape / UNAUTHENTICATED. No key set:
  nothing is checked (the default, for loopback use).
- `--internal-api-key KEY` (or `MIMO_EPD_INTERNAL_API_KEY`): a second key a server accepts, which routers and
  nodes send to the workers behind them (HTTP header and gRPC metadata, replacing whatever the client sent).
  `serve --api-key` without one makes a random internal key for its own workers, so a worker port reached
  directly refuses strangers; a standalone router and its workers are given the same one.
- `--tls-cert FILE --tls-key FILE`: the server speaks TLS on its HTTP and gRPC ports (PEM files).

Keys are compared in constant time (`hmac.compare_digest`); a key is never logged.
"""

from __future__ import annotations

import hmac
import os
import secrets
import ssl

import grpc
from aiohttp import web

from .flags import dataclass, flag

API_KEY_ENV = "MIMO_EPD_API_KEY"
INTERNAL_KEY_ENV = "MIMO_EPD_INTERNAL_API_KEY"
_G = "authentication and TLS"
OPEN_HTTP = frozenset({"/health"})  # liveness stays open (load balancers, the launcher)
OPEN_GRPC = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass
class AuthConfig:
    api_key: str = flag("", f"clients must send Authorization: Bearer KEY (empty: ${API_KEY_ENV}; unset = open)", _G)
    internal_api_key: str = flag("", f"a second key for router/node -> worker traffic (empty: ${INTERNAL_KEY_ENV})", _G)
    tls_cert: str = flag("", "PEM certificate: serve HTTP and gRPC over TLS (with --tls-key)", _G)
    tls_key: str = flag("", "PEM private key of --tls-cert", _G)

    def resolved(self) -> AuthConfig:
        """The keys from the environment where the flags leave them empty; checks the TLS pair."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        for f in (self.tls_cert, self.tls_key):
            if f and not os.path.isfile(f):
                raise ValueError(f"TLS file {f!r} does not exist")
        return AuthConfig(
            self.api_key or os.environ.get(API_KEY_ENV, ""),
            self.internal_api_key or os.environ.get(INTERNAL_KEY_ENV, ""),
            self.tls_cert,
            self.tls_key,
        )

    def with_internal_key(self) -> AuthConfig:
        """This config with an internal key: a random one when a public key is set but no internal one."""
        if self.api_key and not self.internal_api_key:
            return AuthConfig(self.api_key, secrets.token_urlsafe(32), self.tls_cert, self.tls_key)
        return self

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k in (self.api_key, self.internal_api_key) if k)


AUTH_FIELDS = frozenset(AuthConfig.__dataclass_fields__)


def bearer(key: str) -> str:
    return f"Bearer {key}"


def key_ok(presented: str | None, keys: tuple[str, ...]) -> bool:
    if not keys:
        return True
    if not presented or not presented.startswith("Bearer "):
        return False
    got = presented[7:].strip().encode()
    ok = False
    for k in keys:  # every key compared: the time says nothing about which one nearly matched
        ok |= hmac.compare_digest(got, k.encode())
    return ok


# ---------------------------------------------------------------------------------------------- HTTP
def http_middleware(keys: tuple[str, ...]):
    """None when no key is set; else a middleware refusing requests without one (module docstring)."""
    if not keys:
        return None

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.path in OPEN_HTTP or request.method == "OPTIONS":
            return await handler(request)
        if not key_ok(request.headers.get("Authorization"), keys):
            from .http_edge import error_response

            return error_response(
                401,
                "missing or wrong API key (send Authorization: Bearer KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth


def ssl_context(cfg: AuthConfig) -> ssl.SSLContext | None:
    if not cfg.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ctx


# ---------------------------------------------------------------------------------------------- gRPC
class KeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses RPCs (but health and reflection) without a key in their `authorization` metadata."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_GRPC):
            return await continuation(details)
        md = dict(details.invocation_metadata or ())
        if key_ok(md.get("authorization"), self.keys):
            return await continuation(details)
        handler = await continuation(details)
        return _refusal(handler)


def _refusal(handler):
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata authorization)")

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata authorization)")
        yield  # pragma: no cover

    if handler is None:
        return None
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


def server_interceptors(cfg: AuthConfig | None) -> list:
    return [KeyInterceptor(cfg.keys)] if cfg is not None and cfg.keys else []


def server_credentials(cfg: AuthConfig | None):
    if cfg is None or not cfg.tls_cert:
        return None
    with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


def call_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The metadata a router or node sends its workers (empty without an internal key)."""
    return (("authorization", bearer(key)),) if key else ()


class _WithKey:
    """Puts the key into a call's metadata (replacing the caller's `authorization`)."""

    def __init__(self, key: str):
        self.md = call_metadata(key)

    def _with_key(self, details):
        md = [m for m in (details.metadata or ()) if m[0] != "authorization"] + list(self.md)
        return details._replace(metadata=grpc.aio.Metadata(*md))


class _KeyUnary(_WithKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_key(details), request)


class _KeyStream(_WithKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_key(details), request)


_internal = {"key": ""}  # this process's internal key (one per process: what it sends the workers behind it)


def use_internal_key(key: str) -> None:
    """Set once at start by a router or node: its channels and HTTP calls to workers carry this key."""
    _internal["key"] = key


def internal_key() -> str:
    return _internal["key"]


def client_interceptors() -> list:
    """Interceptors for a channel to a worker: every call carries the internal key (none without one)."""
    key = internal_key()
    # one object per kind: a channel files an interceptor under the first kind it is an instance of
    return [_KeyUnary(key), _KeyStream(key)] if key else []


def upstream_authorization(client_value: str | None) -> str | None:
    """The Authorization header a router forwards to a worker: its internal key, else what the client sent."""
    key = internal_key()
    return bearer(key) if key else client_value
