"""The failure rules of prefill / decode disaggregation, with real processes (docs/pd.md): a prefill worker killed or
hung mid-transfer, a decode worker killed mid-transfer, a client that cancels during the transfer. After each, both
workers' request-held pool slots are back to their idle value (0) and the decode worker still serves."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mimo_epd.testing.servers import scrape
from mimo_epd.v1 import generator_pb2, generator_pb2_grpc, pd_pb2, pd_pb2_grpc
from tests.conftest import start_server

pytestmark = pytest.mark.integration

COMMON = ["--model", "tiny-random", "--torch-threads", "1", "--kv-cache-tokens", "8000", "--swa-cache-tokens", "1500"]
# A long prompt in small chunks: the prefill (and its transfer) takes long enough to interrupt.
SLOW_PREFILL = ["--chunk-size", "16", "--max-prefill-tokens", "16"]
LONG = int(os.environ.get("PD_FAULT_PROMPT_TOKENS", "6000"))


def port(s) -> int:
    return int(s.http_address.rsplit(":", 1)[1])


def wait_for(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def idle(s) -> bool:
    m = scrape(port(s))
    return (
        m["llm_kv_full_request_slots"] == 0
        and m["llm_kv_swa_request_slots"] == 0
        and m["llm_requests_running"] == 0
        and m.get("llm_pd_transferring", 0) == 0
        and m.get("llm_pd_fenced_rooms", 0) == 0
    )


def pair(timeout_s: float = 2.0, retries: int = 0, extra: tuple = ()):
    pre = start_server(COMMON + SLOW_PREFILL + ["--role", "prefill", *extra], "llm")
    dec = start_server(
        COMMON
        + ["--role", "decode", "--pd-prefill", pre.address, "--pd-local-prefill-tokens", "0"]
        + ["--pd-transfer-timeout-s", str(timeout_s), "--pd-retries", str(retries), *extra],
        "llm",
    )
    return pre, dec


def start_long(dec, pool):
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(dec.address))
    ids = [1] + [(13 * i) % 200 + 3 for i in range(LONG)]
    call = stub.Generate(
        generator_pb2.GenerateRequest(prompt_token_ids=ids, sampling=generator_pb2.SamplingOptions(max_tokens=4)),
        timeout=300,
    )
    return call, pool.submit(lambda: list(call))


def mid_transfer(pre, dec) -> None:
    """Waits until the prefill worker has written some of the prompt's KV and the decode worker still waits."""
    wait_for(lambda: scrape(port(pre)).get("llm_pd_bytes_written", 0) > 0, "the first KV write")
    assert scrape(port(dec))["llm_pd_transferring"] == 1, "the transfer ended before it could be interrupted"


def serving(s) -> bool:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(s.address))
    return (
        stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_prefill_worker_lost_mid_transfer_frees_the_decode_side(how):
    """With --pd-retries 0 the request fails UNAVAILABLE (the rule before retries), in seconds, and every slot
    comes back."""
    pre, dec = pair(timeout_s=2.0, retries=0)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _, fut = start_long(dec, pool)
            mid_transfer(pre, dec)
            t0 = time.monotonic()
            pre.proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            with pytest.raises(grpc.RpcError) as ei:
                fut.result(timeout=60)
            took = time.monotonic() - t0
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "KV transfer failed" in ei.value.details()
        assert took < 2.0 + 3.0  # the timeout (hang) or at once (kill): seconds, not minutes
        if how == "hang":
            # The hung worker may still write the room: its slots stay fenced (held, never reused) meanwhile.
            time.sleep(1.0)
            m = scrape(port(dec))
            assert m["llm_pd_fenced_rooms"] == 1 and m["llm_kv_full_request_slots"] > 0, m
            pre.proc.send_signal(signal.SIGCONT)  # it answers the Release, closes the room and drops its side
            wait_for(lambda: idle(pre), "the prefill side's slots freed", 30)
            assert scrape(port(pre))["llm_pd_rooms_released"] >= 1
        wait_for(lambda: idle(dec), "the decode side's pages freed", 10)
        m = scrape(port(dec))
        assert m["llm_pd_transfer_failures" if how == "kill" else "llm_pd_transfer_timeouts"] == 1
        assert m["llm_pd_fenced_rooms"] == 0 and m["llm_pd_fence_expired"] == 0
        assert serving(dec)  # the decode worker's health does not depend on its prefill peer
    finally:
        for s in (dec, pre):
            s.stop()


def test_decode_worker_killed_mid_transfer_frees_the_prefill_side():
    pre, dec = pair()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _, fut = start_long(dec, pool)
            mid_transfer(pre, dec)
            dec.proc.send_signal(signal.SIGKILL)
            with pytest.raises(grpc.RpcError):
                fut.result(timeout=60)
        wait_for(lambda: idle(pre), "the prefill side's slots freed", 15)
        assert serving(pre)
    finally:
        for s in (dec, pre):
            s.stop()


def test_client_cancel_during_transfer_frees_both_sides():
    pre, dec = pair()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call, fut = start_long(dec, pool)
            mid_transfer(pre, dec)
            call.cancel()
            with pytest.raises(grpc.RpcError):
                fut.result(timeout=60)
        wait_for(lambda: idle(dec), "the decode side freed", 10)
        wait_for(lambda: idle(pre), "the prefill side freed", 15)
        m = scrape(port(dec))
        assert m["llm_pd_transfer_aborts"] == 1 and m["llm_pd_fenced_rooms"] == 0 and m["llm_pd_fence_expired"] == 0
        # the decode side freed the pages only after the prefill worker closed the room (KVTransfer/Release)
        assert scrape(port(pre))["llm_pd_rooms_released"] == 1
        # a room released before its Prefill call arrives is refused when it comes (it may not write freed slots)
        stub = pd_pb2_grpc.KVTransferStub(grpc.insecure_channel(pre.address))
        assert not stub.Release(pd_pb2.ReleaseRequest(room="late-1"), timeout=10).known
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Prefill(pd_pb2.PrefillRequest(room="late-1", session="x:1", prompt_token_ids=[1, 2]), timeout=10))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "released" in ei.value.details()
    finally:
        for s in (dec, pre):
            s.stop()


