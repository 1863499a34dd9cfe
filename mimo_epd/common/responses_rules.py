"""The OpenAI Responses API's request translated into the OpenAI chat request the product serves: the rule both the
LLM worker (llm_backend/server/responses_protocol.py) and the router's HTTP front (its prompt for affinity routing)
apply, so they see the same prompt. Pure data, no server, no torch.

`instructions` becomes a system message; `input` is a string (one user message) or a list of items: messages
(`role` user / assistant / system / developer, `content` a string or parts `input_text` / `output_text` /
`input_image` with `image_url`), `function_call` (an assistant's call: `call_id`, `name`, `arguments`) and
`function_call_output` (its result: a `tool` message), `reasoning` items (dropped: the template re-renders
thinking); `tools` of type `function` (`name`, `description`, `parameters`, `strict`) become functions and
`tool_choice` `auto` / `none` / `required` / `{type: function, name}` the chat's; `max_output_tokens` becomes
`max_tokens`; `text.format` (`text`, `json_object`, `json_schema` with `name` / `schema` / `strict`) becomes
`response_format`; `reasoning` (an `effort`) turns the template's thinking on. `previous_response_id`'s stored
conversation is the caller's to give (`history`); `background` is refused by name, as is any field not listed here.
"""

from __future__ import annotations

from .prompt_rules import RuleError, type_name

KNOWN = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "metadata",
    "store",
    "user",
    "truncation",
    "service_tier",
    "top_logprobs",
    "previous_response_id",
    "include",
    "background",
}
ROLES = ("user", "assistant", "system", "developer")


def _bad(param: str, msg: str) -> RuleError:
    return RuleError(param, msg)


def _part(p, param: str) -> dict:
    if not isinstance(p, dict):
        raise _bad(param, f"expected a content part object, got {type_name(p)}")
    kind = p.get("type")
    if kind in ("input_text", "output_text", "text"):
        if not isinstance(p.get("text"), str):
            raise _bad(f"{param}.text", "expected a string")
        return {"type": "text", "text": p["text"]}
    if kind == "input_image":
        url = p.get("image_url")
        if not isinstance(url, str):
            raise _bad(f"{param}.image_url", "expected a URL or a data: URI (file_id is not served here)")
        return {"type": "image_url", "image_url": {"url": url}}
    raise _bad(f"{param}.type", f"expected input_text, output_text or input_image, got {str(kind)[:32]!r}")


def _content(content, param: str):
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, f"expected a string or an array of content parts, got {type_name(content)}")
    parts = [_part(p, f"{param}[{i}]") for i, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _item(item, i: int, out: list[dict]) -> None:
    """One input item appended to the chat messages `out` (a function call joins the assistant turn before it)."""
    param = f"input[{i}]"
    if not isinstance(item, dict):
        raise _bad(param, f"expected an object, got {type_name(item)}")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise _bad(f"{param}.role", f"expected one of {', '.join(ROLES)}, got {str(role)[:32]!r}")
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(item.get("content"), f"{param}.content"),
            }
        )
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _bad(f"{param}.{key}", "expected a string")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        if out and out[-1]["role"] == "assistant" and not out[-1].get("content"):
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _bad(f"{param}.call_id", "expected a string")
        output = item.get("output")
        if not isinstance(output, str):
            raise _bad(f"{param}.output", "expected a string")
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind != "reasoning":
        raise _bad(
            f"{param}.type",
            f"expected message, function_call, function_call_output or reasoning, got {str(kind)[:32]!r}",
        )


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", f"expected an array, got {type_name(tools)}")
        chat["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise _bad(f"tools[{i}].type", "only function tools are served here")
            fn = {
                "name": t.get("name"),
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {},
            }
            if t.get("strict") is not None:
                fn["strict"] = t["strict"]
            chat["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("tool_choice", "expected auto, none, required or {type: function, name}")


def _text_format(body: dict, chat: dict) -> None:
    text = body.get("text")
    if text is None:
        return
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise _bad("text.format.type", "expected text, json_object or json_schema")


def to_chat(body, history: list[dict] | None = None) -> dict:
    """A Responses API request body as an OpenAI chat request body (module docstring); RuleError names the field in
    the Responses API's terms. `history`: the chat messages of the stored conversation `previous_response_id`
    names (the worker's store), placed after this request's instructions."""
    if not isinstance(body, dict):
        raise _bad("body", f"the request body must be a JSON object, got {type_name(body)}")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise _bad(unknown[0], "is not supported by this server")
    if body.get("background"):
        raise _bad("background", "background responses are not served here")
    chat: dict = {"messages": []}
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("instructions", "expected a string")
        chat["messages"].append({"role": "system", "content": body["instructions"]})
    chat["messages"] += history or []
    items = body.get("input")
    if isinstance(items, str):
        chat["messages"].append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            _item(item, i, chat["messages"])
    else:
        raise _bad("input", "expected a string or a non-empty array of input items")
    for key in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    _tools(body, chat)
    _text_format(body, chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _bad("reasoning", f"expected an object, got {type_name(reasoning)}")
        chat["chat_template_kwargs"] = {"enable_thinking": reasoning.get("effort") not in (None, "none", "minimal")}
    return chat
