"""The OpenAI Responses API (`POST /v1/responses`), over the same generation path as the chat API.

A request is translated into the chat shape (mimo_epd/common/responses_rules.py, the rule the router's front
shares) and parsed by `openai_protocol.parse_chat`, so every check, limit and the chat template are the chat API's.

The answer is a `response` object: `output` items in order (`reasoning` with its text, a `message` with one
`output_text` part, a `function_call` per tool call), `status` `completed`, or `incomplete` with
`incomplete_details.reason` `max_output_tokens`, and `usage` (`input_tokens` with `cached_tokens`, `output_tokens`).
Streamed: `response.created` and `response.in_progress`, then per item `response.output_item.added`, its parts and
deltas (`response.content_part.added`, `response.output_text.delta` / `.done`, `response.reasoning_text.delta` /
`.done`, `response.function_call_arguments.delta` / `.done`), `response.output_item.done`, and finally
`response.completed` (or `response.incomplete`) with the whole response, every event numbered
(`sequence_number`), as OpenAI's SSE events. Nothing is stored: the id names this answer only.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict

from mimo_epd.common.prompt_rules import RuleError
from mimo_epd.common.responses_rules import to_chat

from . import openai_protocol as proto
from .core import Final, ServeError


def parse_responses(body, max_samples: int = 16, history: list[dict] | None = None) -> tuple[proto.GenRequest, list]:
    """The chat API's request, and the chat messages it was parsed from (what ResponseStore keeps). `history`: the
    stored conversation `previous_response_id` names (ResponseStore.get)."""
    try:
        chat = to_chat(body, history)
    except RuleError as e:
        raise ServeError.invalid(f"'{e.param}': {e.message}", param=e.param) from None
    return proto.parse_chat(chat, max_samples), chat["messages"]


def new_id(prefix: str = "resp") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(final: Final) -> dict:
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def items(message: dict, status: str = "completed") -> list[dict]:
    """An OpenAI assistant message (agentic/output.py) as Responses output items; the last one takes `status` (the
    item a token limit cut is `incomplete`, like the response)."""
    out: list[dict] = []
    if message.get("reasoning_content"):
        text = message["reasoning_content"]
        out.append(reasoning_item(new_id("rs"), text, "completed"))
    if message.get("content"):
        out.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        out.append(call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"] or "", "completed"))
    if out:
        out[-1]["status"] = status
    return out


def reasoning_item(iid: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": iid, "summary": [], "content": content, "status": status}


def message_item(iid: str, text: str | None, status: str) -> dict:
    content = [text_part(text)] if text is not None else []
    return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": content}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": iid,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    rid: str, model: str, body: dict, output: list[dict], status: str, final: Final | None, stored: bool = False
) -> dict:
    """The `response` object (`final` None while it is in progress)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning"),
        "store": stored,
        "previous_response_id": body.get("previous_response_id"),
        "metadata": body.get("metadata") or {},
        "usage": usage(final) if final is not None else None,
    }


