"""The Anthropic Messages API (`POST /v1/messages`) through the official `anthropic` client against a real worker
on the shipped `tiny` model: the answer equals the chat API's for the same conversation (system, stop sequences,
greedy), streamed equals whole, a forced tool call comes back as a `tool_use` block whose input follows the tool's
schema and its result can be sent back, and bad requests are 400s naming the field."""

from __future__ import annotations

import anthropic
import openai
import pytest

pytestmark = pytest.mark.integration

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def worker(tiny_worker):
    return tiny_worker


@pytest.fixture(scope="module")
def claude(worker):
    return anthropic.Anthropic(base_url=f"http://{worker.http_address}", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(worker):
    return openai.OpenAI(base_url=f"http://{worker.http_address}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_message_equals_the_chat_answer(claude, oai):
    system, user = "You answer briefly.", "How do I read a JSON file in Python?"
    m = claude.messages.create(model="tiny", max_tokens=24, system=system, messages=[{"role": "user", "content": user}])
    c = oai.chat.completions.create(
        model="tiny",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens


def test_stop_sequence_and_streaming(claude):
    msgs = [{"role": "user", "content": "Name a Python module for dates."}]
    whole = claude.messages.create(model="tiny", max_tokens=32, messages=msgs)
    text = whole.content[0].text
    words = [w for w in text.split(" ") if len(w) > 2]
    assert words, text
    cut = claude.messages.create(model="tiny", max_tokens=32, messages=msgs, stop_sequences=[words[0]])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == words[0]
    assert cut.content == [] or text.startswith(cut.content[0].text)
    with claude.messages.stream(model="tiny", max_tokens=32, messages=msgs) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == text and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_call_and_its_result(claude):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(
        model="tiny",
        max_tokens=64,
        messages=msgs,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and isinstance(call.input, dict) and set(call.input) == {"city"}
    assert isinstance(call.input["city"], str)
    with claude.messages.stream(
        model="tiny",
        max_tokens=64,
        messages=msgs,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as s:
        streamed = s.get_final_message()

    def same(b):
        return {k: v for k, v in b.model_dump().items() if k != "id"}  # call ids are new per response

    assert [same(b) for b in streamed.content] == [same(b) for b in m.content]
    follow = msgs + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
    ]
    answer = claude.messages.create(model="tiny", max_tokens=16, messages=follow, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.usage.output_tokens > 0


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(max_tokens=4, messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (dict(max_tokens=4, messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages[0].content[0]"),
        (dict(max_tokens=4, messages=[{"role": "user", "content": "x"}], extra_body={"temperature": 5}), "temperature"),
        (dict(max_tokens=4, messages=[{"role": "user", "content": "x"}], tool_choice={"type": "x"}), "tool_choice"),
    ],
)
def test_bad_messages_are_400s_naming_the_field(claude, kw, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", **kw)
    assert e.value.status_code == 400 and e.value.body["error"]["param"] == field, e.value.body


@pytest.mark.parametrize(
    "body,field",
    [
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "container": "c"},
            "container",
        ),
        ({"model": "tiny", "max_tokens": 4, "messages": []}, "messages"),
    ],
)
def test_raw_bad_bodies_are_named(worker, body, field):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"http://{worker.http_address}/v1/messages", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == field


def test_thinking_blocks_and_their_stream_events_parse_as_the_client_types():
    """MiMo's reasoning as Anthropic `thinking` blocks (before the text and the tool call) and as stream events
    (`thinking_delta`), each validated by the `anthropic` client's own models; the request's `thinking` opens the
    template's thinking block (the shipped model's thinking is empty at greedy, so the shapes are checked here)."""
    import pydantic
    from anthropic.types import Message, RawMessageStreamEvent

    from llm_backend.server import anthropic_protocol as ap
    from mimo_epd.common.anthropic_rules import to_chat

    chat = to_chat({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}})
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    message = {
        "reasoning_content": "Think first.",
        "content": "Answer.",
        "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    blocks = ap.blocks(message)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": "tiny", "content": blocks}
    body.update(stop_reason="tool_use", stop_sequence=None, usage={"input_tokens": 1, "output_tokens": 2})
    m = Message.model_validate(body)
    assert m.content[0].thinking == "Think first." and m.content[2].input == {"a": 1}
    sb, events = ap.StreamBlocks(), []
    for delta in ({"reasoning_content": "Think "}, {"reasoning_content": "first."}, {"content": "Answer."}):
        events += sb.push(delta)
    events += sb.close()
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    parsed = [adapter.validate_python(data) for _, data in events]
    thinking = "".join(
        e.delta.thinking for e in parsed if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    assert thinking == "Think first." and parsed[0].content_block.type == "thinking"
    assert [e.type for e in parsed].count("content_block_stop") == 2
