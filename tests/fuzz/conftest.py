"""Fuzzing through a real encoder server: shared server fixture, call helper and Hypothesis settings.

Every fuzz module gets its own `mimo-epd encoder` subprocess (module-scoped `fuzz_server`), started with
`--allowed-local-dir` on a temporary directory and no `--url-allowlist` (the default URL policy). Each
generated input is sent over gRPC with a per-call deadline; a reply is acceptable when it is a success or
one of the statuses the API documents for bad input. INTERNAL / UNKNOWN, a missed deadline (a hang) or a
server that exits or stops answering health checks fails the test.

Bounded by default (a few dozen examples per test, derandomized, so the suite is quick and repeatable);
`MIMO_EPD_FUZZ_EXAMPLES=5000` runs that many random examples per test (see docs/reliability.md).
"""

from __future__ import annotations

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings

from mimo_epd.v1 import encoder_pb2 as pb
from mimo_epd.v1 import encoder_pb2_grpc
from tests.conftest import start_server

LONG_RUN = int(os.environ.get("MIMO_EPD_FUZZ_EXAMPLES", "0") or 0)


def fuzz_settings(examples: int) -> settings:
    """`examples` in the bounded run (derandomized: the same inputs every time, no flakes); with
    MIMO_EPD_FUZZ_EXAMPLES=N, N random examples."""
    return settings(
        max_examples=LONG_RUN or examples,
        deadline=None,
        derandomize=not LONG_RUN,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
        print_blob=True,
    )


# Statuses the API documents for bad input (README "Errors"). INTERNAL and UNKNOWN are never acceptable.
BAD_INPUT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND}


class Outcome:
    def __init__(self, code: grpc.StatusCode, details: str, resp: pb.EncodeResponse | None):
        self.code, self.details, self.resp = code, details, resp

    def __repr__(self) -> str:
        return f"{self.code.name}: {self.details[:300]}"


class FuzzServer:
    def __init__(self, proc, address: str):
        self.proc, self.address = proc, address
        opts = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
        self.channel = grpc.insecure_channel(address, options=opts)
        self.stub = encoder_pb2_grpc.EncoderStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def encode(self, item: pb.MediaItem, deadline_s: float = 30.0) -> Outcome:
        """One Encode call. A missed client deadline means the server hung on this input: it fails here,
        with the input's description in the assertion."""
        try:
            r = self.stub.Encode(pb.EncodeRequest(items=[item]), timeout=deadline_s)
            out = Outcome(grpc.StatusCode.OK, "", r)
        except grpc.RpcError as e:
            out = Outcome(e.code(), e.details() or "", None)
        assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}) on this input: {out}"
        assert not (out.code == grpc.StatusCode.DEADLINE_EXCEEDED and out.details == "Deadline Exceeded"), (
            f"hang: no answer within {deadline_s}s"
        )
        assert out.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), f"server error: {out}"
        if out.code == grpc.StatusCode.OK:
            it = out.resp.items[0]
            assert it.num_tokens > 0 and len(it.embedding.data) == it.num_tokens * 256 * 4, it
        return out

    def assert_serving(self) -> None:
        assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}"
        r = self.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-media")


@pytest.fixture(scope="module")
def fuzz_server(media_dir):
    # Small limits keep each example cheap on a shared CPU; huge header dimensions still hit the
    # decompression-bomb check (--max-image-pixels), exactly as they would at the default.
    s = start_server(
        [
            "--allowed-local-dir",
            str(media_dir),
            "--decode-workers",
            "1",
            "--max-image-pixels",
            "4000000",
            "--max-item-bytes",
            "8000000",
            "--fetch-timeout-s",
            "2",
            "--cache-bytes",
            "0",
            "--video-decode-workers",
            "1",
            "--video-decode-mode",
            "thread",
            "--grace-period-s",
            "2",
        ]
    )
    fs = FuzzServer(s.proc, s.address)
    fs.log = s.stderr_lines
    yield fs
    fs.channel.close()
    rc = s.stop()
    assert rc == 0, "".join(s.stderr_lines)[-3000:]


@pytest.fixture(autouse=True)
def _still_serving(request):
    """After every test: the server is up and SERVING (and it still encodes a good image)."""
    yield
    if "fuzz_server" in request.fixturenames:
        fs = request.getfixturevalue("fuzz_server")
        fs.assert_serving()
