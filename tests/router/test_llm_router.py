"""The LLM router over real workers (`mimo-epd llm`, tiny model) and real routers (`mimo-epd router`), with a real
redis-server for the shared state: sessions stick to the worker holding their prefix (seen as the worker's own
`cached_tokens`), across two routers on one Redis and across a router restart; a killed worker loses only its
in-flight requests; a killed Redis degrades routing to load only without failing requests."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from mimo_epd.v1 import generator_pb2, generator_pb2_grpc
from tests.conftest import start_server

pytestmark = pytest.mark.integration

# tiny-random (bytes: the cached-token thresholds below count bytes), in the workers and the routers' tokenizer
WORKER_ARGS = [
    "--model",
    "tiny-random",
    "--http-port",
    "-1",
    "--kv-cache-tokens",
    "8192",
    "--swa-cache-tokens",
    "2048",
    "--torch-threads",
    "1",
]


def generate(
    address: str, prompt: str, max_tokens: int = 2, timeout: float = 60, streaming: threading.Event | None = None
) -> tuple[dict, int]:
    """One request through `address`: (its final's prompt and cached tokens, tokens streamed); `streaming` is set
    at its first token."""
    with grpc.insecure_channel(address) as ch:
        stub = generator_pb2_grpc.GeneratorStub(ch)
        tokens, final = 0, None
        for m in stub.Generate(
            generator_pb2.GenerateRequest(prompt=prompt, sampling=generator_pb2.SamplingOptions(max_tokens=max_tokens)),
            timeout=timeout,
        ):
            if m.HasField("delta"):
                tokens += len(m.delta.token_ids)
                if streaming is not None:
                    streaming.set()
            else:
                final = m.final
    return {"prompt": final.prompt_tokens, "cached": final.cached_tokens}, tokens


def session_prompt(s: int, turns: int) -> str:
    return "".join(
        f"[session {s} turn {t}] " + "the quick brown fox jumps over the lazy dog. " * 3 for t in range(turns)
    )


@pytest.fixture(scope="module")
def workers():
    procs = [start_server(WORKER_ARGS, "llm") for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()


def router(*args) -> object:
    return start_server(["--model", "tiny-random", "--log-level", "info", "--member-ttl-s", "2", *args], "router")


def run_sessions(addresses, sessions, turns: int = 3) -> list[dict]:
    """Each session's turns in order, turn t through addresses[t % len]; returns the finals of turns >= 1."""
    out = []
    for t in range(1, turns + 1):
        for s in sessions:
            final, _ = generate(addresses[(t - 1) % len(addresses)], session_prompt(s, t))
            if t > 1:
                out.append(final)
    return out


def assert_hits(finals, turn_len_min: int = 100):
    for f in finals:  # a later turn on the session's worker reuses at least the previous turns' whole blocks
        assert f["cached"] >= f["prompt"] - 200 and f["cached"] >= turn_len_min, finals


def test_affinity_keeps_sessions_on_their_cache(workers):
    r = router("--workers", ",".join(w.address for w in workers))
    try:
        assert_hits(run_sessions([r.address], range(4)))
    finally:
        r.stop()


def test_round_robin_loses_the_cache(workers):
    r = router("--workers", ",".join(w.address for w in workers), "--llm-policy", "round_robin")
    try:
        finals = run_sessions([r.address], range(100, 103))  # 3 sessions on 2 workers: the turns rotate
        assert any(f["cached"] < 50 for f in finals)  # some later turns landed on the other worker
    finally:
        r.stop()


def test_two_routers_on_one_redis_agree_and_a_restarted_router_is_warm(workers, redis_server):
    args = ["--workers", ",".join(w.address for w in workers), "--router-state", redis_server.url]
    a, b = router(*args), router(*args)
    try:
        assert_hits(run_sessions([a.address, b.address], range(200, 204)))  # turns alternate between routers
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        a = router(*args)  # a new process: its index is whatever Redis holds
        finals = [generate(a.address, session_prompt(s, 4))[0] for s in range(200, 204)]
        assert_hits(finals)
    finally:
        a.stop()
        b.stop()


def test_redis_down_degrades_to_load_only(workers, redis_server):
    r = router("--workers", ",".join(w.address for w in workers), "--router-state", redis_server.url)
    try:
        run_sessions([r.address], range(300, 302), turns=1)
        redis_server.stop()
        for s in range(300, 304):  # every request is still served
            final, n = generate(r.address, session_prompt(s, 2))
            assert n == 2 and final["prompt"] > 0
        assert any("routing by load only" in line for line in r.stderr_lines), "".join(r.stderr_lines)[-2000:]
        redis_server.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any("resumed" in x for x in r.stderr_lines):
            time.sleep(0.2)
        assert any("KV-affinity routing resumed" in x for x in r.stderr_lines)
        time.sleep(1.5)  # the feeds rewrite their snapshots
        assert_hits(run_sessions([r.address], range(310, 312), turns=2))
    finally:
        r.stop()


def test_a_killed_worker_loses_only_its_in_flight_requests():
    ws = [start_server(WORKER_ARGS, "llm") for _ in range(2)]
    r = router("--workers", ",".join(w.address for w in ws), "--llm-policy", "round_robin")
    try:
        results: dict[int, object] = {}
        streaming = [threading.Event() for _ in range(4)]

        def client(i: int) -> None:
            try:
                results[i] = generate(r.address, f"request {i} " * 20, max_tokens=400, streaming=streaming[i])
            except grpc.RpcError as e:
                results[i] = e.code()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for e in streaming:  # all four are streaming, two on each worker (a fixed 3-s sleep let a fast machine
            assert e.wait(60)  # finish all 400 tokens first)
        ws[0].proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(120)
        failed = [i for i, v in results.items() if isinstance(v, grpc.StatusCode)]
        assert len(results) == 4 and 1 <= len(failed) <= 2, results
        assert all(results[i] == grpc.StatusCode.UNAVAILABLE for i in failed)
        for i in range(4):  # new requests avoid the dead worker
            final, n = generate(r.address, f"after {i} " * 10)
            assert n == 2
    finally:
        r.stop()
        for w in ws:
            w.stop()
