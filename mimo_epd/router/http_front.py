"""The router's HTTP front (`serve --http-port`): the LLM workers' HTTP API (OpenAI chat completions,
completions, models, SGLang-native /generate, health, metrics) on the node's public address.

Generation requests (`POST /v1/chat/completions`, `/v1/completions`, `/generate`) go through the same policy as
gRPC Generate (mimo_epd/router/llm.py): the front tokenizes the prompt like the worker does (the same tokenizer,
and for chat the same chat template with the same message normalisation, tokenized without special tokens), asks
`LLMRouter.pick(prompt_token_ids)` for the workers in order, and forwards the request unchanged to the first
one's HTTP API. A request with media is routed on the part of its prompt before the first media row (its placeholder
ids come from the encoder's content keys): the text before the first placeholder where the model takes MiMo's omni
prompt, else the first token alone (by load), as in gRPC. The body goes through the same edge as the worker's (mimo_epd/common/http_edge.py: size after
decompression, strict JSON, depth, strings), so a body no worker could read is refused here with the worker's
400 / 413 / 415; a readable body the prompt rules refuse is routed by load, and the worker answers with its 400.
The body is forwarded decompressed (without its Content-Encoding).

The response is streamed back chunk by chunk as it arrives (SSE streams stay streams). The worker's cached
tokens are read from the response (`usage.prompt_tokens_details.cached_tokens`, or `meta_info.cached_tokens`
for /generate) and reported to the router (`report`), which compares them with its prediction. A stream that
did not ask for usage is asked for it upstream and the usage is taken out again on the way back, so the client
sees exactly what the worker would have sent it.

When the chosen worker fails before any byte of the body reached the client (it cannot be reached, or answers
503 / 429, or breaks off before its first body byte), the request goes to the next worker in the policy's order;
a worker that could not be reached or answered 503 is skipped until it serves again. Once bytes have been sent,
a worker that breaks off ends the client's response there. A client that disconnects cancels its handler, which
closes the upstream connection, so the worker sees the disconnect and aborts the request (its KV freed).
Other paths (models, health, server info) go to the least loaded live worker; GET /metrics answers the whole
node's merged metrics when the node gives them (`metrics`), else the worker's.
When no worker can take a request the answer is a 503 in the OpenAI error format.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from llm_backend.agentic.tools import ToolError, template_message
from mimo_epd.common.anthropic_rules import to_chat
from mimo_epd.common.auth import AuthConfig, ssl_context, upstream_authorization
from mimo_epd.common.http_edge import error_body, error_response, parse_json, read_body
from mimo_epd.common.http_server import EdgeConfig, edge_app, start_site
from mimo_epd.common.omni_prompt import first_media_at
from mimo_epd.common.prompt_rules import RuleError, audio_in_video, encode_text, is_token_ids, normalize_messages
from mimo_epd.common.responses_rules import to_chat as responses_to_chat

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) and the ones aiohttp sets itself on each side.
_SKIP_REQUEST = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-connection",
    "content-length",
    "accept-encoding",
    "content-encoding",  # the front forwards the body decompressed (http_edge.read_body)
}
_SKIP_RESPONSE = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "server",
    "date",
}
ROUTED = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/generate": "generate",
    "/v1/messages": "messages",  # Anthropic's: the same prompt as its chat translation (common/anthropic_rules.py)
    "/v1/responses": "responses",  # OpenAI's Responses API: likewise (common/responses_rules.py)
}
RETRY_STATUS = (429, 503)  # the worker is overloaded or going down: another worker may take it


def _error(status: int, message: str) -> web.Response:
    return error_response(status, message)


class _OpenStream:
    """A streamed response being relayed; `cut()` (the node is stopping) closes its upstream, and the relay ends
    the client's stream with the error event and `[DONE]`."""

    def __init__(self, up):
        self.up, self.was_cut = up, False

    def cut(self) -> None:
        self.was_cut = True
        self.up.close()


