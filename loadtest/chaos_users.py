"""Locust users for `mimo-epd chaos` (loadtest/chaos.py): closed-loop Encode and Generate through the router.

Besides Locust's own `request` event, every call appends one JSON line to $MIMO_EPD_CHAOS_LOG with its
start and end on CLOCK_MONOTONIC (one clock for every process of the machine, so the campaign can tell
which requests were in flight at the instant it killed a process), its kind, its status code and, for
Encode, the item's routing key (the campaign maps it to the encoder that owned it on the hash ring).

Configuration by environment (set by the campaign):
    MIMO_EPD_CHAOS_LOG     the JSON-lines file to append to
    MIMO_EPD_IMAGES_DIR    directory of JPEG files sent as bytes (each made unique by a trailing token)
    MIMO_EPD_CALL_TIMEOUT  per-call deadline in seconds (default 60)
The server address is Locust's --host (host:port, no scheme).
"""
from __future__ import annotations

import json
import os
import random
import time
import uuid
from pathlib import Path

from locust import User, constant, task  # locust first: it monkey-patches for gevent

import grpc  # noqa: E402
import xxhash  # noqa: E402
from grpc.experimental import gevent as grpc_gevent  # noqa: E402

grpc_gevent.init_gevent()

from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc, generator_pb2, generator_pb2_grpc  # noqa: E402

IMAGES = [p.read_bytes() for p in sorted(Path(os.environ.get("MIMO_EPD_IMAGES_DIR", "/nonexistent")).glob("*.jpg"))]
TIMEOUT = float(os.environ.get("MIMO_EPD_CALL_TIMEOUT", "60"))
_LOG = open(os.environ.get("MIMO_EPD_CHAOS_LOG", os.devnull), "a", buffering=1)  # one line per write
# A killed router comes back on the same port within seconds: reconnect quickly instead of gRPC's
# default backoff (up to two minutes), which would be measured as downtime the server did not have.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]


class _ChaosUser(User):
    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host, options=CHANNEL_OPTIONS)

    def on_stop(self) -> None:
        self.channel.close()

    def _record(self, kind: str, t0: float, key: str, call) -> None:
        code, details, exc = "OK", "", None
        try:
            call()
        except grpc.RpcError as e:
            exc, code, details = e, e.code().name, (e.details() or "")[:200]
        t1 = time.monotonic()
        _LOG.write(json.dumps({"kind": kind, "t0": t0, "t1": t1, "code": code, "key": key, "details": details}) + "\n")
        self.environment.events.request.fire(request_type="grpc", name=kind, response_time=(t1 - t0) * 1e3,
                                             response_length=0, exception=exc, context={})
        if exc is not None:
            time.sleep(0.05)  # a refused call returns at once: do not spin while the node is down


class EncodeUser(_ChaosUser):
    """Encode one unique JPEG (its bytes end with a random token: never a cache hit)."""
    weight = 3

    def on_start(self) -> None:
        super().on_start()
        self.stub = encoder_pb2_grpc.EncoderStub(self.channel)

    @task
    def encode(self) -> None:
        data = random.choice(IMAGES) + b"mimo-epd:" + uuid.uuid4().hex.encode()
        key = "h:" + xxhash.xxh3_128_hexdigest(data)  # the router's routing key for inline bytes
        req = encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(data=data)])
        self._record("encode", time.monotonic(), key, lambda: self.stub.Encode(req, timeout=TIMEOUT))


class GenerateUser(_ChaosUser):
    """A short greedy generation (text only) streamed from the LLM worker through the router."""
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        self.stub = generator_pb2_grpc.GeneratorStub(self.channel)

    @task
    def generate(self) -> None:
        req = generator_pb2.GenerateRequest(prompt=f"chaos {uuid.uuid4().hex[:8]}: tell me a story",
                                            sampling=generator_pb2.SamplingOptions(max_tokens=8))
        self._record("generate", time.monotonic(), "", lambda: list(self.stub.Generate(req, timeout=TIMEOUT)))