def status_of(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


class ResponseStore:
    """Answers kept for `previous_response_id`: each answer's conversation as chat messages (the request's, without
    its instructions, which OpenAI does not carry over, then the answer), at most `size` of them, each for `ttl_s`
    seconds; the oldest dropped first. A request with `store: false` is not kept."""

    def __init__(self, size: int = 1024, ttl_s: float = 3600.0):
        self.size, self.ttl_s = size, ttl_s
        self._items: OrderedDict[str, tuple[float, list[dict]]] = OrderedDict()

    def put(self, rid: str, body: dict, messages: list[dict], answer: dict) -> bool:
        """Keeps the conversation (True) unless the request said `store: false` or the store holds none."""
        if body.get("store") is False or self.size == 0:
            return False
        convo = list(messages[1:] if body.get("instructions") is not None else messages)
        reply = {"role": "assistant", "content": answer.get("content")}
        if answer.get("tool_calls"):
            reply["tool_calls"] = answer["tool_calls"]
        self._items[rid] = (time.monotonic() + self.ttl_s, [*convo, reply])
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return True

    def get(self, rid) -> list[dict] | None:
        """The conversation `rid` continues (None when no id is given); a 400 naming `previous_response_id` when
        it is not kept (expired, dropped or never answered here)."""
        if rid is None:
            return None
        if not isinstance(rid, str):
            raise ServeError.invalid("'previous_response_id': expected a string", param="previous_response_id")
        now = time.monotonic()
        while self._items and next(iter(self._items.values()))[0] <= now:
            self._items.popitem(last=False)  # expired (entries are in insertion order: the same TTL each)
        item = self._items.get(rid)
        if item is None:
            raise ServeError.invalid(
                f"'previous_response_id': {rid[:64]!r} is not stored on this server: answers are kept "
                f"{self.ttl_s:g} s, at most {self.size} of them (--responses-store-ttl-s, --responses-store-size), "
                "and only by the worker that gave them; send the whole conversation in 'input'",
                param="previous_response_id",
            )
        return list(item[1])


class StreamItems:
    """Turns the chat output's streaming deltas (agentic/output.py) into the Responses API's item events; keeps the
    items for the final `response` object."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []
        self.kind: str | None = None  # "reasoning", "message" or "tool:<openai index>"
        self.text = ""

    def event(self, name: str, **data) -> tuple[str, dict]:
        ev = {"type": name, "sequence_number": self.seq, **data}
        self.seq += 1
        return name, ev

    def error(self, e: ServeError) -> tuple[str, dict]:
        """A failure after the stream started, as the Responses API's `error` event (numbered like the rest)."""
        return self.event("error", code=e.err_code or None, message=e.message, param=e.param)

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open(self, kind: str, item: dict) -> list[tuple[str, dict]]:
        evs = self.close()
        self.kind, self.text = kind, ""
        self.output.append(item)
        evs.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        if kind == "message":
            evs.append(self.event("response.content_part.added", **self._where(), content_index=0, part=text_part("")))
        return evs

    def close(self, status: str = "completed") -> list[tuple[str, dict]]:
        """The open item's done events (its text whole); `status`: `incomplete` for the item a token limit cut."""
        if self.kind is None:
            return []
        item, where, evs = self.output[-1], self._where(), []
        if self.kind == "message":
            item["content"] = [text_part(self.text)]
            evs.append(self.event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]))
            evs.append(self.event("response.content_part.done", **where, content_index=0, part=text_part(self.text)))
        elif self.kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": self.text}]
            evs.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
        else:
            item["arguments"] = self.text
            evs.append(self.event("response.function_call_arguments.done", **where, arguments=self.text))
        item["status"] = status
        evs.append(self.event("response.output_item.done", output_index=where["output_index"], item=dict(item)))
        self.kind = None
        return evs

    def push(self, delta: dict) -> list[tuple[str, dict]]:
        evs: list[tuple[str, dict]] = []
        if delta.get("reasoning_content"):
            if self.kind != "reasoning":
                evs += self._open("reasoning", reasoning_item(new_id("rs"), "", "in_progress"))
            self.text += delta["reasoning_content"]
            evs.append(
                self.event(
                    "response.reasoning_text.delta", **self._where(), content_index=0, delta=delta["reasoning_content"]
                )
            )
        if delta.get("content"):
            if self.kind != "message":
                evs += self._open("message", message_item(new_id("msg"), None, "in_progress"))
            self.text += delta["content"]
            evs.append(
                self.event(
                    "response.output_text.delta", **self._where(), content_index=0, delta=delta["content"], logprobs=[]
                )
            )
        for call in delta.get("tool_calls") or []:
            kind, fn = f"tool:{call.get('index', 0)}", call.get("function") or {}
            if self.kind != kind:
                evs += self._open(
                    kind, call_item(new_id("fc"), call.get("id", ""), fn.get("name", ""), "", "in_progress")
                )
            if fn.get("arguments"):
                self.text += fn["arguments"]
                evs.append(self.event("response.function_call_arguments.delta", **self._where(), delta=fn["arguments"]))
        return evs
