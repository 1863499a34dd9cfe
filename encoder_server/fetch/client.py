"""Stage 1 of the pipeline: get an item's raw bytes (inline, `data:` URI, http(s) URL or local path).

One aiohttp session with a bounded connection pool serves every request. Every fetch has a deadline
and a byte limit enforced while streaming (a lying or missing Content-Length cannot blow memory).

The session's connector (`PolicyConnector`) checks the address of every socket it opens against the
URL policy, before connecting and again on the connected peer, so the address checked is the address
of the socket actually connected, however the URL spelled it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextvars
import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote_to_bytes, urljoin

import aiohttp
import grpc

from mimo_epd.common.redact import redact_url

from ..errors import ItemError, denied, from_client_input, invalid
from .url_policy import PolicyResolver, UrlPolicy

# The policy refusals the connector made for the fetch running in this context: aiohttp reports a refused
# socket as a connection error, possibly merged with others, so the reason travels here instead.
_refusals: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("fetch_policy_refusals", default=None)

REDIRECT_STATUSES = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class MediaSource:
    kind: str  # "data" | "url" | "path"
    value: bytes | str

    def describe(self) -> str:
        if self.kind == "data":
            return f"<{len(self.value)} inline bytes>"
        if self.kind == "url" and str(self.value).startswith("data:"):
            return "<data: URI>"
        return str(self.value)


@dataclass
class FetchLimits:
    max_bytes: int = 64 << 20
    timeout_s: float = 10.0
    max_redirects: int = 5
    allowed_local_dir: str | None = None
    pool_size: int = 64


def _too_large(limit: int) -> ItemError:
    return invalid(f"item is larger than the limit of {limit} bytes (--max-item-bytes / --max-video-bytes)")


def parse_data_uri(uri: str, max_bytes: int) -> bytes:
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise invalid("malformed data: URI (no comma)")
    is_b64 = header.endswith(";base64")
    if (len(payload) * 3 // 4 if is_b64 else len(payload) // 3) > max_bytes:
        raise _too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True) if is_b64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise invalid(f"malformed base64 in data: URI ({e})") from None
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def _status_for_http(status: int) -> grpc.StatusCode:
    if status in (404, 410):
        return grpc.StatusCode.NOT_FOUND
    if status in (401, 403):
        return grpc.StatusCode.PERMISSION_DENIED
    if status == 429 or status >= 500:
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INVALID_ARGUMENT


class PolicyRefused(OSError):
    """A socket the connector would not open (or kept open) because the URL policy refuses its address."""


class PolicyConnector(aiohttp.TCPConnector):
    """A TCP connector that enforces the URL policy on the sockets themselves.

    Layer 1: every socket is made by `_open_socket` (aiohttp's socket_factory), which sees the exact
    address the socket is about to connect to and refuses it before any packet is sent.
    Layer 2: every new connection's peer address (`peername`) is checked again once connected; a
    refused one is closed before a request is written. Together they cover IP literals aiohttp connects
    to without resolving, names, redirects and any spelling the URL check did not foresee.
    """

    def __init__(self, policy: UrlPolicy, **kwargs):
        self._policy = policy
        super().__init__(socket_factory=self._open_socket, **kwargs)

    def _refuse(self, why: str) -> PolicyRefused:
        seen = _refusals.get()
        if seen is not None:
            seen.append(why)
        return PolicyRefused(errno.EACCES, why)

    def _open_socket(self, addr_info) -> socket.socket:
        family, type_, proto, _, sockaddr = addr_info
        why = self._policy.refusal(sockaddr[0], f"address {sockaddr[0]}")
        if why:
            raise self._refuse(why)
        return socket.socket(family=family, type=type_, proto=proto)

    async def _wrap_create_connection(self, *args, **kwargs):
        transport, protocol = await super()._wrap_create_connection(*args, **kwargs)
        peer = transport.get_extra_info("peername")
        why = (
            f"URL refused by policy: the connection's peer address is unknown ({peer!r})"
            if not peer or not isinstance(peer, tuple)
            else self._policy.refusal(peer[0], f"peer {peer[0]}")
        )
        if why:
            transport.close()
            raise aiohttp.ClientConnectorError(kwargs["req"].connection_key, self._refuse(why))
        return transport, protocol


def _policy_refusal(exc: BaseException) -> str | None:
    """The policy reason inside a connection error, if the policy caused it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PolicyRefused):
            return exc.strerror
        exc = getattr(exc, "os_error", None) or exc.__cause__ or exc.__context__
    return None


