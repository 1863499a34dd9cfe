"""Hypothesis over the HTTP request schemas (chat completions, completions, /generate, the Responses and Anthropic
Messages APIs), on the worker's own HTTP
API and through the router's front: every field is either a plausible value or any JSON value, bodies are
sometimes gzip-encoded, truncated or not JSON at all. Whatever arrives, the answer is never a 500, and every
error on these paths has the OpenAI error shape (JSON `{"error": {"message", "type", ...}}`).

Bounded by default (derandomized, a few dozen examples per endpoint and target); `MIMO_EPD_FUZZ_EXAMPLES=N`
runs N random examples each (docs/reliability.md has a campaign's figures)."""

from __future__ import annotations

import gzip
import http.client
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import LONG_RUN, fuzz_settings

pytestmark = pytest.mark.integration

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
)
junk = st.recursive(
    scalars, lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=5), x, max_size=3), max_leaves=8
)
small = st.integers(1, 3)  # a generation that runs stays short
urls = st.sampled_from(
    ["http://user:pw@127.0.0.1:9/x.png", "data:image/png;base64,iVBORw0KGgo=", "ftp://h/x", "", "http://%41/"]
)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | junk}),
    st.sampled_from(["image_url", "video_url"]).flatmap(
        lambda k: st.fixed_dictionaries({"type": st.just(k), k: st.fixed_dictionaries({"url": urls}) | urls | junk})
    ),
    st.fixed_dictionaries({"type": junk}),
    junk,
)
tool_call = st.fixed_dictionaries(
    {"id": st.text(max_size=6) | junk, "type": st.just("function") | junk},
    optional={
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", ""]) | junk},
            optional={"arguments": st.sampled_from(['{"city": "Paris"}', "{", "[]"]) | junk},
        )
        | junk
    },
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]) | junk},
    optional={
        "content": st.text(max_size=30) | st.lists(part, max_size=3) | junk,
        "tool_calls": st.lists(tool_call, max_size=2) | junk,
        "tool_call_id": st.text(max_size=6) | junk,
        "reasoning_content": st.text(max_size=10) | junk,
    },
)
schema = st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "array", "integer"]) | junk},
    optional={"properties": st.dictionaries(st.text(max_size=4), junk, max_size=2) | junk, "required": junk},
)
tool = st.fixed_dictionaries(
    {"type": st.just("function") | junk},
    optional={
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "f"]) | junk},
            optional={"parameters": schema | junk, "description": junk, "strict": st.booleans() | junk},
        )
        | junk
    },
)
agentic = {
    "tools": st.lists(tool, max_size=2) | junk,
    "tool_choice": st.sampled_from(["auto", "none", "required"])
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": junk})})
    | junk,
    "parallel_tool_calls": st.booleans() | junk,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | junk},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": schema | junk, "strict": junk}) | junk},
    )
    | junk,
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans() | junk}) | junk,
}
common = {
    "model": st.sampled_from(["tiny-random", "other"]) | junk,
    "stream": st.booleans() | junk,
    "temperature": st.floats(0, 2) | junk,
    "top_p": st.floats(0, 1) | junk,
    "top_k": st.integers(-2, 50) | junk,
    "seed": st.integers(-(1 << 70), 1 << 70) | junk,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=3) | st.integers(0, 300), max_size=3) | junk,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | junk}) | junk,
    "n": st.integers(0, 3) | junk,
    "logprobs": st.booleans() | st.integers(0, 6) | junk,
}
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3) | junk, "max_tokens": small},
    optional={
        **common,
        **agentic,
        "top_logprobs": st.integers(-1, 30) | junk,
        "max_completion_tokens": small | junk,
    },
)
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.text(max_size=30) | st.lists(st.integers(-5, 1 << 66), max_size=5) | junk, "max_tokens": small},
    optional=common,
)
GENERATE = st.fixed_dictionaries(
    {
        "sampling_params": st.fixed_dictionaries(
            {"max_new_tokens": small},
            optional={k: common[k] for k in ("temperature", "top_p", "top_k", "stop")},
        )
        | junk
    },
    optional={
        "text": st.text(max_size=30) | junk,
        "input_ids": st.lists(st.integers(-5, 1 << 66), max_size=5) | junk,
        "image_data": urls | st.lists(urls, max_size=2) | junk,
        "stream": st.booleans() | junk,
    },
)
resp_part = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text"]), "text": st.text(max_size=20) | junk}
    ),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": urls | junk}),
    junk,
)
resp_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer"]) | junk},
        optional={"content": st.text(max_size=30) | st.lists(resp_part, max_size=2) | junk, "type": junk},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": st.text(max_size=5) | junk, "name": st.text(max_size=5) | junk},
        optional={"arguments": st.sampled_from(['{"city": "Paris"}', "{"]) | junk},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": st.text(max_size=5) | junk, "output": junk}
    ),
    junk,
)
RESPONSES = st.fixed_dictionaries(
    {"input": st.text(max_size=30) | st.lists(resp_item, max_size=3) | junk, "max_output_tokens": small},
    optional={
        **{k: common[k] for k in ("model", "stream", "temperature", "top_p")},
        "instructions": st.text(max_size=20) | junk,
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.just("function") | junk, "name": st.sampled_from(["f"]) | junk},
                optional={"parameters": schema | junk},
            ),
            max_size=2,
        )
        | junk,
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | junk,
        "text": st.fixed_dictionaries(
            {
                "format": st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "json_object", "json_schema"]) | junk},
                    optional={"schema": schema | junk},
                )
            }
        )
        | junk,
        "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "none"]) | junk}) | junk,
        "previous_response_id": st.text(max_size=8) | junk,
        "store": st.booleans() | junk,
    },
)
MESSAGES = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant"]) | junk},
                optional={"content": st.text(max_size=30) | st.lists(part, max_size=2) | junk},
            ),
            max_size=3,
        )
        | junk,
        "max_tokens": small,
    },
    optional={
        **{k: common[k] for k in ("model", "stream", "temperature", "top_p")},
        "system": st.text(max_size=20) | junk,
        "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | junk,
        "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"]) | junk}) | junk,
        "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool"]) | junk}) | junk,
    },
)
SCHEMAS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/generate": GENERATE,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
}
# The last event of a stream that ended (an error inside a stream is an event too, then the end).
STREAM_END = {
    "/v1/responses": (b"response.completed", b"response.incomplete", b"error"),
    "/v1/messages": (b"message_stop", b"event: error"),
}
wire = st.sampled_from(["json", "json", "json", "gzip", "truncated", "junk"])


