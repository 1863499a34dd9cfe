"""The Anthropic Messages API's request translated into the OpenAI chat request the product serves: the rule both
the LLM worker (llm_backend/server/anthropic_protocol.py) and the router's HTTP front (its prompt for affinity
routing) apply, so they see the same prompt. Pure data, no server, no torch.

`system` (a string or text blocks) becomes a system message; content blocks `text`, `image` (`source` base64 or
url), `tool_use` (an assistant's call) and `tool_result` (a user's answer to one: a `tool` message) map to their
OpenAI counterparts; `tools` (`name`, `description`, `input_schema`) become functions and `tool_choice` `auto` /
`any` / `tool` / `none` become `auto` / `required` / a named function / `none`; `stop_sequences` becomes `stop`;
`thinking` `{"type": "enabled"}` turns the template's thinking on. Another top-level field is refused by name.
"""

from __future__ import annotations

import json

from .prompt_rules import RuleError, type_name

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


def _bad(param: str, msg: str) -> RuleError:
    return RuleError(param, msg)


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


def to_chat(body, require_max_tokens: bool = True) -> dict:
    """An Anthropic Messages request body as an OpenAI chat request body (module docstring); RuleError names the
    field in Anthropic's terms."""
    if not isinstance(body, dict):
        raise _bad("body", f"the request body must be a JSON object, got {type_name(body)}")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise _bad(unknown[0], "is not supported by this server")
    if require_max_tokens and body.get("max_tokens") is None:
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
    return chat
