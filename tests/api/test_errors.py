"""Every error of the HTTP API, over raw HTTP (aiohttp client) against a real worker: OpenAI error bodies
({"error": {"message", "type", "param", "code"}}) with the right status, the worker serving on afterwards;
a client that disconnects mid-stream frees its KV; the router's front answers 503 when the worker is down."""

from __future__ import annotations

import asyncio
import base64
import time

import aiohttp
import numpy as np
import pytest

from tests.api.conftest import ITEM_LIMIT, scrape
from tests.conftest import encode_image

pytestmark = pytest.mark.integration


async def call(worker, body, path="/v1/chat/completions", raw: bytes | None = None):
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://{worker.http_address}{path}",
            data=raw if raw is not None else None,
            json=body if raw is None else None,
        ) as r:
            return r.status, await r.json(content_type=None), r.headers


def assert_error(status, body, want_status, param=None, contains=""):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert contains in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def user(content):
    return {"model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b""])
async def test_malformed_json(worker, raw):
    status, body, _ = await call(worker, None, raw=raw)
    err = assert_error(status, body, 400, contains="malformed JSON")
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body,param",
    [
        ([1, 2], None),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_file", "file": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.jpg"}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3.5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": {"a": 1}}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2, "best_of": 3, "stream": True}, "best_of"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": "high"}, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 101}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": [1]}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": [{"role": "user", "content": "x"}], "stream_options": []}, "stream_options"),
    ],
)
async def test_bad_chat_requests(worker, body, param):
    status, resp, _ = await call(worker, body)
    assert_error(status, resp, 400, param=param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ["a", 5]}, "prompt[1]"),
        ({"prompt": [1, "x"]}, "prompt[0]"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ],
)
async def test_bad_completion_requests(worker, body, param):
    status, resp, _ = await call(worker, body, path="/v1/completions")
    assert_error(status, resp, 400, param=param)


async def test_token_outside_the_vocabulary_and_unknown_model(worker):
    status, body, _ = await call(worker, {"prompt": [256, 10**6], "max_tokens": 1}, path="/v1/completions")
    assert_error(status, body, 400, contains="outside the vocabulary")
    for prompt in ([1, -1], [1, -(2**63)], [1, 2**40]):  # refused by the parser or the vocabulary check, by field
        status, body, _ = await call(worker, {"prompt": prompt, "max_tokens": 1}, path="/v1/completions")
        assert_error(status, body, 400, param="prompt")
    status, body, _ = await call(worker, {**user("x"), "model": "gpt-9"})
    assert_error(status, body, 404, param="model")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{worker.http_address}/v1/nothing") as r:
            assert_error(r.status, await r.json(), 404)


async def test_prompt_longer_than_the_pools(worker):
    status, body, _ = await call(worker, user("x" * 7000))
    err = assert_error(status, body, 400, contains="6000")
    assert err["code"] == "context_length_exceeded" and "7" in err["message"]
    status, body, _ = await call(worker, {**user("x"), "max_tokens": 5990})  # prompt + completion over the pools
    assert_error(status, body, 400, param="max_tokens", contains="6000")


def image_part(url):
    return [{"type": "text", "text": "Describe:"}, {"type": "image_url", "image_url": {"url": url}}]


async def test_media_errors_carry_the_encoders_status(worker, media, silent_port):
    cases = [
        ("data:image/jpeg;base64," + base64.b64encode(b"not an image at all").decode(), 400, "item 0"),
        ("http://10.11.12.13/a.jpg", 403, ""),  # private, not in --url-allowlist
        (media.url("missing.jpg"), 404, "404"),
        (f"http://127.0.0.1:{silent_port}/slow.jpg", 504, "--fetch-timeout-s"),
    ]
    noise = np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)
    big = encode_image(noise, "JPEG", quality=100)
    assert len(big) > ITEM_LIMIT
    cases.append(("data:image/jpeg;base64," + base64.b64encode(big).decode(), 413, str(ITEM_LIMIT)))
    for url, want, text in cases:
        status, body, _ = await call(worker, user(image_part(url)))
        err = assert_error(status, body, want, contains=text)
        assert err["message"].startswith("encoder:"), err
    status, body, _ = await call(worker, user(image_part(media.url("a.jpg"))))  # and the worker still serves
    assert status == 200 and body["usage"]["completion_tokens"] == 2


