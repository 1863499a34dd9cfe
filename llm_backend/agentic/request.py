"""The agentic fields of a request, checked: tools (tools.py), `chat_template_kwargs` (with MiMo's
`enable_thinking`, off by default) and the output constraint (grammar.py compiles it):

- `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (the schema is always enforced, strict or not);
- vLLM's extras, top-level `guided_json`, `guided_regex`, `guided_grammar` (EBNF), `guided_choice`, or the same
  keys (`json`, `regex`, `grammar`, `choice`) inside `structured_outputs`;
- strict tool calling: `tool_choice` `required` or a named function, or `auto` when a tool sets `strict: true`
  (then only the calls are constrained, text between them is free).

At most one of these may constrain a request. Every failure is a `ToolError` naming the field; the front ends
turn it into their 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .grammar import ConstraintSpec
from .tools import ToolError, ToolSpec, check_schema, parse_tools

EXTRAS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "choice"}


@dataclass
class AgenticOptions:
    tools: ToolSpec = field(default_factory=ToolSpec)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the chat template
    constraint: ConstraintSpec | None = None  # what the output must match (thinking applied)

    @property
    def thinking(self) -> bool:
        """Whether the completion starts inside a `<think>` block (the template opened it)."""
        return bool(self.template_kwargs.get("enable_thinking"))

    def render_kwargs(self) -> dict[str, Any]:
        """The chat template's arguments besides the messages."""
        return {**self.template_kwargs, "tools": self.tools.template_tools()}


def parse_agentic(body: dict, chat: bool) -> AgenticOptions:
    opts = AgenticOptions()
    if not chat:
        opts.constraint = _constraint(body, opts)
        return opts
    opts.tools = parse_tools(body)
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise ToolError("chat_template_kwargs", "expected an object")
        for key in ("messages", "tools", "add_generation_prompt", "documents"):
            if key in kw:
                raise ToolError(f"chat_template_kwargs.{key}", "is set by the server, not by the request")
        et = kw.get("enable_thinking")
        if et is not None and not isinstance(et, bool):
            raise ToolError("chat_template_kwargs.enable_thinking", "expected a boolean")
        opts.template_kwargs = dict(kw)
    opts.constraint = _constraint(body, opts)
    return opts


def _constraint(body: dict, opts: AgenticOptions) -> ConstraintSpec | None:
    found = [c for c in (_response_format(body), *_extras(body), _strict_tools(opts.tools)) if c is not None]
    if len(found) > 1:
        names = " and ".join(f"'{c.param}'" for c in found)
        raise ToolError(found[1].param, f"only one output constraint per request, got {names}")
    if not found:
        return None
    c = found[0]
    return ConstraintSpec(c.kind, c.value, c.param, thinking=opts.thinking)


def _response_format(body: dict) -> ConstraintSpec | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", True, "response_format")
    if kind != "json_schema":
        raise ToolError("response_format.type", "expected 'text', 'json_object' or 'json_schema'")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ToolError("response_format.json_schema", "expected an object with 'name' and 'schema'")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise ToolError("response_format.json_schema.strict", "expected a boolean")
    schema = js.get("schema", {"type": "object"})
    check_schema(schema, "response_format.json_schema.schema")
    return ConstraintSpec("json_schema", schema, "response_format.json_schema.schema")


def _extras(body: dict) -> list[ConstraintSpec | None]:
    out: list[ConstraintSpec | None] = []
    so = body.get("structured_outputs")
    if so is not None and not isinstance(so, dict):
        raise ToolError("structured_outputs", "expected an object")
    sources = [(f"guided_{k}", body.get(f"guided_{k}")) for k in EXTRAS]
    sources += [(f"structured_outputs.{k}", (so or {}).get(k)) for k in EXTRAS]
    for param, v in sources:
        if v is None:
            continue
        key = param.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
        out.append(_extra(EXTRAS[key], v, param))
    return out


def _extra(kind: str, v: Any, param: str) -> ConstraintSpec:
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ToolError(param, f"is not valid JSON: {e}") from None
        check_schema(v, param)
    elif kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise ToolError(param, "expected a non-empty array of non-empty strings")
    elif not isinstance(v, str) or not v:
        raise ToolError(param, "expected a non-empty string")
    return ConstraintSpec(kind, v, param)


def _strict_tools(tools: ToolSpec) -> ConstraintSpec | None:
    """MiMo's tool-call format held to the tools' schemas: when a call is required, or any tool asks for strict."""
    if not tools.active:
        return None
    decl = tools.template_tools() or []
    if tools.named:
        choice: Any = {"type": "function", "function": {"name": tools.choice}}
    elif tools.choice == "required":
        choice = "required"
    elif any(f.get("strict") is True for f in tools.functions.values()):
        choice = "auto"
    else:
        return None
    return ConstraintSpec("tools", {"tools": decl, "tool_choice": choice, "parallel": tools.parallel}, "tool_choice")


def constraint_from_proto(c) -> ConstraintSpec | None:
    """gRPC `GenerateRequest.constraint` (an OutputConstraint message) as a ConstraintSpec; ToolError names the field."""
    kind = c.WhichOneof("kind")
    if kind is None:
        return None
    param = f"constraint.{kind}"
    if kind == "json_object":
        spec = ConstraintSpec("json_object", True, param)
    elif kind == "json_schema":
        spec = _extra("json_schema", c.json_schema, param)
    elif kind == "choice":
        spec = _extra("choice", list(c.choice.choices), param)
    else:
        spec = _extra(EXTRAS["grammar"] if kind == "ebnf" else "regex", getattr(c, kind), param)
    return ConstraintSpec(spec.kind, spec.value, param, thinking=c.thinking)
