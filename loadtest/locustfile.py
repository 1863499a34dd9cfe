"""Locust users for the gRPC Encode API.

Each user calls `Encode` back to back (closed loop), half the time with an image URL from the media
server, half the time with an image's bytes; every request's bytes are unique (a token after the JPEG
end marker), so it measures encoding, not the cache. Every call fires Locust's `request` event, so
Locust's own statistics (RPS, percentiles, failures, CSV files) work unchanged.

Configuration by environment (set by `mimo-epd loadtest encoder`):
    MIMO_EPD_MEDIA_URLS   comma-separated image URLs (each gets ?u=<token>)
    MIMO_EPD_IMAGES_DIR   directory of JPEG files sent as bytes
The server address is Locust's --host (host:port, no scheme).
"""
from __future__ import annotations

import os
import random
import time
import uuid
from pathlib import Path

from locust import User, constant, events, task  # noqa: F401 - locust first: it monkey-patches for gevent

import grpc  # noqa: E402
from grpc.experimental import gevent as grpc_gevent  # noqa: E402

grpc_gevent.init_gevent()

from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc  # noqa: E402

URLS = [u for u in os.environ.get("MIMO_EPD_MEDIA_URLS", "").split(",") if u]
IMAGES = [p.read_bytes() for p in sorted(Path(os.environ.get("MIMO_EPD_IMAGES_DIR", "/nonexistent")).glob("*.jpg"))]


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
            exc = e
        self.environment.events.request.fire(request_type="grpc", name=name,
                                             response_time=(time.perf_counter() - start) * 1e3,
                                             response_length=length, exception=exc, context={})

    @task
    def encode_url(self) -> None:
        if URLS:
            self._call("Encode url", encoder_pb2.MediaItem(url=f"{random.choice(URLS)}?u={uuid.uuid4().hex}"))

    @task
    def encode_bytes(self) -> None:
        if IMAGES:
            data = random.choice(IMAGES) + b"mimo-epd:" + uuid.uuid4().hex.encode()
            self._call("Encode bytes", encoder_pb2.MediaItem(data=data))
