"""The HTTP edge the LLM worker's API and the router's front share: how a request body is read and parsed,
what every error looks like, and the last-resort handler.

- `read_body`: the body, decompressed here while it streams (the servers run with aiohttp's own
  decompression off, `auto_decompress=False`): `Content-Encoding` identity, gzip or deflate; the
  decompressed size is capped at `--max-request-mb` as it grows (zlib's `max_length`), so a gzip bomb costs
  at most the limit, never its inflated size. Past the limit: 413. Another encoding: 415. A corrupt or
  truncated stream: 400.
- `parse_json`: strict JSON (no NaN / Infinity literals); a parser failure of any kind (syntax, invalid
  UTF-8, nesting past the interpreter's recursion limit, an integer past Python's digit limit) is a 400 that
  says why. Then `check_json` walks the value once without recursion: nesting deeper than `max_depth` and
  strings holding a lone UTF-16 surrogate (`"\\ud800"`, which no tokenizer can encode) are 400s naming the
  field (`$.messages[0].content`).
- `error_body` / `error_response`: the OpenAI error shape, `{"error": {message, type, param, code}}`.
- `last_resort`: a middleware that turns `EdgeError` and aiohttp's HTTP errors (404, 405, 413...) into
  that shape, and anything unexpected into a logged 500 in that shape with a request id (the log line
  carries the same id and the traceback). No client ever sees aiohttp's plain-text 500.
- `shown`: a client-supplied string as an error message may echo it (bounded length).

Invariant: whatever bytes arrive, `read_body` + `parse_json` return a checked JSON value or raise
`EdgeError`; nothing else escapes them.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
import zlib

from aiohttp import web

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
DEFAULT_MAX_DEPTH = 64
_CHUNK = 1 << 16


class EdgeError(Exception):
    """A request refused at the edge: HTTP `status`, a message, the offending field (`param`), an error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status, headers=headers)


def shown(value, limit: int = 64) -> str:
    """`repr` of a client-supplied string, cut to `limit` characters (an error never echoes a megabyte)."""
    s = str(value)
    return repr(s) if len(s) <= limit else repr(s[:limit]) + f"... ({len(s)} characters)"


# ---------------------------------------------------------------------------------------------- bodies
def _decoder(request: web.Request):
    enc = request.headers.get("Content-Encoding", "").strip().lower()
    if enc in ("", "identity"):
        return None
    if enc in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if enc == "deflate":
        return zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib-wrapped (or gzip), as aiohttp reads it
    raise EdgeError(415, f"Content-Encoding {shown(enc, 32)} is not supported (identity, gzip, deflate)")


def _too_large(max_bytes: int, what: str = "the request body") -> EdgeError:
    return EdgeError(
        413, f"{what} is larger than the limit of {max_bytes >> 20} MiB (--max-request-mb)", code="request_too_large"
    )


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The decompressed body, at most `max_bytes` of it (see the module docstring); raises EdgeError."""
    dec = _decoder(request)
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.content.iter_chunked(_CHUNK):
            if dec is None:
                parts.append(chunk)
                size += len(chunk)
            else:
                buf = chunk
                while buf and size <= max_bytes:
                    piece = dec.decompress(buf, min(_CHUNK * 16, max_bytes + 1 - size))  # 1 MiB at most at once
                    parts.append(piece)
                    size += len(piece)
                    buf = dec.unconsumed_tail
            if size > max_bytes:
                raise _too_large(max_bytes, "the request body" if dec is None else "the decompressed request body")
        if dec is not None:
            if not dec.eof:
                raise EdgeError(400, "the compressed request body is truncated")
    except zlib.error as e:
        raise EdgeError(400, f"the compressed request body is corrupt: {e}") from None
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------- JSON
def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH):
    """The checked JSON value of `raw`; raises EdgeError (400) naming what is wrong."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise EdgeError(400, f"malformed JSON body: nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, the int digit limit, NaN / Infinity
        raise EdgeError(400, f"malformed JSON body: {str(e)[:200]}") from None
    check_json(obj, max_depth)
    return obj


def _path(where) -> str:
    keys = []
    while where is not None:
        where, key = where
        keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "$" + "".join(reversed(keys))


def _check_str(s: str, where) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise EdgeError(
                400, f"'{_path(where)}': the string holds a lone UTF-16 surrogate (\\ud800-\\udfff)", param=_path(where)
            ) from None


def check_json(obj, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Refuses (400) nesting deeper than `max_depth` and strings (values or keys) with lone surrogates."""
    stack: list = [(obj, 0, None)]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_str(v, where)
            continue
        if isinstance(v, float) and not math.isfinite(v):  # 1e999 parses to inf
            raise EdgeError(400, f"'{_path(where)}': the number is out of range", param=_path(where))
        if not isinstance(v, (dict, list)):
            continue
        if depth >= max_depth:
            raise EdgeError(400, f"the JSON body is nested deeper than {max_depth} levels at '{_path(where)}'")
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            if isinstance(k, str):
                _check_str(k, (where, k))
            if isinstance(x, (dict, list, str, float)):
                stack.append((x, depth + 1, (where, k)))


async def read_json(request: web.Request, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH):
    return parse_json(await read_body(request, max_bytes), max_depth)


# ---------------------------------------------------------------------------------------------- last resort
@web.middleware
async def last_resort(request: web.Request, handler):
    try:
        return await handler(request)
    except EdgeError as e:
        return error_response(e.status, e.message, e.param, e.code)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        keep = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
        return error_response(e.status, f"{e.reason}: {request.method} {shown(request.path, 128)}", headers=keep)
    except Exception:
        rid = uuid.uuid4().hex[:16]
        log.exception("internal error answering %s %s (request id %s)", request.method, request.path[:128], rid)
        return error_response(
            500,
            f"internal error (request id {rid}); the server logged it",
            code="internal_error",
            headers={"X-Request-Id": rid},
        )
