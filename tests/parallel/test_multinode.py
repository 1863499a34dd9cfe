"""One replica over two "machines": `mimo-epd llm --nnodes 2 --node-rank 0` (the worker, rank 0) and
`--node-rank 1` (rank 1 only, no API) meeting at `--dist-init-addr`, here both on loopback. The answer equals a
one-rank worker's; stopping the worker stops the other node's ranks cleanly."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from llm_backend.parallel.replica import free_init_method
from mimo_epd.testing.servers import start_server


@pytest.mark.integration
def test_two_nodes_serve_one_tp2_replica_and_stop_together():
    addr = free_init_method().removeprefix("tcp://")
    common = ["--model", "tiny", "--torch-threads", "1", "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "mimo_epd", "llm", *common, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ask = dict(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0)
    try:
        node0 = start_server([*common, "--node-rank", "0", "--http-port", "0"], "llm")
        try:
            got = openai.OpenAI(base_url=f"http://{node0.http_address}/v1", api_key="x").completions.create(**ask)
        finally:
            assert node0.stop() == 0
        assert node1.wait(timeout=30) == 0, node1.stderr.read()[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
    one = start_server(["--model", "tiny", "--http-port", "0", "--torch-threads", "1"], "llm")
    try:
        want = openai.OpenAI(base_url=f"http://{one.http_address}/v1", api_key="x").completions.create(**ask)
    finally:
        assert one.stop() == 0
    assert got.choices[0].text == want.choices[0].text


def test_bad_node_flags_are_refused_by_name():
    from llm_backend.config import LLMConfig

    for kw, says in (
        (dict(tensor_parallel_size=2, nnodes=2), "--dist-init-addr"),
        (dict(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1"), "--nnodes 2"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank 2"),
        (dict(tensor_parallel_size=2, dist_init_addr="nohost"), "HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=says):
            LLMConfig(**kw).validate()
