"""The reasoning and tool-call parsers: whole texts give OpenAI's message, any chunking of the same text streams
deltas that assemble to exactly that message, a call inside <think> is reasoning, and the request side (tools,
tool_choice, conversations with tool calls) renders the way the shipped model was trained."""

from __future__ import annotations

import json
import random

import pytest

from llm_backend.agentic.output import ChatOutput
from llm_backend.agentic.reasoning import split
from llm_backend.agentic.request import parse_agentic
from llm_backend.agentic.tools import ToolError, parse_tools, template_message
from llm_backend.server.chat_template import load_chat_template
from mimo_epd.train.samples import TOOLS

SPEC = parse_tools({"tools": TOOLS})
CALL = "<tool_call>\n<function=search_docs>\n<parameter=query>\nlists\n</parameter>\n</function>\n</tool_call>"
TEXTS = [
    "Plain answer.\n",
    "Sure.\n" + CALL,
    CALL + "\n" + CALL.replace("lists", "dicts"),
    "a <tool_call> b <tool_call>\n<function=undeclared>\n</function>\n</tool_call> done",
    "<tool_call>\n<function=run_python>\n<parameter=code>\nprint(1)\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=search_docs>\n<parameter=query>\ncut off",
]


def streamed(text: str, thinking: bool, rng: random.Random, spec=SPEC) -> tuple[ChatOutput, list[dict]]:
    out, deltas, i = ChatOutput(thinking, spec), [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        deltas += out.push(text[i : i + k])
        i += k
    return out, deltas + out.flush()


def assemble_deltas(deltas: list[dict]) -> dict:
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if c.get("id"):
                msg["tool_calls"].append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                msg["tool_calls"][c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return msg


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_assemble_to_the_whole_message(text, thinking):
    full = (
        "Let me call <tool_call>\n<function=search_docs>\n</function>\n</tool_call>\n</think>\n\n" if thinking else ""
    ) + text
    whole = ChatOutput.whole(full, thinking, SPEC).message()
    rng = random.Random(0)
    for _ in range(50):
        out, deltas = streamed(full, thinking, rng)
        got = assemble_deltas(deltas)
        assert got["content"] == (whole["content"] or "")
        assert got["reasoning_content"] == (whole.get("reasoning_content") or "")
        want_calls = whole.get("tool_calls", [])
        assert [c["function"] for c in got["tool_calls"]] == [c["function"] for c in want_calls]
        assert out.message()["tool_calls" if want_calls else "content"] is not None


def test_tool_calls_parse_into_openai_messages():
    m = ChatOutput.whole("Sure.\n" + CALL, tools=SPEC)
    assert m.message()["content"] == "Sure." and m.finish_reason("stop") == "tool_calls"
    (call,) = m.message()["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "search_docs", "arguments": json.dumps({"query": "lists"})}
    two = ChatOutput.whole(TEXTS[2], tools=SPEC).message()
    assert [json.loads(c["function"]["arguments"]) for c in two["tool_calls"]] == [
        {"query": "lists"},
        {"query": "dicts"},
    ]
    assert two["content"] is None
    one = ChatOutput.whole(TEXTS[2], tools=parse_tools({"tools": TOOLS, "parallel_tool_calls": False})).message()
    assert len(one["tool_calls"]) == 1
    undeclared = ChatOutput.whole(TEXTS[3], tools=SPEC)
    assert not undeclared.has_calls and "<function=undeclared>" in undeclared.message()["content"]
    assert not ChatOutput.whole(CALL, tools=parse_tools({"tools": TOOLS, "tool_choice": "none"})).has_calls
    assert not ChatOutput.whole(CALL).has_calls  # no tools declared: the text is content


def test_parameter_values_follow_their_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}},
                },
            },
        }
    ]
    text = "<tool_call>\n<function=f>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in (("n", "42"), ("s", "42"), ("o", '{"a": [1]}'))
    )
    args = ChatOutput.whole(text + "</function>\n</tool_call>", tools=parse_tools({"tools": tools})).message()
    assert json.loads(args["tool_calls"][0]["function"]["arguments"]) == {"n": 42, "s": "42", "o": {"a": [1]}}


def test_a_tool_call_inside_the_thinking_block_is_reasoning():
    text = f"I could call it: {CALL}\n</think>\n\nNo call needed."
    m = ChatOutput.whole(text, thinking=True, tools=SPEC)
    assert not m.has_calls and m.finish_reason("stop") == "stop"
    assert m.message()["content"] == "No call needed." and CALL in m.message()["reasoning_content"]


def test_reasoning_split():
    assert split("why\n</think>\n\nanswer", thinking=True) == ("why", "answer")
    assert split("cut inside", thinking=True) == ("cut inside", "")
    assert split("answer", thinking=False) == ("", "answer")
    assert split("<think>\nwhy\n</think>\n\nanswer", thinking=False) == ("why", "answer")
    assert split("why\n</thi", thinking=True, final=False) == ("why", "")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": {}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"chat_template_kwargs": {"enable_thinking": "on"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ],
)
def test_bad_agentic_fields_name_the_field(body, param):
    with pytest.raises(ToolError) as e:
        parse_agentic(body, chat=True)
    assert e.value.param == param


def test_a_tool_round_trip_renders_as_the_model_was_trained():
    """An OpenAI conversation (arguments as a JSON string, a `tool` message) renders exactly as the training
    samples' (arguments as an object), which is the template's own format."""
    call = {"id": "call_1", "type": "function", "function": {"name": "search_docs", "arguments": '{"query": "lists"}'}}
    wire = [
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "look it up"},
        {"role": "tool", "tool_call_id": "call_1", "content": "Lists are sequences."},
    ]
    ours = [template_message(m, m["role"], f"messages[{i}]", m["content"] or "") for i, m in enumerate(wire)]
    tpl = load_chat_template("tiny")
    rendered = tpl.render(ours, tools=TOOLS)
    trained = [
        wire[0],
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "look it up",
            "tool_calls": [{"type": "function", "function": {"name": "search_docs", "arguments": {"query": "lists"}}}],
        },
        {"role": "tool", "content": "Lists are sequences."},
    ]
    assert rendered == tpl.render(trained, tools=TOOLS)
    assert CALL in rendered and "<think>\nlook it up\n</think>" in rendered
    assert "<tool_response>\nLists are sequences.\n</tool_response>" in rendered
    with pytest.raises(ToolError) as e:
        template_message({"tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}, "assistant", "m", "")
    assert e.value.param == "m.tool_calls[0].function.arguments"
