"""The agentic API with the official `openai` client against `mimo-epd serve` on the shipped trained model:
structured outputs parsed into pydantic objects, a tool round trip streamed and whole, every tool_choice form,
thinking on and off, the vLLM-style extras, and OpenAI-shaped 400s over raw HTTP for every bad field."""

from __future__ import annotations

import json
import re

import aiohttp
import jsonschema
import openai
import pydantic
import pytest

from mimo_epd.train.samples import TOOLS
from tests.conftest import start_server

pytestmark = pytest.mark.integration
QUESTIONS = ["What is a list?", "Explain the dict type.", "Tell me about decorators.", "What is asyncio?"]


class Topic(pydantic.BaseModel):
    topic: str = pydantic.Field(max_length=40)
    summary: str = pydantic.Field(max_length=80)


@pytest.fixture(scope="module")
def node():
    s = start_server(
        ["--http-port", "0", "--llm-kv-cache-tokens", "6000", "--llm-swa-cache-tokens", "1500"],
        subcommand="serve",
        timeout=300,
    )
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(node):
    return openai.OpenAI(base_url=f"http://{node.http_address}/v1", api_key="unused", timeout=120, max_retries=0)


def user(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def test_parse_returns_a_schema_valid_object_for_every_prompt(client):
    for q in QUESTIONS:
        r = client.chat.completions.parse(model="tiny", messages=user(q), response_format=Topic, max_tokens=120)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Topic), r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), Topic.model_json_schema())


def test_json_object_and_the_extras(client):
    r = client.chat.completions.create(
        model="tiny", messages=user(QUESTIONS[0]), response_format={"type": "json_object"}, max_tokens=80
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for extra, check in (
        ({"guided_regex": r"[a-z]{3,6}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'root ::= "(" [a-z]+ ")"'}}, lambda t: re.fullmatch(r"\([a-z]+\)", t)),
    ):
        r = client.chat.completions.create(model="tiny", messages=user(QUESTIONS[1]), max_tokens=20, extra_body=extra)
        assert check(r.choices[0].message.content), (extra, r.choices[0].message.content)
    c = client.completions.create(
        model="tiny", prompt="The answer:", max_tokens=8, extra_body={"guided_choice": ["A", "B"]}
    )
    assert c.choices[0].text in ("A", "B")


def _streamed(client, **kw) -> tuple[dict, str]:
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = ""
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        msg["content"] += d.content or ""
        msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
        for c in d.tool_calls or []:
            if c.id:
                msg["tool_calls"].append({"name": c.function.name, "arguments": c.function.arguments or ""})
            else:
                msg["tool_calls"][c.index]["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return msg, finish


def _whole(r) -> tuple[dict, str]:
    m = r.choices[0].message
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    reasoning = getattr(m, "reasoning_content", None) or ""
    return {"content": m.content or "", "reasoning_content": reasoning, "tool_calls": calls}, r.choices[0].finish_reason


def test_a_tool_round_trip_streamed_and_whole(client):
    messages = user("What does this print?\nprint(1 + 2)")
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=80
    )
    whole, finish = _whole(first)
    assert finish == "tool_calls" and whole["tool_calls"], first
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name in ("search_docs", "run_python") and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict)
    assert _streamed(client, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=80) == (whole, finish)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=40)
    answer = _whole(final)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert _streamed(client, messages=messages, tools=TOOLS, max_tokens=40) == answer


def test_tool_choice_forms(client):
    q = user(QUESTIONS[0])
    auto = client.chat.completions.create(model="tiny", messages=q, tools=TOOLS, max_tokens=80)
    assert auto.choices[0].message.tool_calls, "the shipped model answers this with a call (docs/model.md)"
    none = client.chat.completions.create(model="tiny", messages=q, tools=TOOLS, tool_choice="none", max_tokens=80)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason != "tool_calls"
    named = {"type": "function", "function": {"name": "run_python"}}
    forced = client.chat.completions.create(model="tiny", messages=q, tools=TOOLS, tool_choice=named, max_tokens=80)
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "run_python" and "code" in json.loads(call.function.arguments)
    one = client.chat.completions.create(
        model="tiny", messages=q, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120
    )
    assert len(one.choices[0].message.tool_calls) == 1


def test_thinking_on_and_off(client):
    for thinking in (False, True):
        kw = {
            "messages": user(QUESTIONS[2]),
            "max_tokens": 60,
            "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}},
        }
        r = client.chat.completions.create(model="tiny", **kw)
        whole = _whole(r)
        assert "</think>" not in whole[0]["content"]
        assert _streamed(client, **kw) == whole
        assert (getattr(r.choices[0].message, "reasoning_content", "absent") == "absent") is (not thinking)
    kw["response_format"] = Topic  # thinking stays free, the answer after it is the schema's
    try:
        r = client.chat.completions.parse(model="tiny", **kw | {"max_tokens": 200})
    except openai.LengthFinishReasonError:
        return  # the reasoning took every token: nothing to validate
    assert isinstance(r.choices[0].message.parsed, Topic)


BAD = [
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("extra,param", BAD)
async def test_bad_fields_are_openai_400s(node, extra, param):
    body = {"model": "tiny", "max_tokens": 4, "messages": user("hi"), **extra}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{node.http_address}/v1/chat/completions", json=body) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["type"] == "invalid_request_error" and err["param"] == param, err


async def test_a_grammar_that_cannot_finish_ends_with_length(node):
    body = {"model": "tiny", "max_tokens": 6, "messages": user("hi"), "guided_regex": "a{40}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{node.http_address}/v1/chat/completions", json=body) as r:
            out = await r.json()
    assert r.status == 200 and out["choices"][0]["finish_reason"] == "length"
    assert set(out["choices"][0]["message"]["content"]) <= {"a"}


def test_grpc_generate_takes_the_same_constraints():
    import grpc

    from llm_backend.server.chat_template import load_chat_template
    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    w = start_server(["--kv-cache-tokens", "2048", "--swa-cache-tokens", "1024"], subcommand="llm")
    try:
        stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(w.address))
        prompt = load_chat_template("tiny").render(user(QUESTIONS[0]))
        schema = Topic.model_json_schema()
        req = generator_pb2.GenerateRequest(
            prompt=prompt,
            sampling=generator_pb2.SamplingOptions(max_tokens=120),
            constraint=generator_pb2.OutputConstraint(json_schema=json.dumps(schema)),
        )
        events = list(stub.Generate(req, timeout=120))
        text = "".join(e.delta.text for e in events if e.HasField("delta"))
        assert events[-1].final.finish_reason == "stop"
        Topic.model_validate_json(text)
        bad = generator_pb2.GenerateRequest(
            prompt=prompt,
            constraint=generator_pb2.OutputConstraint(regex="[0-9"),
            sampling=generator_pb2.SamplingOptions(max_tokens=4),
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint.regex" in e.value.details()
    finally:
        assert w.stop() == 0
