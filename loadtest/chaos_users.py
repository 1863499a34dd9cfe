"""Locust users for `mimo-epd chaos` (loadtest/chaos.py): closed-loop Encode and Generate through the router.

Besides Locust's own `request` event, every call appends one JSON line to $MIMO_EPD_CHAOS_LOG with its
start and end on CLOCK_MONOTONIC (one clock for every process of the machine, so the campaign can tell
which requests were in flight at the instant it killed a process), its kind, its status code and, for
Encode, the item's routing key (the campaign maps it to the encoder that owned it on the hash ring).

Configuration by environment (set by the campaign):
    MIMO_EPD_CHAOS_LOG     the JSON-lines file to append to
    MIMO_EPD_IMAGES_DIR    directory of JPEG files sent as bytes (each made unique by a trailing token)
    MIMO_EPD_CALL_TIMEOUT  per-call deadline in seconds (default 60)
    MIMO_EPD_CHAOS_ROUTERS comma list of router addresses (host:port); default: Locust's --host

Failover between routers (client side, as a client of a fleet would do it): each user has a home router (users
spread over them); a call that fails with UNAVAILABLE before any response (a dead router refuses the
connection; a request it held dies with its socket) is sent again to the next router, and the one that failed
is passed over for a second. A stream that already delivered tokens is not retried: it failed in flight. The
log line says which router a request went to first (`router`) and how many it tried (`attempts`).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from pathlib import Path

import grpc  # noqa: E402
import xxhash  # noqa: E402
from grpc.experimental import gevent as grpc_gevent  # noqa: E402
from locust import User, constant, task  # locust first: it monkey-patches for gevent

grpc_gevent.init_gevent()

from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc, generator_pb2, generator_pb2_grpc  # noqa: E402

IMAGES = [p.read_bytes() for p in sorted(Path(os.environ.get("MIMO_EPD_IMAGES_DIR", "/nonexistent")).glob("*.jpg"))]
VIDEOS = [p.read_bytes() for p in sorted(Path(os.environ.get("MIMO_EPD_IMAGES_DIR", "/nonexistent")).glob("*.mp4"))]
TIMEOUT = float(os.environ.get("MIMO_EPD_CALL_TIMEOUT", "60"))
_LOG = open(os.environ.get("MIMO_EPD_CHAOS_LOG", os.devnull), "a", buffering=1)  # one line per write
# A killed router comes back on the same port within seconds: reconnect quickly instead of gRPC's
# default backoff (up to two minutes), which would be measured as downtime the server did not have.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


ROUTERS = [a for a in os.environ.get("MIMO_EPD_CHAOS_ROUTERS", "").split(",") if a]
PASS_OVER_S = 1.0  # a router that refused a call is tried last for this long
_down_until: dict[int, float] = {}  # router index -> monotonic time (shared by the users of this process)
_users = 0


class _ChaosUser(User):
    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        global _users
        self.addresses = ROUTERS or [self.host]
        self.channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.addresses]
        self.home = _users % len(self.addresses)
        _users += 1

    def on_stop(self) -> None:
        for ch in self.channels:
            ch.close()

    def _order(self) -> list[int]:
        n = len(self.addresses)
        order = [(self.home + k) % n for k in range(n)]
        now = time.monotonic()
        return sorted(order, key=lambda i: _down_until.get(i, 0.0) > now)  # stable: passed-over ones last

    def _record(self, kind: str, t0: float, key: str, call) -> None:
        """`call(i)` runs the request on router i; returns normally or raises grpc.RpcError."""
        code, details, exc = "OK", "", None
        order = self._order()
        attempts = 0
        for i in order:
            attempts += 1
            try:
                call(i)
                code, details, exc = "OK", "", None
                break
            except grpc.RpcError as e:
                exc, code, details = e, e.code().name, (e.details() or "")[:200]
                started = getattr(e, "started", False)
                if e.code() != grpc.StatusCode.UNAVAILABLE or started:
                    break
                _down_until[i] = time.monotonic() + PASS_OVER_S  # and on to the next router
        t1 = time.monotonic()
        _LOG.write(
            json.dumps(
                {
                    "kind": kind,
                    "t0": t0,
                    "t1": t1,
                    "code": code,
                    "key": key,
                    "details": details,
                    "router": self.addresses[order[0]],
                    "attempts": attempts,
                }
            )
            + "\n"
        )
        self.environment.events.request.fire(
            request_type="grpc", name=kind, response_time=(t1 - t0) * 1e3, response_length=0, exception=exc, context={}
        )
        if exc is not None:
            time.sleep(0.05)  # a refused call returns at once: do not spin while the node is down


class _EncoderClient(_ChaosUser):
    """A user of the Encode API: one stub per router; `_encode` sends one item, logged under its routing key."""

    abstract = True

    def on_start(self) -> None:
        super().on_start()
        self.stubs = [encoder_pb2_grpc.EncoderStub(ch) for ch in self.channels]

    def _encode(self, item: encoder_pb2.MediaItem) -> None:
        key = "h:" + xxhash.xxh3_128_hexdigest(item.data)  # the router's routing key for inline bytes
        req = encoder_pb2.EncodeRequest(items=[item])
        # unary: an UNAVAILABLE means no response arrived, so another router may take it
        self._record("encode", time.monotonic(), key, lambda i: self.stubs[i].Encode(req, timeout=TIMEOUT))


class EncodeUser(_EncoderClient):
    """Encode one unique JPEG (its bytes end with a random token: never a cache hit)."""

    weight = 3

    @task
    def encode(self) -> None:
        self._encode(encoder_pb2.MediaItem(data=random.choice(IMAGES) + b"mimo-epd:" + uuid.uuid4().hex.encode()))


def _wav(seconds: float) -> bytes:
    """A unique mono 16-bit WAV clip of noise at 16 kHz."""
    import io
    import wave

    import numpy as np

    pcm = (np.random.default_rng().standard_normal(int(16000 * seconds)) * 3000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm.tobytes())
    return buf.getvalue()


class AudioUser(_EncoderClient):
    """Encode one unique audio clip (0.5-3 s of noise, WAV: never a cache hit), as audio items in flight."""

    weight = 1

    @task
    def encode_audio(self) -> None:
        self._encode(encoder_pb2.MediaItem(data=_wav(random.uniform(0.5, 3.0)), modality=encoder_pb2.AUDIO))


class VideoUser(_EncoderClient):
    """Encode one of the campaign's short videos (MIMO_EPD_IMAGES_DIR/*.mp4) at a random sampling rate (a new content
    key each time: never a cache hit), so videos are decoding and encoding when a process dies."""

    weight = 1

    @task
    def encode_video(self) -> None:
        video = encoder_pb2.VideoOptions(fps=random.uniform(1.0, 3.0))
        self._encode(encoder_pb2.MediaItem(data=random.choice(VIDEOS), modality=encoder_pb2.VIDEO, video=video))


class GenerateUser(_ChaosUser):
    """A short greedy generation (text only) streamed from the LLM worker through the router; one in three is
    grammar-constrained (a regex), so constrained decoding is in flight when a worker dies."""

    weight = 1

    def on_start(self) -> None:
        super().on_start()
        self.stubs = [generator_pb2_grpc.GeneratorStub(ch) for ch in self.channels]

    @task
    def generate(self) -> None:
        req = generator_pb2.GenerateRequest(
            prompt=f"chaos {uuid.uuid4().hex[:8]}: tell me a story",
            sampling=generator_pb2.SamplingOptions(max_tokens=8),
        )
        if random.random() < 1 / 3:
            req.constraint.regex = "[a-z ]{1,24}"
        deadline = time.monotonic() + TIMEOUT

        def call(i: int) -> None:
            got = 0
            try:
                for _ in self.stubs[i].Generate(req, timeout=max(0.1, deadline - time.monotonic())):
                    got += 1
            except grpc.RpcError as e:
                e.started = got > 0  # tokens were streamed: a retry elsewhere would repeat them
                raise

        self._record("generate", time.monotonic(), "", call)
