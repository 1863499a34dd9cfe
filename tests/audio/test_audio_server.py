"""Audio through the real encoder server (gRPC on loopback, decode processes, the batcher): embeddings equal
to the transformers reference (`reference.py`), long items decoded in parallel ranges, the cache, refusals
naming the item, and images and audio in one request."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from encoder_server.models.audio_loader import load_audio_model
from mimo_epd.testing.audio_gen import make_test_audio
from mimo_epd.testing.video_gen import make_test_video
from mimo_epd.v1 import encoder_pb2 as pb
from tests.audio.reference import hf_embedding, pyav_samples
from tests.conftest import encode_image, start_server, textured
from tests.encoder.test_decode_server import encode, expect_error

REL_L2 = 1e-5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio")
    out = {}
    for name, seconds, kw in [
        ("clip.wav", 7.5, {}),
        ("clip.mp3", 4.0, {"channels": 2}),
        ("long.flac", 75.0, {"seed": 2}),
    ]:
        out[name] = str(d / name)
        make_test_audio(out[name], seconds, **kw)
    out["talk.mp4"] = str(d / "talk.mp4")  # a video with a soundtrack (use_audio_in_video)
    make_test_video(out["talk.mp4"], 3.0, width=96, height=64, audio_rate=16000, seed=5)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, files):
    import os

    s = start_server(
        [
            "--decode-workers", "2",
            "--audio-parallel-above-s", "40",
            "--audio-chunk-seconds", "30",
            "--allowed-local-dir", os.path.dirname(files["clip.wav"]),
            "--max-audio-seconds", "600",
        ]
    )  # fmt: skip
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)[-3000:]


def _emb(item: pb.ItemEmbedding) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(item.embedding.data, "<f4").copy()).view(*item.embedding.shape)


def _check(item: pb.ItemEmbedding, path: str) -> None:
    ref = hf_embedding(pyav_samples(path), load_audio_model("tiny").module)
    got = _emb(item)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < REL_L2, f"relative L2 {rel:.2e}"
    assert item.num_tokens == sum(item.window_tokens) == ref.shape[0]


@pytest.mark.parametrize("name", ["clip.wav", "clip.mp3", "long.flac"])
def test_audio_item_equals_the_transformers_reference(server, files, name):
    data = open(files[name], "rb").read()
    r = encode(server.address, pb.MediaItem(data=data, modality=pb.AUDIO)).items[0]
    _check(r, files[name])
    assert r.audio.sample_rate > 0 and r.audio.codec
    if name == "long.flac":  # 3 windows (30 + 30 + 15 s), decoded as three parallel ranges
        assert list(r.window_tokens) == [750, 750, 375]
    again = encode(server.address, pb.MediaItem(path=files[name], modality=pb.AUDIO)).items[0]
    assert again.cache_hit and again.content_key == r.content_key
    assert np.array_equal(_emb(again).numpy(), _emb(r).numpy())


def test_images_and_audio_in_one_request(server, files):
    jpeg = encode_image(textured(120, 160, seed=3), "JPEG")
    audio = open(files["clip.wav"], "rb").read()
    r = encode(server.address, pb.MediaItem(data=jpeg), pb.MediaItem(data=audio, modality=pb.AUDIO))
    assert r.items[0].num_tokens > 0 and r.items[1].num_tokens == 187
    # The same bytes as an image and as audio never share a key.
    assert r.items[0].content_key != r.items[1].content_key


def test_the_soundtrack_of_a_video_equals_the_transformers_reference(server, files):
    """use_audio_in_video sends a video's bytes twice, as VIDEO and as AUDIO: the audio item is its first audio
    stream, embedded as transformers embeds that stream (PyAV's `streams.audio[0]`, the feature extractor, the
    tower), and the two items never share a key."""
    data = open(files["talk.mp4"], "rb").read()
    r = encode(server.address, pb.MediaItem(data=data, modality=pb.VIDEO), pb.MediaItem(data=data, modality=pb.AUDIO))
    video, audio = r.items
    assert video.num_tokens > 0 and video.video.frames_sampled > 0
    _check(audio, files["talk.mp4"])
    assert 75 <= audio.num_tokens <= 78 and audio.audio.codec == "aac"  # 3 s (+ AAC's padding frames): 75 tokens
    assert video.content_key != audio.content_key


def test_bad_audio_is_refused_naming_the_item(server, files, tmp_path):
    video = str(tmp_path / "silent.mp4")
    make_test_video(video, 0.5, width=64, height=48)
    wav = open(files["clip.wav"], "rb").read()
    ok = pb.MediaItem(data=encode_image(textured(64, 64), "JPEG"))
    cases = [
        (open(video, "rb").read(), "no audio stream"),
        (wav[: len(wav) // 3], "truncated"),
        (b"RIFF" + b"\x00" * 100, "not a readable audio file"),
    ]
    for data, fragment in cases:
        msg = expect_error(
            server.address, grpc.StatusCode.INVALID_ARGUMENT, fragment, ok, pb.MediaItem(data=data, modality=pb.AUDIO)
        )
        assert "item 1" in msg, msg
    # ...and the server keeps serving audio.
    assert encode(server.address, pb.MediaItem(data=wav, modality=pb.AUDIO)).items[0].num_tokens == 187
