"""A chat completion's text turned into OpenAI's assistant message: reasoning split off first (reasoning.py), then
the content parsed for tool calls (tools.py) when the request declared tools and did not turn them off.

`ChatOutput` is used the same way for both kinds of response: `push(text)` per generated chunk and `flush()` at
the end return streaming deltas; `message()` assembles every delta produced so far into the non-streamed
message. A non-streamed response is therefore the assembly of its own deltas, and a streamed one concatenates to
it whatever the chunking (both parsers are prefix-stable, see their docstrings).
"""

from __future__ import annotations

from .reasoning import ReasoningStream
from .tools import ToolCallStream, ToolSpec, assemble, delta


class ChatOutput:
    @classmethod
    def whole(cls, text: str, thinking: bool = False, tools: ToolSpec | None = None) -> ChatOutput:
        """The output of a finished, non-streamed completion."""
        out = cls(thinking, tools)
        out.push(text)
        out.flush()
        return out

    def __init__(self, thinking: bool = False, tools: ToolSpec | None = None):
        self.thinking = thinking
        self.reasoning = ReasoningStream(thinking)
        self.tools = ToolCallStream(tools) if tools is not None and tools.active else None
        self.reasoning_text: list[str] = []
        self.events: list[tuple] = []

    def _content(self, text: str, final: bool) -> list[tuple]:
        if self.tools is None:
            return [("content", text)] if text else []
        evs = self.tools.push(text) if text else []
        return evs + (self.tools.flush() if final else [])

    def _deltas(self, parts: tuple[str, str], final: bool) -> list[dict]:
        out = []
        if parts[0]:
            self.reasoning_text.append(parts[0])
            out.append({"reasoning_content": parts[0]})
        evs = self._content(parts[1], final)
        self.events += evs
        return out + [delta(e) for e in evs]

    def push(self, text: str) -> list[dict]:
        return self._deltas(self.reasoning.push(text), final=False)

    def flush(self) -> list[dict]:
        return self._deltas(self.reasoning.flush(), final=True)

    @property
    def has_calls(self) -> bool:
        return any(e[0] == "call" for e in self.events)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.has_calls else reason

    def message(self) -> dict:
        content, calls = assemble(self.events)
        msg: dict = {"role": "assistant", "content": content if content or not calls else None}
        reasoning = "".join(self.reasoning_text)
        if reasoning or self.thinking:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = calls
        return msg
