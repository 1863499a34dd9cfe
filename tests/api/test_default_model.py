"""The README's chat example against a real `mimo-epd llm` on the default model (the shipped trained `tiny`), with
the official `openai` client: the answer is the offline engine's greedy output, streams identically, and is a
well-formed turn in words (not a tool call or markup: the answer docs/model.md shows)."""

from __future__ import annotations

import openai
import pytest

from llm_backend import LLM, SamplingParams
from llm_backend.server.chat_template import load_chat_template
from tests.conftest import start_server

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def default_worker():
    s = start_server(["--http-port", "0", "--kv-cache-tokens", "4096", "--swa-cache-tokens", "1024"], subcommand="llm")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def answer(default_worker):
    client = openai.OpenAI(base_url=f"http://{default_worker.http_address}/v1", api_key="unused", timeout=120)
    return client, client.chat.completions.create(model="tiny", max_tokens=48, messages=MESSAGES)


def test_the_readme_chat_example_is_the_engines_greedy_turn(answer):
    client, r = answer
    text = r.choices[0].message.content
    offline = LLM("tiny").generate([load_chat_template("tiny").render(MESSAGES)], SamplingParams(max_tokens=48))[0]
    assert text == offline.text and r.choices[0].finish_reason == "stop"  # the turn ended with <|im_end|>
    streamed = client.chat.completions.create(model="tiny", max_tokens=48, messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_the_readme_chat_example_answers_in_words(answer):
    message = answer[1].choices[0].message
    text = message.content
    assert not message.tool_calls and "<" not in text, text
    assert len([w for w in text.split() if w.isalpha()]) >= 3, text
