"""The agentic fields of a request, checked: tools (tools.py), `chat_template_kwargs` (with MiMo's
`enable_thinking`, off by default) and, later in the request's life, its output constraint (grammar.py).

Every failure is a `ToolError` naming the field; the front ends turn it into their 400 / INVALID_ARGUMENT."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tools import ToolError, ToolSpec, parse_tools


@dataclass
class AgenticOptions:
    tools: ToolSpec = field(default_factory=ToolSpec)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the chat template

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
    return opts
