"""Audio in chat through the `openai` client: `input_audio` parts (base64 WAV / MP3) and `audio_url` parts
reach the encoder, their embeddings are spliced after BOS like image tokens (prompt_tokens grows by the
item's tokens; the same audio again is a prefix-cache hit), and bad parts are 400s naming the field. With
`use_audio_in_video` (top level or in `mm_processor_kwargs`, over HTTP and gRPC) a video brings its
soundtrack; a video without one is a 400 / INVALID_ARGUMENT naming the video's field."""

from __future__ import annotations

import base64

import openai
import pytest

from mimo_epd.testing.audio_gen import make_test_audio
from mimo_epd.testing.media_server import MediaServer
from mimo_epd.testing.video_gen import make_test_video

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
    for name, rate in [("talk.mp4", 16000), ("silent.mp4", 0)]:  # 3 s, with and without a soundtrack
        make_test_video(str(d / name), 3.0, width=96, height=64, audio_rate=rate, seed=4)
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


def _text_only(client) -> int:
    return client.chat.completions.create(
        model="tiny-random",
        max_tokens=1,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Transcribe:"}]}],
    ).usage.prompt_tokens


def test_input_audio_is_spliced_like_image_tokens(client, clips):
    text_only = _text_only(client)
    first = _ask(client, _input_audio(clips["a.wav"], "wav"))
    # 3 s = 300 mel frames -> 150 after the stride-2 conv -> 75 tokens after pooling
    assert first.usage.prompt_tokens == text_only + 75
    again = _ask(client, _input_audio(clips["a.wav"], "wav"))
    assert again.usage.prompt_tokens_details.cached_tokens >= 75  # the same audio: the same placeholder prefix
    mp3 = _ask(client, _input_audio(clips["b.mp3"], "mp3"))
    assert mp3.usage.prompt_tokens > text_only + 40
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
        # the encoder's refusal names the part too (param and message)
        (_input_audio(b"not audio at all" * 10, "wav"), "messages[0].content[1].input_audio.data", "audio"),
    ],
)
def test_bad_audio_parts_are_400s(client, part, param, fragment):
    with pytest.raises(openai.BadRequestError) as ei:
        _ask(client, part)
    err = ei.value.body if isinstance(ei.value.body, dict) else {}
    assert param in (err.get("param") or ""), ei.value.body
    assert fragment in err.get("message", ""), ei.value.body


def _video(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


def test_use_audio_in_video_adds_the_soundtrack(client, clips):
    plain = _ask(client, _video(clips["talk.mp4"]))
    both = _ask(client, _video(clips["talk.mp4"]), extra_body={"use_audio_in_video": True})
    # The soundtrack's tokens follow the video's: as many as the same file sent as an audio part (its AAC track;
    # 3 s and AAC's padding frames: 75-78 tokens)
    track = _ask(client, _input_audio(clips["talk.mp4"], "m4a")).usage.prompt_tokens - _text_only(client)
    assert 75 <= track <= 78
    assert both.usage.prompt_tokens == plain.usage.prompt_tokens + track
    vllm_way = _ask(client, _video(clips["talk.mp4"]), extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}})
    assert vllm_way.usage.prompt_tokens == both.usage.prompt_tokens
    assert vllm_way.usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens  # the same items again
    off = _ask(client, _video(clips["talk.mp4"]), extra_body={"use_audio_in_video": False})
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_video_and_its_soundtrack_share_one_download(client, clips):
    want = _ask(client, _video(clips["talk.mp4"]), extra_body={"use_audio_in_video": True}).usage.prompt_tokens
    with MediaServer({"talk.mp4": clips["talk.mp4"]}) as media:
        part = {"type": "video_url", "video_url": {"url": media.url("talk.mp4")}}
        r = _ask(client, part, extra_body={"use_audio_in_video": True})
        assert media.requests == 1  # the two items of one request: one fetch
    assert r.usage.prompt_tokens == want


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        ({"use_audio_in_video": True}, "messages[0].content[1].video_url.url", "no audio stream"),
        ({"use_audio_in_video": "yes"}, "use_audio_in_video", "boolean"),
        ({"mm_processor_kwargs": [1]}, "mm_processor_kwargs", "object"),
        (
            {"use_audio_in_video": True, "mm_processor_kwargs": {"use_audio_in_video": False}},
            "mm_processor_kwargs.use_audio_in_video",
            "disagrees",
        ),
    ],
)
def test_use_audio_in_video_refusals_name_the_field(client, clips, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as ei:
        _ask(client, _video(clips["silent.mp4"]), extra_body=extra)
    err = ei.value.body if isinstance(ei.value.body, dict) else {}
    assert err.get("param") == param, ei.value.body
    assert fragment in err.get("message", ""), ei.value.body
    if fragment == "no audio stream":
        assert "its audio track (use_audio_in_video)" in err["message"], err
    assert _ask(client, _video(clips["silent.mp4"])).usage.prompt_tokens > 0  # and the video alone still serves


def test_use_audio_in_video_over_grpc(worker, clips):
    import grpc

    from mimo_epd.v1 import encoder_pb2, generator_pb2, generator_pb2_grpc

    def run(data: bytes, flag: bool):
        req = generator_pb2.GenerateRequest(
            prompt="Transcribe:",
            media=[encoder_pb2.MediaItem(data=data, modality=encoder_pb2.VIDEO)],
            sampling=generator_pb2.SamplingOptions(max_tokens=1),
            use_audio_in_video=flag,
        )
        with grpc.insecure_channel(worker.address) as ch:
            out = list(generator_pb2_grpc.GeneratorStub(ch).Generate(req, timeout=120))
        return out[-1].final.prompt_tokens

    assert 75 <= run(clips["talk.mp4"], True) - run(clips["talk.mp4"], False) <= 78
    with pytest.raises(grpc.RpcError) as ei:
        run(clips["silent.mp4"], True)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "media[0], its audio track" in ei.value.details() and "no audio stream" in ei.value.details()
