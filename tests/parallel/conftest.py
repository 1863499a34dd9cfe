"""Shared by the model-parallel tests: the one-rank worker whose answers the split ones must give."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_worker():
    """A completion request and a one-rank `mimo-epd llm` worker's answer to it (the reference)."""
    import openai

    from mimo_epd.testing.servers import start_server

    ask = dict(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0)
    one = start_server(["--model", "tiny", "--http-port", "0", "--torch-threads", "1"], "llm")
    try:
        want = openai.OpenAI(base_url=f"http://{one.http_address}/v1", api_key="x").completions.create(**ask)
    finally:
        assert one.stop() == 0
    return ask, want
