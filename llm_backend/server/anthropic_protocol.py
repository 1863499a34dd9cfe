"""The Anthropic Messages API (`POST /v1/messages`), as agent harnesses speak it, over the same generation path as
the OpenAI chat API.

A request is translated into the OpenAI chat shape (mimo_epd/common/anthropic_rules.py, the rule the router's front
shares) and parsed by `openai_protocol.parse_chat`, so every check, limit and the chat template are the chat API's.
`POST /v1/messages/count_tokens` answers `{"input_tokens"}` of the same prompt.

The answer: content blocks in order (`thinking`, `text`, `tool_use` with the parsed `input`), `stop_reason`
`end_turn`, `max_tokens`, `stop_sequence` (with `stop_sequence`) or `tool_use`, and `usage` (`input_tokens`,
`output_tokens`, `cache_read_input_tokens`). Streamed: `message_start`, then per block `content_block_start`,
its deltas (`text_delta`, `thinking_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta`
(stop reason, output tokens) and `message_stop`, as Anthropic's SSE events.
"""

from __future__ import annotations

import json
import uuid

from mimo_epd.common.anthropic_rules import to_chat
from mimo_epd.common.prompt_rules import RuleError

from . import openai_protocol as proto
from .core import Final, ServeError


def parse_messages(body, max_samples: int = 16, require_max_tokens: bool = True) -> proto.GenRequest:
    """An Anthropic Messages request as the chat API's GenRequest (mimo_epd/common/anthropic_rules.py)."""
    try:
        chat = to_chat(body, require_max_tokens)
    except RuleError as e:
        raise ServeError.invalid(f"'{e.param}': {e.message}", param=e.param) from None
    if not require_max_tokens:
        chat.setdefault("max_tokens", 1)  # count_tokens: the prompt only
    return proto.parse_chat(chat, max_samples)


def error_event(e: ServeError) -> tuple[str, dict]:
    """A failure after the stream started, as Anthropic's `error` event."""
    kind = (
        "overloaded_error" if e.http_status == 429 else "api_error" if e.http_status >= 500 else "invalid_request_error"
    )
    return "error", {"type": "error", "error": {"type": kind, "message": e.message}}


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