class Fetcher:
    def __init__(self, limits: FetchLimits, policy: UrlPolicy):
        self.limits = limits
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None
        self._local_root = os.path.realpath(limits.allowed_local_dir) if limits.allowed_local_dir else None

    async def start(self) -> None:
        connector = PolicyConnector(
            self.policy, limit=self.limits.pool_size, resolver=PolicyResolver(self.policy), ttl_dns_cache=None
        )
        # trust_env=False: never route through a proxy from the environment (it would bypass the address checks).
        self._session = aiohttp.ClientSession(
            connector=connector, trust_env=False, headers={"User-Agent": "mimo-epd-encoder/0.1"}
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, source: MediaSource, max_bytes: int | None = None) -> bytes:
        limit = max_bytes or self.limits.max_bytes
        if source.kind == "data":
            data = bytes(source.value)
            if len(data) > limit:
                raise _too_large(limit)
            return data
        if source.kind == "path":
            return await asyncio.to_thread(self._read_local, str(source.value), limit)
        url = str(source.value)
        if url[:5].lower() == "data:":
            return parse_data_uri(url, limit)
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                return await self._fetch_url(url, limit)
        except TimeoutError:
            raise ItemError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"fetching {redact_url(url)} took longer than {self.limits.timeout_s:g}s (--fetch-timeout-s)",
            ) from None

    async def _fetch_url(self, url: str, limit: int) -> bytes:
        assert self._session is not None, "Fetcher.start() was not called"
        refusals: list[str] = []
        _refusals.set(refusals)  # this fetch's own context (each item is fetched in its own task)
        for _ in range(self.limits.max_redirects + 1):
            self.policy.check_url(url)
            try:
                async with self._session.get(url, allow_redirects=False) as resp:
                    if resp.status in REDIRECT_STATUSES:
                        location = resp.headers.get("Location")
                        if not location:
                            raise invalid(f"HTTP {resp.status} from {redact_url(url)} without a Location header")
                        url = urljoin(url, location)
                        continue
                    if resp.status >= 400:
                        raise ItemError(
                            _status_for_http(resp.status),
                            f"HTTP {resp.status} {resp.reason or ''} fetching {redact_url(url)}".rstrip(),
                        )
                    if resp.content_length is not None and resp.content_length > limit:
                        raise _too_large(limit)
                    buf = bytearray()
                    async for chunk in resp.content.iter_chunked(1 << 16):
                        buf += chunk
                        if len(buf) > limit:
                            raise _too_large(limit)
                    return bytes(buf)
            except aiohttp.ClientError as e:
                why = _policy_refusal(e) or (refusals[0] if refusals else None)
                if why:
                    raise denied(f"{why} (fetching {redact_url(url)})") from None
                raise ItemError(
                    grpc.StatusCode.UNAVAILABLE, f"fetching {redact_url(url)} failed: {redact_url(str(e))}"
                ) from None
        raise invalid(
            f"more than {self.limits.max_redirects} redirects fetching {source_url_short(url)} (--max-redirects)"
        )

    def _check_path(self, path: str) -> None:
        """Refuses a path the filesystem could never open, naming why (the OS would say it as an exception)."""
        if "\x00" in path:
            raise invalid(f"path {path!r} contains a NUL byte")
        try:
            raw = os.fsencode(path)
        except UnicodeError:
            raise invalid(f"path {path!r} cannot be written in the server's filesystem encoding") from None
        root = self._local_root or "/"
        name_max = _pathconf(root, "PC_NAME_MAX", 255)
        path_max = _pathconf(root, "PC_PATH_MAX", 4096)
        if len(raw) >= path_max:
            raise invalid(f"path is {len(raw)} bytes long, over the filesystem's limit of {path_max - 1} (PATH_MAX)")
        for part in raw.split(b"/"):
            if len(part) > name_max:
                shown = part[:40].decode(errors="replace")
                raise invalid(
                    f"path component {shown!r}... is {len(part)} bytes long, over the filesystem's limit "
                    f"of {name_max} (NAME_MAX)"
                )

    def _read_local(self, path: str, limit: int) -> bytes:
        if self._local_root is None:
            raise denied("local paths are disabled on this server (start it with --allowed-local-dir DIR)")
        self._check_path(path)
        real = os.path.realpath(path)
        if os.path.commonpath([real, self._local_root]) != self._local_root:
            raise denied(f"path {path} is outside --allowed-local-dir {self._local_root}")
        p = Path(real)
        try:
            if not p.is_file():
                raise ItemError(grpc.StatusCode.NOT_FOUND, f"no such file: {path}")
            size = p.stat().st_size
            if size > limit:
                raise _too_large(limit)
            return p.read_bytes()
        except OSError as e:  # gone, unreadable or a special file between the checks and the read
            err = from_client_input(e)
            raise ItemError(err.code, f"reading {path}: {e.strerror or e}") from None


def _pathconf(path: str, name: str, default: int) -> int:
    try:
        return int(os.pathconf(path, name))
    except (OSError, ValueError):
        return default


def source_url_short(url: str, n: int = 120) -> str:
    return redact_url(url, n)  # no credentials in any message