def encode(body, how: str) -> tuple[bytes, dict]:
    raw = json.dumps(body).encode()
    if how == "gzip":
        return gzip.compress(raw), {"Content-Encoding": "gzip"}
    if how == "truncated":
        return raw[: len(raw) // 2], {}
    if how == "junk":
        return raw[::-1], {}
    return raw, {}


def send(address: str, path: str, data: bytes, headers: dict) -> tuple[int, bytes, str]:
    host, port = address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        c.request("POST", path, body=data, headers={"Content-Type": "application/json", **headers})
        r = c.getresponse()
        return r.status, r.read(), r.getheader("Content-Type", "")
    finally:
        c.close()


def check(status: int, body: bytes, ctype: str, sent, path: str = "") -> None:
    assert status != 500 and status < 600, (status, body[:300], sent)
    if status >= 400:
        err = json.loads(body)["error"]  # raises on a non-JSON error body
        assert isinstance(err["message"], str) and err["type"], body[:300]
    elif "text/event-stream" in ctype and path in STREAM_END:
        last = body.rstrip().rsplit(b"\n\n", 1)[-1]
        assert any(marker in last for marker in STREAM_END[path]), body[-300:]
    elif "text/event-stream" in ctype:
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]


@pytest.fixture(scope="module", params=["worker", "router"])
def target(request, worker, front):
    return worker if request.param == "worker" else front


@pytest.mark.parametrize("path", list(SCHEMAS))
def test_no_input_reaches_a_500(target, path):
    seen: dict[int, int] = {}

    @fuzz_settings(40)
    @given(body=SCHEMAS[path], how=wire)
    def run(body, how):
        data, headers = encode(body, how)
        status, raw, ctype = send(target.http_address, path, data, headers)
        seen[status] = seen.get(status, 0) + 1
        check(status, raw, ctype, (how, body), path)

    run()
    if LONG_RUN:  # the campaign's figures (docs/reliability.md): statuses seen, with -s
        print(f"\nHTTP fuzz {path}: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
