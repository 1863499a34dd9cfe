"""The router's HTTP front of `mimo-epd serve`: the openai client through it (streamed and whole, an image
through the node's own encoders), the worker's endpoints forwarded, and a client that disconnects
mid-stream through the front aborting its request on the worker."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp
import openai
import pytest

from tests.api.conftest import scrape
from tests.conftest import encode_image, start_server, textured

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def node():
    s = start_server(
        ["--http-port", "0", "--llm-kv-cache-tokens", "6000", "--llm-swa-cache-tokens", "1500"],
        subcommand="serve",
        timeout=300,
    )
    assert s.http_address, "serve printed no `http HOST:PORT` line before `ready`"
    yield s
    assert s.stop() == 0


def test_openai_client_through_the_front(node):
    client = openai.OpenAI(base_url=f"http://{node.http_address}/v1", api_key="unused", timeout=120, max_retries=0)
    image = "data:image/jpeg;base64," + base64.b64encode(encode_image(textured(200, 300, seed=9), "JPEG")).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe:"}],
        }
    ]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens > 77
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 77  # the image is a prefix hit the second time
    assert [m.id for m in client.models.list().data] == ["tiny"]


async def test_disconnect_through_the_front_aborts_on_the_worker(node):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{node.http_address}/health") as r:
            assert r.status == 200
        r = await s.post(
            f"http://{node.http_address}/v1/chat/completions",
            json={
                "model": "tiny",
                "stream": True,
                "max_tokens": 3000,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "keep going"}],
            },
        )
        for _ in range(6):
            await r.content.readline()
        running = 'llm_requests_running{process="llm-0"}'  # /metrics is the whole node's, each process labelled
        assert scrape(node.http_address)[running] == 1
        r.close()
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(scrape, node.http_address))[running] != 0:
        assert time.monotonic() < deadline, "the worker kept generating for a client that left"
        await asyncio.sleep(0.1)
    assert scrape(node.http_address)['llm_requests_finished_total{process="llm-0",reason="abort"}'] >= 1


async def test_info_endpoints_show_names_not_paths(node):
    """/model_info, /server_info and /v1/models answer anonymous clients (no --api-key here) with the model's,
    tokenizer's and template's names, never this machine's paths (the shipped tiny lives inside the package)."""
    import os

    import mimo_epd

    package = os.path.dirname(os.path.dirname(os.path.abspath(mimo_epd.__file__)))
    async with aiohttp.ClientSession() as s:
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info", "/v1/models"):
            async with s.get(f"http://{node.http_address}{path}") as r:
                assert r.status == 200, path
                text = await r.text()
            assert package not in text and "site-packages" not in text, (path, text[:300])
            if "info" in path:
                info = json.loads(text)
                assert info["model_path"] == "tiny" and info["tokenizer_path"] == "tiny/tokenizer.json", info


async def test_tokenize_through_the_front(node):
    """/tokenize and /detokenize reach a worker through serve's front; the shipped tokenizer adds BOS only with
    add_special_tokens, and a chat's count is the chat completion's prompt_tokens."""
    url = f"http://{node.http_address}"
    messages = [{"role": "user", "content": "Hello!"}]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/tokenize", json={"prompt": "Hello world"}) as r:
            with_bos = await r.json()
        async with s.post(f"{url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}) as r:
            bare = await r.json()
        async with s.post(f"{url}/detokenize", json={"tokens": bare["tokens"]}) as r:
            back = await r.json()
        async with s.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}) as r:
            chat = await r.json()
        async with s.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}) as r:
            done = await r.json()
    assert with_bos["tokens"] == [0, *bare["tokens"]] and back == {"prompt": "Hello world"}
    assert chat["count"] == done["usage"]["prompt_tokens"]


def test_anthropic_client_through_the_front(node):
    """/v1/messages through the router's front, routed with the same affinity as chat (its chat translation is the
    prompt): a second turn of the same conversation finds its prefix cached; streamed and whole agree;
    count_tokens is forwarded; errors keep Anthropic's shape."""
    import anthropic

    claude = anthropic.Anthropic(base_url=f"http://{node.http_address}", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "How do I sort a list in Python? " * 8}]
    first = claude.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=msgs)
    turn2 = msgs + [
        {"role": "assistant", "content": first.content[0].text if first.content else "ok"},
        {"role": "user", "content": "And in reverse?"},
    ]
    second = claude.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=turn2)
    assert second.usage.cache_read_input_tokens > 0  # the conversation's prefix, on the worker that holds it
    with claude.messages.stream(model="tiny", max_tokens=8, system="Be brief.", messages=turn2) as s:
        streamed = s.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in second.content]
    counted = claude.messages.count_tokens(model="tiny", system="Be brief.", messages=turn2)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["param"] == "messages[0].role"


def test_responses_api_through_the_front(node):
    """/v1/responses through the router's front, routed with chat's affinity (its chat translation is the prompt):
    a second turn finds its prefix cached; the client's streaming helper gets the same text; errors name the field."""
    import openai

    oai = openai.OpenAI(base_url=f"http://{node.http_address}/v1", api_key="unused", max_retries=0, timeout=120)
    turn1 = [{"role": "user", "content": "How do I sort a list in Python? " * 8}]
    first = oai.responses.create(
        model="tiny", instructions="Be brief.", input=turn1, max_output_tokens=8, temperature=0
    )
    turn2 = turn1 + [
        {"role": "assistant", "content": first.output_text or "ok"},
        {"role": "user", "content": "And in reverse?"},
    ]
    second = oai.responses.create(
        model="tiny", instructions="Be brief.", input=turn2, max_output_tokens=8, temperature=0
    )
    assert second.usage.input_tokens_details.cached_tokens > 0
    events = oai.responses.create(
        model="tiny", instructions="Be brief.", input=turn2, max_output_tokens=8, temperature=0, stream=True
    )
    (streamed,) = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    assert streamed.output_text == second.output_text and streamed.status == second.status
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="tiny", input=[{"role": "robot", "content": "x"}])
    assert "input[0].role" in str(e.value)
