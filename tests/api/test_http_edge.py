"""The HTTP edge (mimo_epd/common/http_edge.py, http_server.py) on a real worker and on a real router front in
front of it: every input that used to reach aiohttp's plain-text 500, or a worker through the router
unchecked, gets a 4xx in the OpenAI error shape; a gzip bomb costs the process at most the body limit, and its
RSS stays flat across bombs; the Server header names no versions; an error never echoes a megabyte back."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mimo_epd.common.http_edge import EdgeError, check_json, parse_json
from mimo_epd.common.http_server import EdgeConfig, edge_app

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module", params=["worker", "router"])
def target(request, worker, front):
    return worker if request.param == "worker" else front


def post(address: str, path: str, data: bytes, headers: dict | None = None) -> tuple[int, bytes, dict]:
    async def go():
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            h = {"Content-Type": "application/json", **(headers or {})}
            async with s.post(f"http://{address}{path}", data=data, headers=h) as r:
                return r.status, await r.read(), dict(r.headers)

    return asyncio.run(go())


def is_openai_error(status: int, body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err.get("message"), str) and err.get("type") is not None


CASES = [
    (CHAT, b'{"messages": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, "deeply nested"),
    (CHAT, b'{"max_tokens": 1' + b"0" * 5000 + b', "messages": []}', 400, "an integer of 5000 digits"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "a lone surrogate"),
    (CHAT, b'{"messages": [{"role": ["user"], "content": "hi"}]}', 400, "a role that is a list"),
    (CHAT, b'{"messages": [{"role": {"a": 1}, "content": "hi"}]}', 400, "a role that is an object"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}', 400, "an infinite number"),
    ("/generate", b'{"text": "hi", "image_data": 3}', 400, "image_data an integer"),
    ("/generate", b'{"text": "hi", "image_data": true}', 400, "image_data a boolean"),
    ("/v1/completions", json.dumps({"prompt": [1 << 70, 5]}).encode(), 400, "token ids beyond 64 bits"),
    ("/generate", json.dumps({"input_ids": [1 << 64]}).encode(), 400, "input_ids beyond 64 bits"),
    ("/v1/completions", b"\xff\xfe{", 400, "invalid UTF-8"),
]


@pytest.mark.parametrize("path,body,status,what", CASES, ids=[c[3] for c in CASES])
def test_hostile_bodies_get_openai_shaped_4xx(target, path, body, status, what):
    got, raw, headers = post(target.http_address, path, body)
    assert got == status, (what, got, raw[:300])
    assert is_openai_error(got, raw), raw[:300]
    assert headers.get("Server") == "mimo-epd"


def test_gzip_body_is_read_and_forwarded_decoded(target):
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    got, raw, _ = post(target.http_address, "/v1/completions", gzip.compress(body), {"Content-Encoding": "gzip"})
    assert got == 200, raw[:300]
    assert json.loads(raw)["usage"]["completion_tokens"] == 2
    got, raw, _ = post(target.http_address, "/v1/completions", b"\x1f\x8bnot gzip", {"Content-Encoding": "gzip"})
    assert got == 400 and is_openai_error(got, raw), raw[:300]
    got, raw, _ = post(target.http_address, "/v1/completions", body, {"Content-Encoding": "br"})
    assert got == 415 and is_openai_error(got, raw), raw[:300]


def test_oversized_body_is_a_json_413(target):
    big = b'{"prompt": "' + b"a" * (101 << 20) + b'"}'  # past the default --max-request-mb 100
    got, raw, _ = post(target.http_address, "/v1/completions", big)
    assert got == 413 and is_openai_error(got, raw), raw[:300]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def bomb(inflated_mb: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zero = bytes(1 << 20)
    return b"".join([c.compress(zero) for _ in range(inflated_mb)] + [c.flush()])


def test_gzip_bombs_cost_at_most_the_limit_and_rss_stays_flat(target):
    b = bomb(600)  # ~600 KB that inflates to 600 MiB
    assert len(b) < 1 << 20
    pid = target.proc.pid
    got, raw, _ = post(target.http_address, "/v1/completions", b, {"Content-Encoding": "gzip"})
    assert got == 413 and is_openai_error(got, raw), raw[:300]
    first = rss_mb(pid)
    for _ in range(4):
        got, _, _ = post(target.http_address, "/v1/completions", b, {"Content-Encoding": "gzip"})
        assert got == 413
    after = rss_mb(pid)
    assert after - first < 64, (first, after)  # flat: no bomb keeps what it inflated


def test_model_name_is_not_echoed_in_full(worker):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{worker.http_address}/v1/models/{'m' * 4000}") as r:
                return r.status, await r.read()

    status, raw = asyncio.run(go())
    assert status == 404 and is_openai_error(status, raw) and len(raw) < 2000, len(raw)
    body = json.dumps({"model": "x" * (1 << 20), "prompt": "hi", "max_tokens": 1}).encode()
    status, raw, _ = post(worker.http_address, "/v1/completions", body)
    assert status == 404 and len(raw) < 2000, len(raw)


# ------------------------------------------------------------------------------------------- in-process units
def test_check_json_names_the_field():
    with pytest.raises(EdgeError) as e:
        check_json({"messages": [{"content": "ok"}, {"content": "bad \ud800"}]})
    assert e.value.param == "$.messages[1].content"
    with pytest.raises(EdgeError):
        check_json({"k\udfff": 1})
    with pytest.raises(EdgeError, match="nested deeper than 8"):
        parse_json(b"[" * 9 + b"]" * 9, max_depth=8)
    assert parse_json(b"[" * 8 + b"]" * 8, max_depth=8) == [[[[[[[[]]]]]]]]


def test_last_resort_is_a_logged_openai_500_with_a_request_id(caplog):
    async def boom(request):
        raise RuntimeError("a bug")

    async def go():
        app = edge_app(EdgeConfig(), [])
        app.router.add_get("/boom", boom)
        async with TestClient(TestServer(app)) as c:
            r = await c.get("/boom")
            return r.status, await r.json(), dict(r.headers)

    status, body, headers = asyncio.run(go())
    assert status == 500 and body["error"]["code"] == "internal_error"
    rid = {k.lower(): v for k, v in headers.items()}["x-request-id"]
    assert rid in body["error"]["message"]
    assert any(rid in r.getMessage() and r.exc_info for r in caplog.records)


def test_cors_off_by_default_and_preflight_when_asked():
    async def ok(request):
        return web.json_response({})

    async def go(origins: str):
        app = edge_app(EdgeConfig(allowed_origins=origins), [])
        app.router.add_get("/v1/models", ok)
        async with TestClient(TestServer(app)) as c:
            pre = await c.options(
                "/v1/models", headers={"Origin": "https://a.example", "Access-Control-Request-Method": "POST"}
            )
            get = await c.get("/v1/models", headers={"Origin": "https://a.example"})
            other = await c.get("/v1/models", headers={"Origin": "https://b.example"})
            return pre.status, dict(pre.headers), dict(get.headers), dict(other.headers)

    pre, pre_h, get_h, _ = asyncio.run(go(""))
    assert pre == 405 and "Access-Control-Allow-Origin" not in get_h
    pre, pre_h, get_h, other_h = asyncio.run(go("https://a.example"))
    assert pre == 204 and pre_h["Access-Control-Allow-Origin"] == "https://a.example"
    assert "POST" in pre_h["Access-Control-Allow-Methods"]
    assert get_h["Access-Control-Allow-Origin"] == "https://a.example"
    assert "Access-Control-Allow-Origin" not in other_h


def test_slowloris_and_idle_connections_are_closed_and_clients_capped():
    """A client that trickles its headers is cut at --header-timeout-s, one that never sends a byte too, an idle
    keep-alive at --keepalive-timeout-s; past --max-connections-per-client a new connection closes the client's
    oldest idle one, and only when all of them are busy with requests is it answered a JSON 429 with Retry-After."""
    from mimo_epd.common.http_server import start_site

    release = asyncio.Event()

    async def ok(request):
        return web.json_response({})

    async def busy(request):
        await release.wait()
        return web.json_response({})

    async def go():
        edge = EdgeConfig(header_timeout_s=0.5, keepalive_timeout_s=0.5, max_connections_per_client=5)
        app = edge_app(edge, [])
        app.router.add_get("/x", ok)
        app.router.add_get("/busy", busy)
        runner, port = await start_site(app, "127.0.0.1", 0, edge)
        try:
            slow = []
            for _ in range(2):  # slowloris: a partial request line, never finished
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET /x HTTP/1.1\r\nHost: a\r\n")
                slow.append((r, w))
            slow.append(await asyncio.open_connection("127.0.0.1", port))  # silent: never a byte
            r, w = await asyncio.open_connection("127.0.0.1", port)  # a keep-alive that goes idle
            w.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
            first = await asyncio.wait_for(r.readuntil(b"{}"), 5)
            slow.append((r, w))
            await asyncio.sleep(1.5)
            closed = [await asyncio.wait_for(sr.read(), 5) == b"" or sr.at_eof() for sr, _ in slow]
            held = []
            for _ in range(5):  # five requests in flight fill the client's five connections
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET /busy HTTP/1.1\r\nHost: a\r\n\r\n")
                held.append((r, w))
            await asyncio.sleep(0.2)
            er, _ = await asyncio.open_connection("127.0.0.1", port)
            refused = await asyncio.wait_for(er.read(), 5)
            release.set()
            answered = [await asyncio.wait_for(hr.readuntil(b"{}"), 5) for hr, _ in held]
            return first, refused, closed, answered
        finally:
            await runner.cleanup()

    first, refused, closed, answered = asyncio.run(go())
    assert b"200 OK" in first and b"Server: mimo-epd" in first
    assert refused.startswith(b"HTTP/1.1 429") and b"too_many_connections" in refused, refused
    assert b"Retry-After: 1" in refused
    assert all(closed), closed
    assert all(b"200 OK" in a for a in answered)


@pytest.mark.parametrize("idle", [300, 3000])
def test_a_good_request_beside_many_idle_connections(idle):
    """Hundreds or thousands of connections that did one GET /health and stay open (keep-alive), or never send a
    byte, do not deny a working request: it gets 200, the oldest idle connections being closed to make room
    (per client and past --max-idle-connections); the server's accounting ends where it started."""
    import resource

    from mimo_epd.common.http_server import start_site

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * idle + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))

    async def ok(request):
        return web.json_response({"ok": True})

    async def go():
        edge = EdgeConfig(header_timeout_s=30, keepalive_timeout_s=30)  # nothing times out during the test
        app = edge_app(edge, [])
        app.router.add_get("/health", ok)
        app.router.add_post("/v1/chat/completions", ok)
        runner, port = await start_site(app, "127.0.0.1", 0, edge)
        conns = []
        try:
            for i in range(idle):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                if i % 2 == 0:  # half keep-alive after GET /health, half silent
                    w.write(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
                    await asyncio.wait_for(r.readuntil(b"true}"), 10)
                conns.append((r, w))
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}) as resp:
                    status = resp.status
            server = runner.server
            open_now = len(server.all)
            for _, w in conns:
                w.close()
            await asyncio.sleep(0.5)
            return status, open_now, len(server.all), server.refused
        finally:
            await runner.cleanup()

    status, open_now, after, refused = asyncio.run(go())
    assert status == 200 and refused == 0
    assert open_now <= 256 + 1  # per client (all of them come from 127.0.0.1): the oldest idle ones were closed
    assert after == 0


async def test_every_429_and_503_says_when_to_retry():
    """A 429 or 503 from any handler (the engine's queue, a worker down behind the front) carries Retry-After; one
    that sets its own keeps it."""

    async def full(request):
        return web.json_response({}, status=429)

    async def down(request):
        return web.json_response({}, status=503)

    async def own(request):
        return web.json_response({}, status=503, headers={"Retry-After": "7"})

    app = edge_app(EdgeConfig(), [])
    for path, h in (("/full", full), ("/down", down), ("/own", own)):
        app.router.add_get(path, h)
    async with TestClient(TestServer(app)) as c:
        for path, want in (("/full", "1"), ("/down", "1"), ("/own", "7")):
            r = await c.get(path)
            assert r.headers.get("Retry-After") == want, path
        assert "Retry-After" not in (await c.get("/nothing")).headers  # a 404 is not a "not now"
