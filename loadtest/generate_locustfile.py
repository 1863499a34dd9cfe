"""Locust users for generation: streamed requests over the HTTP APIs (chat completions, completions, the Responses
API, the Anthropic Messages API: `--apis`) and Generate over gRPC.

Each user runs a closed loop of multi-turn sessions: it keeps one of a few shared system prompts (so
prefix caching matters across users) and a conversation that grows by its own question and the answer
for a few turns, then starts over. With the `images` workload every question carries an image from a
small pool, inline (a `data:` URL over HTTP, the bytes over gRPC). A fraction of the requests (the
`grpc` share) go over gRPC Generate with the same conversation rendered as plain text.

Every request fires Locust's `request` event (type `http` / `grpc`, response_length = completion tokens)
and its time to first token a second one (type `ttft`), so Locust's CSVs hold both. The raw records go
to a JSON file at the end for the runner's summary (`mimo-epd loadtest generate`).

Configuration by environment (set by the runner):
    MIMO_EPD_GEN_HTTP        http://host:port of the HTTP API (empty = no HTTP requests)
    MIMO_EPD_GEN_GRPC        host:port of Generator/Generate (empty = no gRPC requests)
    MIMO_EPD_GEN_GRPC_SHARE  fraction of requests over gRPC (default 0.25)
    MIMO_EPD_GEN_WORKLOAD    chat | images
    MIMO_EPD_GEN_HTTP_APIS   comma-separated: chat, completions, responses, messages (taken in turn at random)
    MIMO_EPD_GEN_MAX_TOKENS  completion tokens per request
    MIMO_EPD_GEN_IMAGES_DIR  JPEG files for the images workload
    MIMO_EPD_GEN_RESULTS     where to write the raw records (JSON)
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import random
import time
from pathlib import Path

import grpc  # noqa: E402
import requests  # noqa: E402
from grpc.experimental import gevent as grpc_gevent  # noqa: E402
from locust import User, constant, events, task  # noqa: F401 - locust first: it monkey-patches for gevent

grpc_gevent.init_gevent()

from mimo_epd.v1 import encoder_pb2, generator_pb2, generator_pb2_grpc  # noqa: E402

HTTP = os.environ.get("MIMO_EPD_GEN_HTTP", "").rstrip("/")
GRPC = os.environ.get("MIMO_EPD_GEN_GRPC", "")
GRPC_SHARE = float(os.environ.get("MIMO_EPD_GEN_GRPC_SHARE", "0.25")) if GRPC else 0.0
WORKLOAD = os.environ.get("MIMO_EPD_GEN_WORKLOAD", "chat")
MAX_TOKENS = int(os.environ.get("MIMO_EPD_GEN_MAX_TOKENS", "16"))
IMAGES = [p.read_bytes() for p in sorted(Path(os.environ.get("MIMO_EPD_GEN_IMAGES_DIR", "/nonexistent")).glob("*.jpg"))]
RESULTS = os.environ.get("MIMO_EPD_GEN_RESULTS", "")
HTTP_APIS = os.environ.get("MIMO_EPD_GEN_HTTP_APIS", "chat").split(",")
TURNS = 3

SYSTEM_PROMPTS = [
    "You are a support assistant for a cloud storage product. Answer briefly, cite the relevant setting, and "
    "never invent features. Customers ask about quotas, sharing links, retention and billing cycles.",
    "You are a travel planner. Suggest concise itineraries with transit times, budget notes and one local food "
    "to try. Prefer trains over flights under 600 km and mention accessibility where relevant.",
    "You are a code reviewer for a Python service. Point out bugs first, then style. Keep every comment short "
    "and actionable, quote the line you mean, and say when something is fine as it is.",
    "You are a museum guide describing pictures to visitors. Describe composition, colour and light, then one "
    "historical detail. Keep a warm tone and never exceed three sentences per answer.",
]
QUESTIONS = [
    "What should I check first?",
    "Can you explain that in more detail?",
    "And what about the cost?",
    "Is there a faster way?",
    "What would you recommend instead?",
    "Summarise that in one line.",
]
_records: list[dict] = []
_users = itertools.count()


def _data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


class GenerateUser(User):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.index = next(_users)
        self.rng = random.Random(self.index)
        self.http = requests.Session()
        self.channel = grpc.insecure_channel(GRPC) if GRPC else None
        self.stub = generator_pb2_grpc.GeneratorStub(self.channel) if self.channel else None
        self._new_session()

    def on_stop(self) -> None:
        self.http.close()
        if self.channel:
            self.channel.close()

    def _new_session(self) -> None:
        self.system = SYSTEM_PROMPTS[self.index % len(SYSTEM_PROMPTS)]
        self.turns: list[tuple[str, str]] = []  # (question, answer)

    def _record(self, api: str, name: str, start: float, ttft: float | None, tokens: int, error: str | None) -> None:
        e2e = (time.perf_counter() - start) * 1e3
        _records.append(
            {
                "api": api,
                "start": start,
                "end": time.perf_counter(),
                "e2e_ms": e2e,
                "ttft_ms": ttft,
                "tokens": tokens,
                "error": error,
            }
        )
        ev = self.environment.events.request
        ev.fire(
            request_type=api,
            name=name,
            response_time=e2e,
            response_length=tokens,
            exception=Exception(error) if error else None,
            context={},
        )
        if ttft is not None and not error:
            ev.fire(request_type="ttft", name=name, response_time=ttft, response_length=0, exception=None, context={})

    @task
    def turn(self) -> None:
        if len(self.turns) >= TURNS:
            self._new_session()
        question = self.rng.choice(QUESTIONS)
        image = self.rng.choice(IMAGES) if WORKLOAD == "images" and IMAGES else None
        use_grpc = self.stub is not None and (not HTTP or self.rng.random() < GRPC_SHARE)
        answer = self._grpc(question, image) if use_grpc else self._chat(question, image)
        self.turns.append((question, answer or ""))

    # ------------------------------------------------------------------------------------ HTTP
    def _messages(self, question: str, image: bytes | None) -> list[dict]:
        """The conversation in the chat API's shape (the system prompt, the turns, the question)."""
        messages = [{"role": "system", "content": self.system}]
        for q, a in self.turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        content = (
            question
            if image is None
            else [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": question}]
        )
        messages.append({"role": "user", "content": content})
        return messages

    def _chat(self, question: str, image: bytes | None) -> str | None:
        """One streamed request on one of the HTTP APIs (`--apis`), the same conversation in its shape."""
        api = self.rng.choice(HTTP_APIS)
        path, body = _request(api, self._messages(question, image), self.system, question, image)
        name = f"{api} stream" + (" +image" if image is not None else "")
        start = time.perf_counter()
        ttft, tokens, text, error = None, 0, [], None
        try:
            with self.http.post(f"{HTTP}{path}", json=body, stream=True, timeout=300) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {r.text[:200]}"
                else:
                    for line in r.iter_lines():
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        piece, used, err = _event(api, json.loads(line[6:]))
                        if err:
                            error = err
                            break
                        if piece:
                            if ttft is None:
                                ttft = (time.perf_counter() - start) * 1e3
                            text.append(piece)
                        tokens = used if used is not None else tokens
        except requests.RequestException as e:
            error = f"HTTP {type(e).__name__}: {e}"[:200]
        self._record("http" if api == "chat" else f"http-{api}", name, start, ttft, tokens, error)
        return None if error else "".join(text)

    # ------------------------------------------------------------------------------------ gRPC
    def _grpc(self, question: str, image: bytes | None) -> str | None:
        prompt = f"<|system|>\n{self.system}\n" + "".join(f"<|user|>\n{q}\n<|assistant|>\n{a}\n" for q, a in self.turns)
        prompt += f"<|user|>\n{question}\n<|assistant|>\n"
        media = [encoder_pb2.MediaItem(data=image, modality=encoder_pb2.IMAGE)] if image is not None else []
        req = generator_pb2.GenerateRequest(
            prompt=prompt, media=media, sampling=generator_pb2.SamplingOptions(max_tokens=MAX_TOKENS)
        )
        name = "Generate" + (" +image" if image is not None else "")
        start = time.perf_counter()
        ttft, tokens, text, error = None, 0, [], None
        try:
            for msg in self.stub.Generate(req, timeout=300):
                if msg.HasField("delta"):
                    if ttft is None:
                        ttft = (time.perf_counter() - start) * 1e3
                    text.append(msg.delta.text)
                else:
                    tokens = msg.final.completion_tokens
        except grpc.RpcError as e:
            error = f"grpc {e.code().name}: {(e.details() or '')[:200]}"
        self._record("grpc", name, start, ttft, tokens, error)
        return None if error else "".join(text)


def _request(api: str, messages: list[dict], system: str, question: str, image: bytes | None) -> tuple[str, dict]:
    """(path, body) of one streamed request on `api`; every API asks for exactly MAX_TOKENS tokens where it can."""
    if api == "chat":
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
        return "/v1/chat/completions", {**body, "model": "", "stream_options": {"include_usage": True}}
    if api == "completions":
        prompt = "".join(
            f"{m['role']}: {m['content'] if isinstance(m['content'], str) else question}\n" for m in messages
        )
        body = {"model": "", "prompt": prompt + "assistant:", "max_tokens": MAX_TOKENS, "stream": True}
        return "/v1/completions", {**body, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if api == "responses":
        items = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
        if image is not None:  # the Responses API's image part
            items[-1] = {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": _data_url(image)},
                    {"type": "input_text", "text": question},
                ],
            }
        body = {"model": "", "instructions": system, "input": items, "max_output_tokens": MAX_TOKENS, "stream": True}
        return "/v1/responses", {**body, "store": False}
    turns = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
    if image is not None:  # Anthropic's image block
        data = base64.b64encode(image).decode()
        img = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": data}}
        turns[-1] = {"role": "user", "content": [img, {"type": "text", "text": question}]}
    return "/v1/messages", {"model": "", "system": system, "messages": turns, "max_tokens": MAX_TOKENS, "stream": True}


def _event(api: str, msg: dict) -> tuple[str | None, int | None, str | None]:
    """(text piece, completion tokens so far, error) of one SSE event of `api`."""
    if "error" in msg and api in ("chat", "completions"):
        return None, None, f"HTTP stream {msg['error'].get('type')}: {msg['error'].get('message', '')[:200]}"
    if msg.get("type") == "error":
        err = msg.get("error") or msg
        return None, None, f"HTTP stream error: {str(err.get('message', ''))[:200]}"
    if api in ("chat", "completions"):
        piece = "".join(
            ((c.get("delta") or {}).get("content") or "") if api == "chat" else (c.get("text") or "")
            for c in msg.get("choices") or []
        )
        return piece or None, (msg.get("usage") or {}).get("completion_tokens"), None
    if api == "responses":
        kind = msg.get("type", "")
        if kind == "response.output_text.delta":
            return msg["delta"], None, None
        if kind in ("response.completed", "response.incomplete"):
            return None, msg["response"]["usage"]["output_tokens"], None
        return None, None, None
    if msg.get("type") == "content_block_delta" and msg["delta"].get("type") == "text_delta":
        return msg["delta"]["text"], None, None
    if msg.get("type") == "message_delta":
        return None, msg["usage"]["output_tokens"], None
    return None, None, None


@events.test_stop.add_listener
def _write_results(environment, **_kw) -> None:
    if RESULTS:
        Path(RESULTS).write_text(json.dumps(_records))