async def long_stream(session, worker, prompt="x" * 40, max_tokens=3000):
    r = await session.post(
        f"http://{worker.http_address}/v1/chat/completions",
        json={
            "model": "tiny-random",
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}],
        },
    )
    assert r.status == 200
    while b'"delta": {"content"' not in await r.content.readline():  # a token: the request is running
        pass
    return r


async def wait_metrics(worker, pred, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(scrape, worker.http_address)
        if pred(m):
            return m
        await asyncio.sleep(0.1)
    raise AssertionError(f"metrics never got there: {m}")


async def test_disconnect_mid_stream_frees_the_kv(worker):
    prompt = "disconnect me " * 4
    status, body, _ = await call(worker, {**user(prompt), "max_tokens": 1})  # the prompt is cached now
    assert status == 200
    base = await wait_metrics(worker, lambda m: m["llm_requests_running"] == 0)
    async with aiohttp.ClientSession() as s:
        r = await long_stream(s, worker, prompt)
        for _ in range(5):  # a few tokens in: the request holds decode slots
            await r.content.readline()
        held = await asyncio.to_thread(scrape, worker.http_address)
        assert held["llm_requests_running"] == 1 and held["llm_kv_full_used_slots"] > base["llm_kv_full_used_slots"]
        r.close()  # the client goes away mid-stream
    after = await wait_metrics(worker, lambda m: m["llm_requests_running"] == 0 and m["llm_requests_waiting"] == 0)
    assert after["llm_kv_full_used_slots"] == base["llm_kv_full_used_slots"]
    assert after["llm_kv_swa_used_slots"] == base["llm_kv_swa_used_slots"]
    assert any("client went away" in ln for ln in worker.stderr_lines)


async def test_overload_is_429_with_retry_after(worker):
    # the worker runs 2 requests at once and queues 1 (--max-running 2 --max-waiting 1)
    async with aiohttp.ClientSession() as s:
        running = [await long_stream(s, worker, prompt=f"busy {i} " * 5) for i in range(2)]
        queued = asyncio.ensure_future(
            s.post(f"http://{worker.http_address}/v1/chat/completions", json={**user("queued"), "max_tokens": 1})
        )
        await wait_metrics(worker, lambda m: m["llm_requests_waiting"] == 1)
        status, body, headers = await call(worker, user("one too many"))
        err = assert_error(status, body, 429, contains="--max-waiting")
        assert err["type"] == "rate_limit_error" and int(headers["Retry-After"]) >= 1
        for r in running:
            r.close()
        done = await queued
        assert done.status == 200  # the queued one runs once the others are gone
        done.release()
    await wait_metrics(worker, lambda m: m["llm_requests_running"] == 0)
    status, body, _ = await call(worker, user("after the rush"))
    assert status == 200


async def test_router_front_answers_503_when_the_worker_is_down():
    from mimo_epd.router.http_front import HTTPFront

    dead = HTTPFront(lambda: "127.0.0.1:9")  # nothing listens on the discard port
    port = await dead.start("127.0.0.1", 0)
    down = HTTPFront(lambda: None)  # not started yet / restarting
    port2 = await down.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            for p in (port, port2):
                async with s.post(f"http://127.0.0.1:{p}/v1/chat/completions", json=user("x")) as r:
                    body = await r.json()
                    assert r.status == 503 and "LLM worker" in body["error"]["message"]
    finally:
        await dead.close()
        await down.close()


async def test_errors_never_take_the_worker_down(worker):
    # after every error above the worker is alive and healthy
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{worker.http_address}/health") as r:
            assert r.status == 200
    assert worker.proc.poll() is None


async def test_a_stream_whose_client_closed_ends_quietly_and_cancels_the_request(caplog):
    """The race the drain test met: the client's transport is closing when the worker writes its next event
    (aiohttp raises ClientConnectionResetError before it cancels the handler). The request is cancelled and the
    stream ends without an error reaching the edge's 500 handler."""
    from llm_backend.server.http import LLMHTTPServer

    class ClosedResponse:
        writes = 0

        async def write(self, data):
            self.writes += 1
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

        async def write_eof(self):
            raise AssertionError("no EOF after a failed write")

    class Gen:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    async def events():
        await LLMHTTPServer._send(resp, {"choices": []})

    resp, gen = ClosedResponse(), Gen()
    with caplog.at_level("INFO", logger="llm_backend.server.http"):
        assert await LLMHTTPServer._run_stream(resp, [gen], "chatcmpl-x", events) is resp
    assert gen.cancelled and resp.writes == 1
    assert any("closed the stream before its end" in r.message for r in caplog.records)
