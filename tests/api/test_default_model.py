"""The README's chat example against a real `mimo-epd llm` on the default model (the shipped trained `tiny`), with
the official `openai` client: it answers in readable text, the same text as the offline engine's greedy output,
and streams it identically."""

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


def test_the_readme_chat_example_answers_in_readable_text(default_worker):
    client = openai.OpenAI(base_url=f"http://{default_worker.http_address}/v1", api_key="unused", timeout=120)
    r = client.chat.completions.create(model="tiny", max_tokens=32, messages=MESSAGES)
    text = r.choices[0].message.content
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) >= 3 and all(ch.isprintable() or ch in "\n\t" for ch in text), text
    offline = LLM("tiny")
    prompt = load_chat_template("tiny").render(MESSAGES)
    assert text == offline.generate([prompt], SamplingParams(max_tokens=32))[0].text
    streamed = client.chat.completions.create(model="tiny", max_tokens=32, messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
