"""HTTP through the routing policy: `mimo-epd serve --llm-workers 2` with the openai client. A multi-turn chat
session sticks to the worker holding its context under affinity (each turn's cached tokens cover the whole
previous turn), and under round_robin it does not (consecutive turns alternate workers); the router's /metrics
(merged into the node's --metrics-port) count requests per worker and the prediction error. Streams keep their
shape (no usage unless asked). A worker whose HTTP API cannot be reached is retried on the next one."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from llm_backend.tokenizer import load_tokenizer
from mimo_epd.testing.servers import scrape
from tests.conftest import start_server
from tests.router.conftest import free_port

pytestmark = pytest.mark.integration

SERVE_ARGS = [
    "--http-port",
    "0",
    "--llm-workers",
    "2",
    "--llm-kv-cache-tokens",
    "6000",
    "--llm-swa-cache-tokens",
    "1500",
    "--encoders",
    "1",
]
SYSTEM = "You are a careful assistant who answers questions about foxes and dogs. " * 2


@pytest.fixture(scope="module", params=["affinity", "round_robin"])
def node(request):
    port = free_port()
    s = start_server([*SERVE_ARGS, "--llm-policy", request.param, "--metrics-port", str(port)], "serve", timeout=300)
    s.policy, s.metrics_port = request.param, port
    yield s
    assert s.stop() == 0


def client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{node.http_address}/v1", api_key="unused", timeout=120, max_retries=0)


def run_session(c: openai.OpenAI, s: int, turns: int) -> list[tuple[int, int]]:
    """One session's turns in order; (prompt tokens, cached tokens) per turn."""
    msgs = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"session {s}, question {t}: what do they eat in winter?"})
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, extra_body={"ignore_eos": True})
        out.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        # the worker's KV-event position, which the router waits for before the next turn (router/sync.py)
        epoch, _, seq = (r.usage.model_extra or {}).get("kv_events_position", "").rpartition(":")
        assert epoch and int(seq) > 0, r.usage
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


def router_metrics(node) -> dict[str, float]:
    return {
        k.replace(',process="router"', "").replace('process="router",', "").replace('{process="router"}', ""): v
        for k, v in scrape(node.metrics_port).items()
        if k.startswith("router_")
    }


def test_multi_turn_sessions_and_policy(node):
    c = client(node)
    before = router_metrics(node)
    sessions = [run_session(c, s, 4) for s in range(2)]  # one session after the other: round_robin alternates
    for turns in sessions:
        # turn t's prompt starts with turn t-1's prompt and reply: its worker holds at least the previous prompt
        kept = [cached >= prev_prompt for (prev_prompt, _), (_, cached) in zip(turns, turns[1:])]
        if node.policy == "affinity":
            assert all(kept), turns
            assert [cached for _, cached in turns[1:]] == sorted(cached for _, cached in turns[1:]), turns
        else:
            assert not any(kept), turns  # the other worker served the previous turn
    m = router_metrics(node)
    per_worker = {k: v - before.get(k, 0) for k, v in m.items() if k.startswith("router_requests_total{")}
    assert sum(per_worker.values()) == 8 and len(per_worker) >= (2 if node.policy == "round_robin" else 1), per_worker
    if node.policy == "round_robin":
        assert sorted(per_worker.values()) == [4, 4], per_worker
    assert all('front="http"' in k for k in per_worker)
    n = m["router_prediction_error_tokens_count"] - before.get("router_prediction_error_tokens_count", 0)
    assert n == 8  # every response's cached tokens were reported against the prediction
    if node.policy == "affinity":
        # the index predicts whole 16-token blocks: the worker reuses at most one block more than predicted
        exact_or_block = (
            m['router_prediction_error_tokens_bucket{le="16.0"}']
            - m['router_prediction_error_tokens_bucket{le="-1.0"}']
            - before.get('router_prediction_error_tokens_bucket{le="16.0"}', 0)
            + before.get('router_prediction_error_tokens_bucket{le="-1.0"}', 0)
        )
        assert exact_or_block == 8, m
    assert m["router_state_degraded"] == 0 and m["router_live_workers"] == 2
    assert max(v for k, v in m.items() if k.startswith("router_index_blocks{")) > 0