def test_a_pair_with_an_internal_key_transfers():
    """Both roles guarded by --internal-api-key: the decode worker's control channel carries the key (without it
    every remote prefill failed UNAUTHENTICATED), and a caller without the key is refused."""
    key = ["--internal-api-key", "pd-secret"]
    pre = start_server(COMMON + key + ["--role", "prefill"], "llm")
    dec = start_server(
        COMMON + key + ["--role", "decode", "--pd-prefill", pre.address, "--pd-local-prefill-tokens", "0"], "llm"
    )
    try:
        stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(dec.address))
        req = generator_pb2.GenerateRequest(
            prompt_token_ids=[1] + list(range(3, 203)), sampling=generator_pb2.SamplingOptions(max_tokens=4)
        )
        msgs = list(stub.Generate(req, timeout=120, metadata=(("authorization", "Bearer pd-secret"),)))
        assert sum(len(m.delta.token_ids) for m in msgs if m.HasField("delta")) == 4
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(req, timeout=30))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        transfers = pd_pb2_grpc.KVTransferStub(grpc.insecure_channel(pre.address))
        with pytest.raises(grpc.RpcError) as ei:
            transfers.Release(pd_pb2.ReleaseRequest(room="x"), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for s in (dec, pre):
            s.stop()


N_IN_FLIGHT, IN_FLIGHT_TOKENS = 12, int(os.environ.get("PD_RETRY_PROMPT_TOKENS", "3000"))


def _prompts() -> list[list[int]]:
    return [[1] + [(7 * i + 31 * j) % 250 + 3 for i in range(IN_FLIGHT_TOKENS)] for j in range(N_IN_FLIGHT)]


def _greedy(address: str, ids: list[int]) -> list[int]:
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    req = generator_pb2.GenerateRequest(
        prompt_token_ids=ids, sampling=generator_pb2.SamplingOptions(max_tokens=6, ignore_eos=True)
    )
    return [t for msg in stub.Generate(req, timeout=300) if msg.HasField("delta") for t in msg.delta.token_ids]


def test_prefill_worker_killed_under_twelve_long_prompts_costs_no_request():
    """#47: SIGKILL of the prefill worker while 12 long prompts wait for their KV (some transferring, some queued):
    each is prefilled on the decode worker instead (--pd-retries 1, the default), every one completes, and its
    greedy tokens are a colocated worker's; the failed rooms' slots all come back."""
    big = ("--kv-cache-tokens", str(N_IN_FLIGHT * (IN_FLIGHT_TOKENS + 64)))
    pre, dec = pair(timeout_s=2.0, retries=1, extra=big)
    ref = start_server(COMMON + list(big), "llm")
    try:
        prompts = _prompts()
        with concurrent.futures.ThreadPoolExecutor(N_IN_FLIGHT) as pool:
            futs = [pool.submit(_greedy, dec.address, ids) for ids in prompts]
            wait_for(lambda: scrape(port(pre)).get("llm_pd_bytes_written", 0) > 0, "the first KV write")
            assert scrape(port(dec))["llm_pd_transferring"] >= 1
            pre.proc.send_signal(signal.SIGKILL)
            got = [f.result(timeout=600) for f in futs]
        want = [_greedy(ref.address, ids) for ids in prompts]
        assert got == want and all(len(g) == 6 for g in got)
        m = scrape(port(dec))
        assert m["llm_pd_retried_locally"] >= 1 and m["llm_pd_retried_locally"] + m["llm_pd_remote_prefills"] >= 1
        wait_for(lambda: idle(dec), "the decode side's pages freed", 30)
        assert serving(dec)
    finally:
        for s in (dec, pre, ref):
            s.stop()
