"""One /metrics for the whole node: `serve --encoders 2 --metrics-port P` starts (it used to die with
Address already in use), P merges both encoders with a process label, and a port in use is named."""

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mimo_epd.node_metrics import merge
from mimo_epd.testing.servers import start_server
from tests.conftest import ROOT

CHILD = """# HELP encoder_requests_total Encode requests received
# TYPE encoder_requests_total counter
encoder_requests_total {n}
# HELP encoder_queue_depth items waiting
# TYPE encoder_queue_depth gauge
encoder_queue_depth{{queue="fetch"}} 3.0
"""


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_merge_labels_every_sample_with_its_process():
    fams = _families(
        merge({"encoder-0": CHILD.format(n=2.0), "encoder-1": CHILD.format(n=5.0), "encoder-2": None}).decode()
    )
    reqs = {s.labels["process"]: s.value for s in fams["encoder_requests"].samples}
    assert reqs == {"encoder-0": 2.0, "encoder-1": 5.0} and fams["encoder_requests"].type == "counter"
    depth = [(s.labels["process"], s.labels["queue"]) for s in fams["encoder_queue_depth"].samples]
    assert depth == [("encoder-0", "fetch"), ("encoder-1", "fetch")]
    up = {s.labels["process"]: s.value for s in fams["mimo_epd_scrape_up"].samples}
    assert up == {"encoder-0": 1.0, "encoder-1": 1.0, "encoder-2": 0.0}


def _free_port_run(n: int) -> int:
    """A port P with P..P+n-1 all free (the node's endpoint and one per encoder)."""
    from mimo_epd.testing.redis_server import free_ports_from

    return free_ports_from(n)


@pytest.mark.integration
def test_serve_two_encoders_one_metrics_endpoint():
    port = _free_port_run(3)
    server = start_server(
        ["--encoders", "2", "--metrics-port", str(port), "--no-llm", "--http-port", "-1"], subcommand="serve", cwd=ROOT
    )
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        rc = server.stop()
    fams = _families(text)
    assert {s.labels["process"]: s.value for s in fams["mimo_epd_scrape_up"].samples} == {
        "encoder-0": 1.0,
        "encoder-1": 1.0,
    }
    assert {s.labels["process"] for s in fams["encoder_requests"].samples} == {"encoder-0", "encoder-1"}
    assert rc == 0
    for _ in range(50):  # the stderr reader thread may still be catching up with the exited process
        log = "".join(server.stderr_lines)
        if "shutting down: routers first" in log:
            break
        time.sleep(0.1)
    assert "left the ring" not in log[log.index("shutting down: routers first") :]  # stopping its own encoders


@pytest.mark.integration
def test_a_metrics_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "mimo_epd",
                "serve",
                "--port",
                "0",
                "--metrics-port",
                str(port),
                "--no-llm",
                "--http-port",
                "-1",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1
    assert f"127.0.0.1:{port} (--metrics-port): Address already in use" in r.stderr, r.stderr[-2000:]


@pytest.mark.integration
def test_a_grpc_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "mimo_epd", "encoder", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (--host/--port): Address already in use" in r.stderr, r.stderr[-2000:]


@pytest.mark.integration
def test_both_metrics_endpoints_of_a_two_worker_node_list_every_process():
    """`serve --llm-workers 2`: the HTTP API's /metrics and --metrics-port both merge every process of the node, so
    the two workers' finished requests add up to the requests sent, on every scrape."""
    import json

    port = _free_port_run(2)
    server = start_server(
        ["--llm-workers", "2", "--metrics-port", str(port), "--http-port", "0", "--llm-torch-threads", "1"],
        subcommand="serve",
        cwd=ROOT,
    )
    try:
        sent = 6
        for i in range(sent):
            body = {"model": "tiny", "prompt": f"request {i} " * (i + 1), "max_tokens": 2, "ignore_eos": True}
            req = urllib.request.Request(
                f"http://{server.http_address}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=60).read()
        texts = [
            urllib.request.urlopen(url, timeout=10).read().decode()
            for url in (f"http://{server.http_address}/metrics", f"http://127.0.0.1:{port}/metrics") * 2
        ]
    finally:
        assert server.stop() == 0
    for text in texts:
        fams = _families(text)
        up = {s.labels["process"]: s.value for s in fams["mimo_epd_scrape_up"].samples}
        assert up == {"encoder-0": 1.0, "llm-0": 1.0, "llm-1": 1.0, "router": 1.0}, up
        finished = [s for s in fams["llm_requests_finished"].samples if s.name.endswith("_total")]
        assert {s.labels["process"] for s in finished} <= {"llm-0", "llm-1"}
        assert sum(s.value for s in finished) == sent