# ---------------------------------------------------------------------------------------------- prompts
class Unroutable(ValueError):
    """The body is not a request the front can tokenize (the worker will say why): route by load."""


def chat_messages(messages, audio_in_video: bool = False) -> tuple[list[dict], bool]:
    """The messages as the worker's template sees them (the shared prompt rules), and whether any carries media."""
    try:
        out, media = normalize_messages(messages, build=template_message, audio_in_video=audio_in_video)
    except (RuleError, ToolError) as e:
        raise Unroutable(str(e)) from None
    return out, bool(media)


class Tokenizer:
    """The prompt token ids a worker would compute for a request body (see the module docstring)."""

    def __init__(self, tokenizer, template, omni: bool = False):
        """`omni`: the model lays media out in MiMo's omni prompt (mimo_epd/common/omni_prompt.py), so a chat's text
        before its first media placeholder is the worker's prompt prefix."""
        self.tokenizer, self.template, self.omni = tokenizer, template, omni

    def _encode(self, text: str, special: bool) -> list[int]:
        return encode_text(self.tokenizer, text, special)

    def prompt(self, kind: str, body) -> tuple[list[int], bool]:
        """(the token ids the worker's prompt starts with, has media); raises Unroutable. With media, only the ids
        before the first media row are predictable (its placeholder ids come from the encoder's content keys): the
        text before the first placeholder in MiMo's omni prompt, else the first token."""
        if not isinstance(body, dict):
            raise Unroutable("body")
        if kind in ("messages", "responses"):
            try:
                body = to_chat(body) if kind == "messages" else responses_to_chat(body)
            except RuleError as e:
                raise Unroutable(str(e)) from None
            kind = "chat"
        if kind == "chat":
            try:
                flag = audio_in_video(body)
            except RuleError as e:
                raise Unroutable(str(e)) from None
            messages, media = chat_messages(body.get("messages"), flag)
            try:
                text = self.template.render(messages, add_generation_prompt=True)
            except ValueError as e:  # ChatTemplateError: the worker reports it
                raise Unroutable(str(e)) from None
            if not media:
                return self._encode(text, False), False
            at = first_media_at(text) if self.omni else -1
            return (self._encode(text[:at], False) if at >= 0 else self._encode(text, False)[:1]), True
        if kind == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            return self._ids_or_text(prompt), False
        ids, text = body.get("input_ids"), body.get("text")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
            ids = ids[0]
        return self._ids_or_text(text if ids is None else ids), bool(body.get("image_data"))

    def _ids_or_text(self, p) -> list[int]:
        if isinstance(p, str):
            return self._encode(p, True)
        if is_token_ids(p):
            return list(p)
        raise Unroutable("prompt")


def cached_tokens(obj) -> int | None:
    """The cached prompt tokens in a response body or stream event (OpenAI usage, or SGLang's meta_info)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            return details["cached_tokens"]
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return meta["cached_tokens"]
    return None


def kv_events_position(obj) -> str:
    """The worker's KV-event position in a response body or its usage event ("" when absent; router/sync.py)."""
    if not isinstance(obj, dict):
        return ""
    for part in (obj.get("usage"), obj.get("meta_info")):
        if isinstance(part, dict) and isinstance(part.get("kv_events_position"), str):
            return part["kv_events_position"]
    return ""


class SSEFilter:
    """Reads an SSE stream as it passes: the cached tokens of its usage event, and (when the client did not ask
    for usage and the front did) the usage taken out again."""

    def __init__(self, strip_usage: bool):
        self.strip = strip_usage
        self.buf = b""
        self.cached: int | None = None
        self.position = ""
        self.events = 0
        self.reported = False

    def feed(self, chunk: bytes) -> bytes:
        self.buf += chunk
        out = []
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                break
            event, self.buf = self.buf[: end + 2], self.buf[end + 2 :]
            out.append(self._event(event))
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self.buf = self.buf, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        self.events += 1
        data = event[len(b"data: ") : -2] if event.startswith(b"data: ") else None
        if data is None or data == b"[DONE]":
            return event
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        n = cached_tokens(obj)
        if n is not None:
            self.cached = n
            self.position = kv_events_position(obj) or self.position
        if not self.strip or not isinstance(obj, dict) or "usage" not in obj:
            return event
        if obj.get("choices") == [] and obj.get("usage") is not None:
            return b""  # the usage event the client did not ask for
        del obj["usage"]
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"  # as the worker writes it


