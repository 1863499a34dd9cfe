"""Audio in chat through the `openai` client: `input_audio` parts (base64 WAV / MP3) and `audio_url` parts
reach the encoder, their embeddings are spliced after BOS like image tokens (prompt_tokens grows by the
item's tokens; the same audio again is a prefix-cache hit), and bad parts are 400s naming the field."""

from __future__ import annotations

import base64

import openai
import pytest

from mimo_epd.testing.audio_gen import make_test_audio
from mimo_epd.testing.media_server import MediaServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"http://{worker.http_address}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    out = {}
    for name, seconds, seed in [("a.wav", 3.0, 0), ("b.mp3", 2.0, 1)]:
        make_test_audio(str(d / name), seconds, seed=seed)
        out[name] = (d / name).read_bytes()
    return out


def _ask(client, part: dict, **kw):
    return client.chat.completions.create(
        model="tiny-random",
        max_tokens=1,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Transcribe:"}, part]}],
        **kw,
    )


def _input_audio(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_input_audio_is_spliced_like_image_tokens(client, clips):
    text_only = client.chat.completions.create(
        model="tiny-random",
        max_tokens=1,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Transcribe:"}]}],
    )
    first = _ask(client, _input_audio(clips["a.wav"], "wav"))
    # 3 s = 300 mel frames -> 150 after the stride-2 conv -> 75 tokens after pooling
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 75
    again = _ask(client, _input_audio(clips["a.wav"], "wav"))
    assert again.usage.prompt_tokens_details.cached_tokens >= 75  # the same audio: the same placeholder prefix
    mp3 = _ask(client, _input_audio(clips["b.mp3"], "mp3"))
    assert mp3.usage.prompt_tokens > text_only.usage.prompt_tokens + 40
    assert mp3.usage.prompt_tokens_details.cached_tokens <= 1  # other audio never shares it
    assert first.choices[0].message.content is not None


def test_audio_url(client, clips):
    with MediaServer({"a.wav": clips["a.wav"]}) as media:
        r = _ask(client, {"type": "audio_url", "audio_url": {"url": media.url("a.wav")}})
    direct = _ask(client, _input_audio(clips["a.wav"], "wav"))
    assert r.usage.prompt_tokens == direct.usage.prompt_tokens


@pytest.mark.parametrize(
    "part, param, fragment",
    [
        ({"type": "input_audio", "input_audio": {"data": "!!!", "format": "wav"}}, "input_audio.data", "base64"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "midi"}}, "input_audio.format", "midi"),
        ({"type": "input_audio", "input_audio": "AAAA"}, "input_audio", "object"),
        (_input_audio(b"not audio at all" * 10, "wav"), "media", "audio"),
    ],
)
def test_bad_audio_parts_are_400s(client, part, param, fragment):
    with pytest.raises(openai.BadRequestError) as ei:
        _ask(client, part)
    err = ei.value.body if isinstance(ei.value.body, dict) else {}
    assert param in (err.get("param") or ""), ei.value.body
    assert fragment in err.get("message", ""), ei.value.body
