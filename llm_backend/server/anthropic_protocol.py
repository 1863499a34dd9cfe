"""The Anthropic Messages API (`POST /v1/messages`), as agent harnesses speak it, over the same generation path as
the OpenAI chat API.

A request is translated into the OpenAI chat shape and parsed by `openai_protocol.parse_chat` (so every check,
limit and the chat template are the chat API's): `system` (a string or text blocks) becomes a system message;
content blocks `text`, `image` (`source` base64 or url), `tool_use` (an assistant's call) and `tool_result` (a
user's answer to one: a `tool` message) map to their OpenAI counterparts; `tools` (`name`, `description`,
`input_schema`) become functions and `tool_choice` `auto` / `any` / `tool` / `none` become `auto` / `required` /
a named function / `none`; `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens` (required), `stream`;
`thinking` `{"type": "enabled"}` opens the model's reasoning block. Fields the server does not implement
(`metadata` aside) get a 400 naming them.

The answer: content blocks in order (`thinking`, `text`, `tool_use` with the parsed `input`), `stop_reason`
`end_turn`, `max_tokens`, `stop_sequence` (with `stop_sequence`) or `tool_use`, and `usage` (`input_tokens`,
`output_tokens`, `cache_read_input_tokens`). Streamed: `message_start`, then per block `content_block_start`,
its deltas (`text_delta`, `thinking_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta`
(stop reason, output tokens) and `message_stop`, as Anthropic's SSE events.
"""

from __future__ import annotations

import json
import uuid

from mimo_epd.common.prompt_rules import type_name

from . import openai_protocol as proto
from .core import Final, ServeError

KNOWN = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
}


def _bad(param: str, msg: str) -> ServeError:
    return ServeError.invalid(f"'{param}': {msg}", param=param)


def _text_of(blocks, param: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(param, f"expected a string or an array of text blocks, got {type_name(blocks)}")
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{param}[{i}]", "expected a text block")
        out.append(b["text"])
    return "".join(out)


def _image(block: dict, param: str) -> dict:
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(f"{param}.source", "expected an object")
    if src.get("type") == "base64":
        if not isinstance(src.get("data"), str) or not isinstance(src.get("media_type"), str):
            raise _bad(f"{param}.source", "base64 sources need media_type and data")
        url = f"data:{src['media_type']};base64,{src['data']}"
    elif src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise _bad(f"{param}.source.type", "expected base64 or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _message(m, i: int) -> list[dict]:
    """One Anthropic message as OpenAI chat messages (a user message with tool results becomes tool messages)."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(param, f"expected an object, got {type_name(m)}")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise _bad(f"{param}.role", f"expected user or assistant, got {str(role)[:32]!r}")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{param}.content", f"expected a string or an array of blocks, got {type_name(content)}")
    parts: list[dict] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, b in enumerate(content):
        bp = f"{param}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(b, bp))
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                {
                    "id": str(b.get("id", "")),
                    "type": "function",
                    "function": {"name": str(b.get("name", "")), "arguments": json.dumps(b.get("input", {}))},
                }
            )
        elif kind == "tool_result" and role == "user":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": str(b.get("tool_use_id", "")),
                    "content": _text_of(b.get("content", ""), f"{bp}.content"),
                }
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not replayed (the chat template drops it too)
        else:
            raise _bad(bp, f"unsupported block {str(kind)[:32]!r} in a {role} message")
    out: list[dict] = list(results)
    if parts or calls or not results:
        msg: dict = {"role": role, "content": parts or ""}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") is not None:
            raise _bad("tool_choice", "needs tools")
        return
    if not isinstance(tools, list):
        raise _bad("tools", f"expected an array, got {type_name(tools)}")
    chat["tools"] = [
        {
            "type": "function",
            "function": {
                "name": t.get("name") if isinstance(t, dict) else None,
                "description": t.get("description", "") if isinstance(t, dict) else "",
                "parameters": t.get("input_schema", {}) if isinstance(t, dict) else {},
            },
        }
        for t in tools
    ]
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("tool_choice", "expected {type: auto | any | none | tool (with name)}")
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def parse_messages(body, max_samples: int = 16) -> proto.GenRequest:
    """An Anthropic Messages request as the chat API's GenRequest (module docstring)."""
    if not isinstance(body, dict):
        raise ServeError.invalid(f"the request body must be a JSON object, got {type_name(body)}")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise _bad(unknown[0], "is not supported by this server")
    if body.get("max_tokens") is None:
        raise _bad("max_tokens", "is required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty array")
    chat: dict = {"messages": []}
    if body.get("system") is not None:
        chat["messages"].append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, m in enumerate(messages):
        chat["messages"] += _message(m, i)
    for key in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream"):
        if key in body:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    _tools(body, chat)
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise _bad("thinking", "expected {type: enabled | disabled}")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    return proto.parse_chat(chat, max_samples)


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def stop_reason(finish: str, final: Final) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if finish == "stop" and isinstance(final.matched_stop, str):
        return "stop_sequence", final.matched_stop
    return STOP_REASONS.get(finish, "end_turn"), None


def blocks(message: dict) -> list[dict]:
    """An OpenAI assistant message (agentic/output.py) as Anthropic content blocks."""
    out: list[dict] = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            args = {"_raw": call["function"]["arguments"]}
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args})
    return out


def usage(final: Final, output_tokens: int | None = None) -> dict:
    return {
        "input_tokens": final.prompt_tokens - final.cached_tokens,
        "output_tokens": final.completion_tokens if output_tokens is None else output_tokens,
        "cache_read_input_tokens": final.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message_response(rid: str, model: str, message: dict, finish: str, final: Final) -> dict:
    reason, seq = stop_reason(finish, final)
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks(message),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(final),
    }


class StreamBlocks:
    """Turns the chat output's streaming deltas (agentic/output.py) into Anthropic's block events."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None  # "text", "thinking", or "tool:<openai index>"

    def _open(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        evs = self.close()
        self.index += 1
        self.kind = kind
        return evs + [
            ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        ]

    def close(self) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, d: dict) -> tuple[str, dict]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": d})

    def push(self, delta: dict) -> list[tuple[str, dict]]:
        evs: list[tuple[str, dict]] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                evs += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            evs.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                evs += self._open("text", {"type": "text", "text": ""})
            evs.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            kind = f"tool:{call.get('index', 0)}"
            fn = call.get("function") or {}
            if self.kind != kind:
                block = {"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""), "input": {}}
                evs += self._open(kind, block)
            if fn.get("arguments"):
                evs.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return evs
