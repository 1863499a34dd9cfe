"""The router over prefill and decode workers (real processes): it picks a prefill worker for each decode worker's
request, prefills on the decode worker when there is no prefill worker, and a stopped prefill worker does not fail
a request that streamed nothing (the transfer times out on the decode worker, the router retries another)."""

from __future__ import annotations

import signal

import grpc
import pytest

from mimo_epd.v1 import generator_pb2, generator_pb2_grpc
from tests.conftest import start_server

pytestmark = pytest.mark.integration

COMMON = ["--model", "tiny-random", "--torch-threads", "1", "--http-port", "-1"]
COMMON += ["--kv-cache-tokens", "6000", "--swa-cache-tokens", "1500"]


def router(*args):
    return start_server(["--model", "tiny-random", "--member-ttl-s", "2", *args], "router")


def ask(address, ids, n=6):
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    req = generator_pb2.GenerateRequest(
        prompt_token_ids=ids, sampling=generator_pb2.SamplingOptions(max_tokens=n, ignore_eos=True)
    )
    tokens, final = [], None
    for msg in stub.Generate(req, timeout=120):
        if msg.HasField("delta"):
            tokens += list(msg.delta.token_ids)
        else:
            final = msg.final
    return tokens, final


def test_router_picks_prefill_workers_and_survives_a_stopped_one():
    pa = start_server(COMMON + ["--role", "prefill"], "llm")
    pb = start_server(COMMON + ["--role", "prefill"], "llm")
    dec = start_server(
        COMMON + ["--role", "decode", "--pd-local-prefill-tokens", "0", "--pd-transfer-timeout-s", "1"], "llm"
    )
    both = start_server(COMMON, "llm")
    r = router("--workers", ",".join(s.address for s in (pa, pb, dec)))
    stopped = None
    try:
        ids = [1] + [(5 * i) % 200 + 3 for i in range(200)]
        want, _ = ask(both.address, ids)
        got, final = ask(r.address, ids)
        assert got == want and final.prefill_address in (pa.address, pb.address)
        stopped = pa if final.prefill_address == pa.address else pb
        other = pb if stopped is pa else pa
        stopped.proc.send_signal(signal.SIGSTOP)
        # The turn that meets the stopped prefill worker is prefilled by the decode worker itself (--pd-retries 1),
        # which reports the failed worker: the router marks it down and the next turn goes to the other one.
        got2, final2 = ask(r.address, ids + got + [9, 10, 11] * 20)
        want2, _ = ask(both.address, ids + got + [9, 10, 11] * 20)
        assert got2 == want2
        if final2.prefill_address != other.address:  # the router had picked the stopped worker
            assert final2.prefill_address == "" and final2.prefill_failed_address == stopped.address, final2
            got3, final3 = ask(r.address, ids + got + [12, 13] * 20)
            want3, _ = ask(both.address, ids + got + [12, 13] * 20)
            assert got3 == want3 and final3.prefill_address == other.address, final3
    finally:
        if stopped is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        for s in (r, both, dec, pb, pa):
            s.stop()


def test_without_prefill_workers_the_decode_worker_prefills_itself():
    dec = start_server(COMMON + ["--role", "decode", "--pd-local-prefill-tokens", "0"], "llm")
    r = router("--workers", dec.address)
    try:
        tokens, final = ask(r.address, [1] + list(range(3, 120)))
        assert len(tokens) == 6 and final.prefill_address == "" and final.kv_transfer_bytes == 0
    finally:
        r.stop()
        dec.stop()


def test_with_no_decode_worker_live_a_prefill_worker_generates_the_request_itself():
    """A P/D node's only decode worker is down (restarting, killed): the router sends the request to a prefill worker,
    which prefills and decodes it colocated, with the colocated path's tokens (a chaos finding: every request
    failed with "tried none" for the decode worker's restart, six seconds)."""
    import time

    from mimo_epd.testing.redis_server import free_port
    from mimo_epd.testing.servers import scrape

    pre = start_server(COMMON + ["--role", "prefill"], "llm")
    dec = start_server(COMMON + ["--role", "decode", "--pd-local-prefill-tokens", "0"], "llm")
    both = start_server(COMMON, "llm")
    port = free_port()
    r = router("--workers", f"{pre.address},{dec.address}", "--metrics-port", str(port))
    try:
        ids = [1] + [(7 * i) % 200 + 3 for i in range(60)]
        want, _ = ask(both.address, ids)
        got, final = ask(r.address, ids)
        assert got == want and final.prefill_address == pre.address  # disaggregated while the decode worker lives
        dec.proc.kill()
        dec.proc.wait()
        deadline = time.monotonic() + 30
        while True:  # until the router has dropped the dead decode worker (its health / membership)
            got2, final2 = ask(r.address, ids + [5])
            if final2 is not None:
                break
            assert time.monotonic() < deadline
        want2, _ = ask(both.address, ids + [5])
        assert got2 == want2 and final2.prefill_address == ""  # generated on the prefill worker itself
        assert scrape(port).get("router_prefill_fallbacks_total", 0) >= 1
    finally:
        for s in (r, both, dec, pre):
            s.stop()