def test_streams_keep_their_shape_and_report_cached_tokens(node):
    c = client(node)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "stream this, please"}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, extra_body={"ignore_eos": True})
    plain = list(
        c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=8, stream=True, extra_body={"ignore_eos": True}
        )
    )
    # no usage asked for: none in the stream (the front asked the worker for it and took it out again)
    assert all(ch.usage is None for ch in plain) and all(ch.choices for ch in plain)
    assert "".join(ch.choices[0].delta.content or "" for ch in plain) == whole.choices[0].message.content
    with_usage = list(
        c.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert with_usage[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    if node.policy == "affinity":  # the third identical prompt is a hit on the worker that served the first
        assert with_usage[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    text = c.completions.create(model="tiny", prompt="a completion routed like the chats", max_tokens=4)
    assert text.usage.prompt_tokens == len(
        load_tokenizer("tiny").encode("a completion routed like the chats")
    )  # BOS + text


async def test_generate_is_routed_and_bad_bodies_get_the_workers_400(node):
    async with aiohttp.ClientSession() as s:
        url = f"http://{node.http_address}/generate"
        body = {"text": "the native API, routed " * 4, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        metas = []
        for _ in range(2):
            async with s.post(url, json=body) as r:
                assert r.status == 200
                metas.append((await r.json())["meta_info"])
        if node.policy == "affinity":
            assert metas[1]["cached_tokens"] == metas[1]["prompt_tokens"] - 1
        async with s.post(f"http://{node.http_address}/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]
        async with s.post(
            f"http://{node.http_address}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        ) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages[0].role"


# ---------------------------------------------------------------------------------------------- retries
@pytest.fixture(scope="module")
def two_workers():
    args = ["--http-port", "0", "--kv-cache-tokens", "4096", "--swa-cache-tokens", "1024", "--torch-threads", "1"]
    procs = [start_server(args, "llm") for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()


async def test_unreachable_worker_is_retried_on_the_next(two_workers):
    from llm_backend.server.chat_template import load_chat_template
    from mimo_epd.router.http_front import HTTPFront
    from mimo_epd.router.llm import LLMRouter, LLMRouterConfig

    a, b = two_workers
    dead = f"127.0.0.1:{free_port()}"  # worker a's gRPC serves (its feed is live), its HTTP address has no listener
    router = LLMRouter(
        LLMRouterConfig(policy="round_robin", workers=f"{a.address}/{dead},{b.address}/{b.http_address}")
    )
    await router.start()
    front = HTTPFront(router=router, template=load_chat_template("tiny"))
    port = await front.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(4):
                async with s.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "tiny", "prompt": f"retry me {i}", "max_tokens": 2},
                ) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["usage"]["completion_tokens"] >= 1
        assert router.stats["retries"] >= 1 and router.stats["failed"] == 0, router.stats
        m = router.metrics.render().decode()
        assert f'router_requests_total{{front="http",worker="{b.address}"}} 4.0' in m, m
    finally:
        await front.close()
        await router.close()
        await asyncio.sleep(0)


def test_a_restarted_worker_is_routed_to_again_within_seconds(two_workers):
    """A chaos finding: with gRPC's default reconnect backoff the router's channels to a restarted worker kept
    failing for 7-18 s after it served again. With 100 ms / 1 s backoff (router/channels.py) and the health
    re-check, requests reach it again within a few seconds of its ready line."""
    import signal
    import time

    import grpc

    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    a, b = two_workers
    mport = free_port()
    r = start_server(
        [
            "--workers",
            f"{a.address},{b.address}",
            "--llm-policy",
            "round_robin",
            "--member-ttl-s",
            "2",
            "--metrics-port",
            str(mport),
        ],
        "router",
    )

    def served_by_a() -> float:
        return scrape(mport).get(f'router_requests_total{{front="grpc",worker="{a.address}"}}', 0.0)

    def generate() -> None:
        with grpc.insecure_channel(r.address) as ch:
            for _ in generator_pb2_grpc.GeneratorStub(ch).Generate(
                generator_pb2.GenerateRequest(
                    prompt="are you back?", sampling=generator_pb2.SamplingOptions(max_tokens=1)
                ),
                timeout=30,
            ):
                pass

    try:
        for _ in range(2):
            generate()
        assert served_by_a() == 1
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        for _ in range(2):  # they go to b meanwhile
            generate()
        time.sleep(10.0)  # down long enough for gRPC's default backoff to grow to ~10 s between attempts
        port = a.address.rsplit(":", 1)[1]
        restarted = start_server(
            [
                "--port",
                port,
                "--http-port",
                "-1",
                "--kv-cache-tokens",
                "4096",
                "--swa-cache-tokens",
                "1024",
                "--torch-threads",
                "1",
            ],
            "llm",
        )
        two_workers[0] = restarted  # stopped by the fixture
        ready = time.monotonic()
        before = served_by_a()
        while served_by_a() == before:
            assert time.monotonic() - ready < 5.0, "the router did not route to the restarted worker within 5 s"
            generate()
            time.sleep(0.1)
    finally:
        r.stop()
