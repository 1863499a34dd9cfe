"""Locust users for the gRPC Encode API.

Each user calls `Encode` back to back (closed loop) with one image: its bytes, or (when URLs are given)
half the time its URL on the load test's media server. Every request's bytes are unique (a token after
the JPEG end marker), so it measures encoding, not the cache. Every call fires Locust's `request` event,
so Locust's own statistics (RPS, percentiles, failures, CSV files) work unchanged; a failure is recorded
as `STATUS_CODE: details`, which `mimo-epd loadtest` groups by status.

Configuration by environment (set by `mimo-epd loadtest encoder`):
    MIMO_EPD_MEDIA_URLS   comma-separated image URLs (each gets ?u=<token>); empty = bytes only
    MIMO_EPD_IMAGES_DIR   directory of JPEG files sent as bytes
    MIMO_EPD_AUDIO_DIR    directory of audio clips (.wav) sent as AUDIO items (unique bytes: a token appended)
    MIMO_EPD_AUDIO_FRACTION  share of requests that carry an audio clip instead of an image (default 0)
The server address is Locust's --host (host:port, no scheme).
"""

from __future__ import annotations

import os
import random
import re
import time
import uuid
from pathlib import Path

import grpc  # noqa: E402
from grpc.experimental import gevent as grpc_gevent  # noqa: E402
from locust import User, constant, task  # locust first: it monkey-patches for gevent

grpc_gevent.init_gevent()

from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc  # noqa: E402

URLS = [u for u in os.environ.get("MIMO_EPD_MEDIA_URLS", "").split(",") if u]
IMAGES = [p.read_bytes() for p in sorted(Path(os.environ.get("MIMO_EPD_IMAGES_DIR", "/nonexistent")).glob("*.jpg"))]
AUDIO = [p.read_bytes() for p in sorted(Path(os.environ.get("MIMO_EPD_AUDIO_DIR", "/nonexistent")).glob("*.wav"))]
AUDIO_FRACTION = float(os.environ.get("MIMO_EPD_AUDIO_FRACTION", "0") or 0)
_TOKEN = re.compile(r"u=[0-9a-f]{32}")


class GrpcFailure(Exception):
    """A failed call as Locust records it: `CODE: details` (the per-request token masked, so that equal
    failures are counted in one row of locust_failures.csv)."""

    def __init__(self, error: grpc.RpcError):
        super().__init__(f"{error.code().name}: {_TOKEN.sub('u=...', error.details() or '')}")

    def __repr__(self) -> str:
        return self.args[0]


class EncoderUser(User):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host, options=[("grpc.max_receive_message_length", 256 << 20)])
        self.stub = encoder_pb2_grpc.EncoderStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    def _call(self, name: str, item: encoder_pb2.MediaItem) -> None:
        start = time.perf_counter()
        length, exc = 0, None
        try:
            resp = self.stub.Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=120)
            length = resp.ByteSize()
        except grpc.RpcError as e:
            exc = GrpcFailure(e)
        self.environment.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=(time.perf_counter() - start) * 1e3,
            response_length=length,
            exception=exc,
            context={},
        )

    @task
    def encode(self) -> None:
        if AUDIO and random.random() < AUDIO_FRACTION:
            # Bytes after a WAV's declared data chunk are ignored by decoders: unique bytes, the same audio.
            data = random.choice(AUDIO) + b"mimo-epd:" + uuid.uuid4().hex.encode()
            self._call("Encode audio", encoder_pb2.MediaItem(data=data, modality=encoder_pb2.AUDIO))
        elif URLS and (not IMAGES or random.random() < 0.5):
            self._call("Encode url", encoder_pb2.MediaItem(url=f"{random.choice(URLS)}?u={uuid.uuid4().hex}"))
        elif IMAGES:
            data = random.choice(IMAGES) + b"mimo-epd:" + uuid.uuid4().hex.encode()
            self._call("Encode bytes", encoder_pb2.MediaItem(data=data))
