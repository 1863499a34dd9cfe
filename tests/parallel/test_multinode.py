"""One replica over two "machines": `mimo-epd llm --nnodes 2 --node-rank 0` (the worker, rank 0) and
`--node-rank 1` (rank 1 only, no API) meeting at `--dist-init-addr`, here both on loopback. The answer equals a
one-rank worker's; stopping the worker stops the other node's ranks cleanly. The same with two DP ranks, each
one's replica over the two "machines"."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from llm_backend.parallel.replica import free_init_method
from mimo_epd.testing.servers import start_server


@pytest.mark.integration
def test_two_nodes_serve_one_tp2_replica_and_stop_together(one_worker):
    addr = free_init_method().removeprefix("tcp://")
    common = ["--model", "tiny", "--torch-threads", "1", "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "mimo_epd", "llm", *common, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ask, want = one_worker
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


@pytest.mark.integration
def test_dp2_replicas_of_tp2_each_over_two_nodes(one_worker):
    """Data-parallel attention with each DP rank's replica over two "machines": two DP workers at --tp 2
    --nnodes 2 (node 0: the worker, its rank 0) and, per DP rank, a `--node-rank 1` process with its rank 1; all
    four ranks meet at one --dist-init-addr. Each DP worker answers as one worker does; stopping them ends every
    process (none hangs)."""
    from concurrent.futures import ThreadPoolExecutor

    ask, want = one_worker
    addr = free_init_method().removeprefix("tcp://")
    common = ["--model", "tiny", "--torch-threads", "1", "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    common += ["--dp", "2", "--enable-expert-parallel", "--dist-timeout-s", "10"]
    far = [
        subprocess.Popen(
            [sys.executable, "-m", "mimo_epd", "llm", *common, "--data-parallel-rank", str(d), "--node-rank", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d in range(2)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            near = list(
                pool.map(
                    lambda d: start_server(
                        [*common, "--data-parallel-rank", str(d), "--node-rank", "0", "--http-port", "0"], "llm"
                    ),
                    range(2),
                )
            )
        try:
            for w in near:
                got = openai.OpenAI(base_url=f"http://{w.http_address}/v1", api_key="x").completions.create(**ask)
                assert got.choices[0].text == want.choices[0].text
        finally:
            for w in near:
                w.proc.terminate()
            for w in near:
                w.proc.wait(timeout=30)
        for p in far:
            p.wait(timeout=30)  # rank 0 stopped them, or its exit did: never a hang
    finally:
        for p in far:
            if p.poll() is None:
                p.kill()