# ---------------------------------------------------------------------------------------------- the front
class HTTPFront:
    def __init__(
        self,
        upstream: Callable[[], str | None] | None = None,
        timeout_s: float = 3600.0,
        router=None,
        template=None,
        edge: EdgeConfig | None = None,
        metrics: Callable[[], Awaitable[bytes]] | None = None,
        auth: AuthConfig | None = None,
    ):
        """`router`: an LLMRouter (generation through its policy; needs `template`, the workers' chat template).
        Without one, `upstream()` is the one worker's current `host:port` (None while it is not up). `metrics`:
        what GET /metrics answers (the whole node's, mimo_epd/node_metrics.py) instead of one worker's."""
        self.router = router
        self.metrics = metrics
        self.upstream = upstream or (router.http_upstream if router is not None else (lambda: None))
        self.tokens = Tokenizer(router.tokenizer, template, router.omni is not None) if router is not None else None
        self.timeout_s = timeout_s
        self.edge = edge or EdgeConfig()
        self.auth = auth or AuthConfig()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._active = 0  # requests being handled
        self._streams: set[_OpenStream] = set()

    def app(self) -> web.Application:
        app = edge_app(self.edge, [], keys=self.auth.keys)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def start(self, host: str, port: int) -> int:
        # No total timeout: a long generation streams for as long as it runs; connecting must be quick.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
        )
        self._runner, bound = await start_site(self.app(), host, port, self.edge, ssl_context(self.auth))
        return bound

    async def drain(self, timeout_s: float) -> int:
        """Stops accepting; lets the requests in flight finish within `timeout_s`; then ends each stream still open
        with the error event and `[DONE]` (its worker aborts the request). Returns how many streams it ended."""
        if self._runner is None:
            return 0
        for site in list(self._runner.sites):
            await site.stop()
        if self._runner.server is not None:
            self._runner.server.pre_shutdown()  # kept-alive connections close after their current request
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._active:
            log.info("HTTP: draining %d requests in flight (--drain-timeout-s %g)", self._active, timeout_s)
        while self._active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = list(self._streams)
        for stream in cut:
            stream.cut()
        deadline = loop.time() + 2.0  # the relays write their last events
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if cut:
            log.info("HTTP: ended %d open streams with an error event (drain timeout)", len(cut))
        return len(cut)

    async def close(self) -> None:
        runner, session, self._runner, self._session = self._runner, self._session, None, None
        if runner is not None:
            await runner.cleanup()
        if session is not None:
            await session.close()

    @staticmethod
    def _headers(request: web.Request) -> dict:
        out = {
            k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQUEST and k.lower() != "authorization"
        }
        key = upstream_authorization(request.headers.get("Authorization"))  # the internal key, when set
        if key:
            out["Authorization"] = key
        return out

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self._active += 1
        try:
            return await self._handle(request)
        finally:
            self._active -= 1

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics" and request.method == "GET" and self.metrics is not None:
            from prometheus_client import CONTENT_TYPE_LATEST

            return web.Response(body=await self.metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})
        kind = ROUTED.get(request.path) if request.method == "POST" else None
        if kind is not None and self.router is not None:
            return await self._routed(request, kind)
        target = self.upstream()
        if not target:
            return _error(503, "the LLM worker is not running (starting or restarting); retry shortly")
        body = await read_body(request, self.edge.max_request_bytes)
        try:
            up = await self._session.request(
                request.method,
                f"http://{target}{request.path_qs}",
                data=body or None,
                headers=self._headers(request),
                allow_redirects=False,
            )
        except (aiohttp.ClientConnectionError, TimeoutError, ValueError) as e:  # ValueError: InvalidURL
            log.warning("LLM worker %s unreachable: %s", target, e)
            return _error(503, f"the LLM worker is unreachable: {type(e).__name__}")
        return await self._relay(request, up, target, None)

    async def _relay(
        self,
        request,
        up,
        target: str,
        first: bytes | None,
        sse: SSEFilter | None = None,
        body_parts: list | None = None,
        choice=None,
    ) -> web.StreamResponse:
        """Streams `up` to the client (`first` = its first body chunk, already read). A stream the worker breaks
        off, or the node's drain cuts, ends with the error event and `[DONE]`, as the worker ends one.

        With `choice` (a 200 from that worker), what the answer says it cached is reported, and its index write
        awaited (`IndexSync.shared`), before the client gets the end of it: the usage event of a stream, or a
        plain body, which is then held until complete (one JSON object; nothing of it is useful earlier). Another
        router that gets the client's next turn the moment this one ends then sees the turn's blocks."""
        done = False
        stream = _OpenStream(up) if sse is not None else None
        if stream is not None:
            self._streams.add(stream)
        try:
            resp = web.StreamResponse(
                status=up.status,
                reason=up.reason,
                headers={k: v for k, v in up.headers.items() if k.lower() not in _SKIP_RESPONSE},
            )
            await resp.prepare(request)
            chunks = up.content.iter_any()
            if first is not None:
                await self._write(resp, first, sse, body_parts, choice)
            try:
                async for chunk in chunks:
                    await self._write(resp, chunk, sse, body_parts, choice)
            except aiohttp.ClientError as e:  # the worker went away mid-response, or the client did
                if _client_gone(request):  # our writes failed: nothing to tell; closing `up` aborts the request
                    log.info("the client closed a response from LLM worker %s before its end", target)
                    return resp
                if stream is None:  # a plain body: nothing more can be said
                    log.warning("LLM worker %s broke off a response: %s", target, e)
                    raise
                if not stream.was_cut:
                    log.warning("LLM worker %s broke off a stream: %s", target, e)
                    await self._end_stream(resp, sse, f"the LLM worker broke off the stream ({type(e).__name__})")
                    return resp
            if stream is not None and stream.was_cut:
                if not _client_gone(request):
                    await self._end_stream(resp, sse, "the server is shutting down (--drain-timeout-s)")
                return resp
            if sse is not None and (rest := sse.flush()):
                await resp.write(rest)
            if sse is None and body_parts is not None and choice is not None:
                body = b"".join(body_parts)
                try:
                    obj = json.loads(body)
                    await self._report(choice, cached_tokens(obj), kv_events_position(obj))
                except ValueError:
                    pass
                await resp.write(body)
            await resp.write_eof()
            done = True
            return resp
        finally:
            self._streams.discard(stream)  # type: ignore[arg-type]
            if done:
                up.release()  # the connection goes back to the pool
            else:
                up.close()  # cut: the worker sees the disconnect and aborts the request

    @staticmethod
    async def _end_stream(resp, sse: SSEFilter | None, message: str) -> None:
        """The error event and `[DONE]` after the complete events relayed so far (a half-received one is dropped)."""
        if sse is not None:
            sse.flush()
        event = json.dumps(error_body(503, message))
        await resp.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()

    async def _write(self, resp, chunk: bytes, sse: SSEFilter | None, body_parts: list | None, choice=None) -> None:
        if sse is not None:
            chunk = sse.feed(chunk)
            if choice is not None and sse.cached is not None and not sse.reported:  # the usage event: report first
                sse.reported = True
                await self._report(choice, sse.cached, sse.position)
        elif body_parts is not None:
            body_parts.append(chunk)
            if choice is not None:
                return  # held until complete (`_relay`)
        if chunk:
            await resp.write(chunk)

    async def _report(self, choice, cached: int | None, position: str) -> None:
        if cached is not None:
            self.router.report(choice, cached, position)
            await self.router.sync.shared()

    async def _routed(self, request: web.Request, kind: str) -> web.StreamResponse:
        router = self.router
        raw = await read_body(request, self.edge.max_request_bytes)  # too large, bad encoding: the edge's 4xx
        router.stats["requests"] += 1
        body, upstream_raw, strip = None, raw, False
        body = parse_json(raw, self.edge.max_json_depth)  # a body no worker could read: its 400 here
        try:
            tokens, _ = self.tokens.prompt(kind, body)  # with media: the ids before its first row
        except Exception as e:  # Unroutable (the worker says why), or a template this body breaks: route by load
            log.debug("routing an HTTP request by load: %s", e)
            tokens = []
        streaming = isinstance(body, dict) and body.get("stream") is True
        if streaming and kind in ("chat", "completion"):  # OpenAI's stream_options (not SGLang's, not Anthropic's)
            so = body.get("stream_options")
            if so is None or (isinstance(so, dict) and not so.get("include_usage")):
                strip = True  # ask for the usage (cached tokens) and take it out again on the way back
                upstream_raw = json.dumps({**body, "stream_options": {**(so or {}), "include_usage": True}}).encode()
        headers = self._headers(request)
        tried: list[str] = []
        refusal: web.Response | None = None  # the last worker's own 429 / 503, answered when no other can
        choices = await router.first_pick(tokens)
        while choices:
            choice = choices[0]
            tried.append(choice.worker)
            flight = router.started(choice, len(tokens), front="http")
            try:
                sent, failure = await self._try(request, choice, upstream_raw, headers, streaming, strip, flight)
            finally:
                router.finished(flight)
            if isinstance(sent, web.StreamResponse) and not isinstance(failure, web.Response):
                return sent
            if isinstance(failure, web.Response):
                refusal, failure = failure, f"HTTP {failure.status}"
            choices = await router.pick(tokens, exclude=set(tried))
            if choices:
                router.retried()
                log.info("retrying an HTTP request on the next worker after %s from %s", failure, choice.http_address)
        router.failed()
        if refusal is not None:
            return refusal
        return _error(503, f"no live LLM worker could take the request (tried {len(tried)})")

    async def _try(self, request, choice, raw: bytes, headers: dict, streaming: bool, strip: bool, flight):
        """(the response sent, None) or (None, why it can go to the next worker)."""
        router = self.router
        if not choice.http_address:
            return None, "no HTTP address"
        url = f"http://{choice.http_address}{request.path_qs}"
        try:
            up = await self._session.post(url, data=raw, headers=headers, allow_redirects=False)
        except (aiohttp.ClientConnectionError, TimeoutError, ValueError) as e:  # ValueError: InvalidURL
            router.mark_down(choice, f"HTTP {type(e).__name__}")
            return None, type(e).__name__
        if up.status in RETRY_STATUS:
            try:
                text = await up.read()
            except (aiohttp.ClientError, TimeoutError):
                text = b""
            finally:
                up.release()
            if up.status == 503:
                router.mark_down(choice, "HTTP 503")
            keep = {k: v for k, v in up.headers.items() if k.lower() in ("content-type", "retry-after")}
            return None, web.Response(status=up.status, body=text, headers=keep)
        chunks = up.content.iter_any()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (aiohttp.ClientError, TimeoutError) as e:  # broke off before any byte reached the client
            up.close()
            router.mark_down(choice, f"HTTP {type(e).__name__}")
            return None, type(e).__name__
        router.progressed(flight)
        ok = choice if up.status == 200 else None  # reported (and its index write awaited) before the answer ends
        if streaming and up.status == 200:
            resp = await self._relay(request, up, choice.http_address, first, sse=SSEFilter(strip), choice=ok)
        else:
            resp = await self._relay(request, up, choice.http_address, first, body_parts=[], choice=ok)
        return resp, None


def _client_gone(request: web.Request) -> bool:
    """Whether the client's side of the connection is closed (writes to it fail with ConnectionResetError)."""
    return request.transport is None or request.transport.is_closing()
