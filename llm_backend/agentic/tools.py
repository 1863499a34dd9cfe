"""Tool calling in MiMo's XML format: tool definitions and `tool_choice` checked, conversations with tool calls
and tool results made ready for the chat template, and the model's tool-call text parsed into OpenAI's
`tool_calls`, whole or as streaming deltas.

The format (MiMo's; vLLM reads it with its qwen3_xml parser; the shipped model's template writes it):

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

A VALUE is raw text for a parameter whose schema type is "string", JSON otherwise (a value that is not JSON
stays a string). `function.arguments` is `json.dumps` of the parameters in their order.

`ToolCallStream` is the one parser, for streams and whole texts alike (a whole text is one delta), so the
streamed deltas concatenate to the non-streamed message by construction. It is a state machine over the content
text: outside a call it emits text, holding back a partial `<tool_call>` and trailing newlines (newlines right
before a call or at the end are dropped: the template writes content + "\\n" + the call); inside a call it emits
the call's name once `<function=NAME>` is complete (a NAME that is not a declared tool turns the block back into
text), then each parameter's `"KEY": VALUE` JSON fragment once its `</parameter>` arrives (`{` before the first,
`, ` between), and `}` at `</function>`. With `parallel_tool_calls: false` calls after the first are dropped.
Reasoning never reaches this parser (reasoning.py splits it off first), so a call inside `<think>` is no call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNC_END, PARAM_END = "</function>", "</parameter>"
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_FUNC_RE = re.compile(r"\s*<function=([^>\n]*)>")
_PARAM_RE = re.compile(r"\s*<parameter=([^>\n]*)>")


class ToolError(ValueError):
    """A tool definition, tool_choice or message that cannot be used; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"'{param}': {message}")
        self.param, self.detail = param, message


@dataclass
class ToolSpec:
    """The request's tools: `functions` maps a name to its definition; `choice` is "none", "auto", "required" or
    the name of the one function that must be called."""

    functions: dict[str, dict] = field(default_factory=dict)
    choice: str = "auto"
    named: bool = False  # choice names a function
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the completion is parsed for tool calls."""
        return bool(self.functions) and self.choice != "none"

    def template_tools(self) -> list[dict] | None:
        return [{"type": "function", "function": f} for f in self.functions.values()] or None

    def schema(self, name: str) -> dict:
        params = self.functions[name].get("parameters")
        return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def _check_schema(schema: Any, param: str) -> None:
    import jsonschema

    if not isinstance(schema, dict):
        raise ToolError(param, "expected a JSON schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ToolError(param, f"is not a valid JSON schema: {e.message}") from None


def parse_tools(body: dict) -> ToolSpec:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request (ToolError names the bad field)."""
    spec = ToolSpec()
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools", "expected an array of tool definitions")
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolError(f"{p}.type", "only tools of type 'function' are supported")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{p}.function", "expected an object with 'name' and 'parameters'")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolError(f"{p}.function.name", "expected 1-64 characters of a-z, A-Z, 0-9, '_', '-' or '.'")
        if name in spec.functions:
            raise ToolError(f"{p}.function.name", f"the function {name!r} is declared twice")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"{p}.function.description", "expected a string")
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"{p}.function.parameters")
        spec.functions[name] = {k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")}
    _parse_choice(body.get("tool_choice"), spec)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "expected a boolean")
    spec.parallel = parallel is not False
    return spec


def _parse_choice(choice: Any, spec: ToolSpec) -> None:
    if choice is None:
        spec.choice = "auto" if spec.functions else "none"
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError("tool_choice", f"expected 'none', 'auto', 'required' or a named function, got {choice!r}")
        if choice == "required" and not spec.functions:
            raise ToolError("tool_choice", "'required' needs at least one tool in 'tools'")
        spec.choice = choice
        return
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", "expected {'type': 'function', 'function': {'name': ...}}")
    if name not in spec.functions:
        raise ToolError("tool_choice.function.name", f"no tool named {name!r} in 'tools'")
    spec.choice, spec.named = name, True


