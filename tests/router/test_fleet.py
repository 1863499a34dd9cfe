"""The fleet across "machines": two `serve --join` nodes (each its own shm cache, encoder and LLM worker) on one
real redis-server, and one `mimo-epd router` that finds them there. Requests reach both nodes' workers, the
Encode API spans both nodes' encoders, and a stopped node drops out of the registry within its heartbeat."""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc
from tests.conftest import encode_image, start_server, textured
from tests.router.test_llm_router import assert_hits, generate, session_prompt

pytestmark = pytest.mark.integration

NODE = [
    "--llm-model",
    "tiny-random",  # bytes: assert_hits' thresholds count bytes (the router tokenizes likewise, below)
    "--encoders",
    "1",
    "--llm-workers",
    "1",
    "--http-port",
    "-1",
    "--member-ttl-s",
    "2",
    "--llm-kv-cache-tokens",
    "8192",
    "--llm-swa-cache-tokens",
    "2048",
    "--llm-torch-threads",
    "1",
    "--shm-cache-bytes",
    str(64 << 20),
]


def members(r, kind):
    out = []
    for m in r.smembers("mimo:members"):
        f = r.hgetall(b"mimo:member:" + m)
        if f and f.get(b"kind") == kind.encode():
            out.append(m.decode())
    return sorted(out)


def health_status(address: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_two_nodes_one_redis_one_router(redis_server):
    url = redis_server.url
    nodes = [start_server(["--join", url, *NODE], "serve", timeout=240) for _ in range(2)]
    router = None
    try:
        r = redis.Redis.from_url(url)
        assert wait_for(lambda: len(members(r, "llm")) == 2 and len(members(r, "encoder")) == 2), (
            members(r, "llm"),
            members(r, "encoder"),
        )
        for n in nodes:  # a joined node serves only gRPC health on --host:--port: SERVING while its children run
            line = next(x for x in n.stderr_lines if "health on" in x)
            assert health_status(line.rsplit("health on ", 1)[1].strip()) == "SERVING", line
        router = start_server(["--model", "tiny-random", "--router-state", url, "--member-ttl-s", "2"], "router")
        assert wait_for(
            lambda: (
                any("joined" in x for x in router.stderr_lines)
                and sum("LLM worker" in x and "joined" in x for x in router.stderr_lines) == 2
            )
        )
        finals = []
        for t in (1, 2):
            for s in range(6):
                final, _ = generate(router.address, session_prompt(s, t))
                if t == 2:
                    finals.append(final)
        assert_hits(finals)
        workers = members(r, "llm")
        held = {w: r.hlen(f"mimo:kv:{w}") for w in workers}
        assert all(n > 0 for n in held.values()), held  # both nodes served sessions
        with grpc.insecure_channel(router.address) as ch:  # the ring spans both nodes' encoders
            resp = encoder_pb2_grpc.EncoderStub(ch).Encode(
                encoder_pb2.EncodeRequest(
                    items=[encoder_pb2.MediaItem(data=encode_image(textured(64, 64, seed=i))) for i in range(6)]
                ),
                timeout=120,
            )
        assert len(resp.items) == 6 and all(it.num_tokens > 0 for it in resp.items)
        nodes[1].stop()
        assert wait_for(lambda: len(members(r, "llm")) == 1 and len(members(r, "encoder")) == 1, timeout=10)
        time.sleep(1.0)  # the router's next registry read
        for s in range(6):  # every session now lands on the remaining node
            final, n = generate(router.address, session_prompt(s, 3))
            assert n == 2
    finally:
        if router is not None:
            router.stop()
        for n in nodes:
            n.stop()
