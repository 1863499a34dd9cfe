"""Locust users for generation: streamed chat completions over the HTTP API and Generate over gRPC.

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
    def _chat(self, question: str, image: bytes | None) -> str | None:
        messages = [{"role": "system", "content": self.system}]
        for q, a in self.turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        content = (
            question
            if image is None
            else [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": question}]
        )
        messages.append({"role": "user", "content": content})
        body = {
            "model": "",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        name = "chat stream" + (" +image" if image is not None else "")
        start = time.perf_counter()
        ttft, tokens, text, error = None, 0, [], None
        try:
            with self.http.post(f"{HTTP}/v1/chat/completions", json=body, stream=True, timeout=300) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {r.text[:200]}"
                else:
                    for line in r.iter_lines():
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        msg = json.loads(line[6:])
                        if "error" in msg:
                            error = f"HTTP stream {msg['error'].get('type')}: {msg['error'].get('message', '')[:200]}"
                            break
                        for c in msg.get("choices") or []:
                            piece = (c.get("delta") or {}).get("content")
                            if piece:
                                if ttft is None:
                                    ttft = (time.perf_counter() - start) * 1e3
                                text.append(piece)
                        if msg.get("usage"):
                            tokens = msg["usage"]["completion_tokens"]
        except requests.RequestException as e:
            error = f"HTTP {type(e).__name__}: {e}"[:200]
        self._record("http", name, start, ttft, tokens, error)
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


@events.test_stop.add_listener
def _write_results(environment, **_kw) -> None:
    if RESULTS:
        Path(RESULTS).write_text(json.dumps(_records))