# ---------------------------------------------------------------------------------------- conversations
def template_message(m: dict, role: str, p: str, content: Any) -> dict:
    """A message as the chat template reads it: an assistant turn's `tool_calls` (arguments parsed from their
    JSON strings) and `reasoning_content`, a tool result's `tool_call_id`."""
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        tid = m.get("tool_call_id")
        if tid is not None and not isinstance(tid, str):
            raise ToolError(f"{p}.tool_call_id", "expected a string")
        out["tool_call_id"] = tid or ""
        return out
    if role != "assistant":
        return out
    rc = m.get("reasoning_content")
    if rc is not None:
        if not isinstance(rc, str):
            raise ToolError(f"{p}.reasoning_content", "expected a string")
        out["reasoning_content"] = rc
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise ToolError(f"{p}.tool_calls", "expected an array")
    out["tool_calls"] = [_template_call(c, f"{p}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _template_call(c: Any, p: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(f"{p}.function", "expected an object with 'name' and 'arguments'")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as e:
            raise ToolError(f"{p}.function.arguments", f"is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ToolError(f"{p}.function.arguments", "expected a JSON object")
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ---------------------------------------------------------------------------------------- parsing
def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: raw text for strings, JSON for the rest (text when not JSON)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = types if isinstance(types, list) else [types]
    if "string" in types and len(types) == 1:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _hold_partial(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _may_open(buf: str) -> bool:
    """Whether `buf` (after `<tool_call>`) can still become `<function=NAME>`."""
    s = buf.lstrip()
    if len(s) <= len("<function="):
        return "<function=".startswith(s)
    return s.startswith("<function=") and ">" not in s and "\n" not in s and len(s) < 80


class ToolCallStream:
    """`push(text)` / `flush()` -> events: ("content", text), ("call", index, id, name), ("args", index, text)."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.buf = ""
        self.newlines = ""  # held-back newlines of the text
        self.in_call = False
        self.name = ""  # the current call's function ("" until <function=NAME> is read)
        self.n_params = 0
        self.calls = 0  # calls emitted
        self.dropping = False  # a call after the first with parallel_tool_calls false

    def push(self, text: str) -> list[tuple]:
        self.buf += text
        return self._run(final=False)

    def flush(self) -> list[tuple]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        while self._step(out, final):
            pass
        return out

    def _text(self, out: list, s: str) -> None:
        body = s.rstrip("\n")
        if body:
            out.append(("content", self.newlines + body))
            self.newlines = ""
        self.newlines += s[len(body) :]

    def _step(self, out: list, final: bool) -> bool:
        """Consumes what it can of the buffer; whether to call again."""
        if not self.in_call:
            k = self.buf.find(CALL_START)
            if k < 0:
                hold = 0 if final else _hold_partial(self.buf, CALL_START)
                self._text(out, self.buf[: len(self.buf) - hold])
                self.buf = self.buf[len(self.buf) - hold :]
                return False
            self._text(out, self.buf[:k])
            self.newlines = ""  # dropped before a call
            self.buf = self.buf[k + len(CALL_START) :]
            self.in_call, self.name, self.n_params = True, "", 0
            return True
        if not self.name:
            return self._read_name(out, final)
        return self._read_body(out, final)

    def _read_name(self, out: list, final: bool) -> bool:
        m = _FUNC_RE.match(self.buf)
        if m is None or m.group(1).strip() not in self.spec.functions:
            if m is None and not final and _may_open(self.buf):
                return False
            self.in_call = False  # not a call of a declared function: the block is text
            self._text(out, CALL_START)
            return True
        self.name = m.group(1).strip()
        self.buf = self.buf[m.end() :]
        self.dropping = self.calls > 0 and not self.spec.parallel
        if not self.dropping:
            out.append(("call", self.calls, f"call_{uuid.uuid4().hex[:24]}", self.name))
        return True

    def _close(self, out: list) -> None:
        if not self.dropping:
            out.append(("args", self.calls, "}" if self.n_params else "{}"))
            self.calls += 1
        self.in_call, self.name = False, ""

    def _read_body(self, out: list, final: bool) -> bool:
        stripped = self.buf.lstrip()
        if stripped.startswith(FUNC_END):
            rest = stripped[len(FUNC_END) :].lstrip()
            if rest.startswith(CALL_END):
                rest = rest[len(CALL_END) :]
            elif not final and CALL_END.startswith(rest):
                return False  # wait for </tool_call>
            self._close(out)
            self.buf = rest
            return True
        m = _PARAM_RE.match(self.buf)
        end = self.buf.find(PARAM_END)
        if m is None or end < m.end():
            if final:  # cut off (or malformed): the call ends with what it has
                self._close(out)
                self.buf = ""
            return False
        key = m.group(1).strip()
        raw = self.buf[m.end() : end]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = convert_value(raw, self.spec.schema(self.name).get("properties", {}).get(key))
        if not self.dropping:
            frag = ("{" if not self.n_params else ", ") + json.dumps(key, ensure_ascii=False) + ": "
            out.append(("args", self.calls, frag + json.dumps(value, ensure_ascii=False)))
        self.n_params += 1
        self.buf = self.buf[end + len(PARAM_END) :]
        return True


def assemble(events: list[tuple]) -> tuple[str, list[dict]]:
    """The content and the `tool_calls` of a message from all of its events."""
    content: list[str] = []
    calls: list[dict] = []
    for ev in events:
        if ev[0] == "content":
            content.append(ev[1])
        elif ev[0] == "call":
            calls.append({"id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}})
        else:
            calls[ev[1]]["function"]["arguments"] += ev[2]
    return "".join(content), calls


def delta(ev: tuple) -> dict:
    """A streamed chat delta of one event."""
    if ev[0] == "content":
        return {"content": ev[1]}
    if ev[0] == "call":
        call = {"index": ev[1], "id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}}
        return {"tool_calls": [call]}
    return {"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}
