"""Video: sampling formula, planned/parallel decode exactness, streaming = whole-clip forward, bad files,
and the CLI on a generated two-minute video."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from encoder_server.models import load_vision_model
from encoder_server.preprocess import PreprocessConfig, patchify_frames
from encoder_server.video.decode import VideoError, decode_gops, decode_parallel, plan, probe
from encoder_server.video.encode import encode_video, patchify_frames_uint8
from encoder_server.video.sampling import VideoSampling, frame_size, sample_indices
from mimo_epd.testing.video_gen import make_test_video
from tests.conftest import ROOT


@pytest.fixture(scope="session")
def two_minute_video(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "two_minutes.mp4"
    make_test_video(str(path), 120, width=320, height=180, gop=250, preset="ultrafast")
    return str(path)


@pytest.fixture(scope="session")
def short_video(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "short.mp4"
    make_test_video(str(path), 20, width=320, height=240, gop=60)
    return str(path)


# --------------------------------------------------------------------------- sampling
def reference_indices(total, video_fps, **ele):
    """The peer itself: qwen-vl-utils' frame count and torch.linspace, as its video readers call them."""
    from qwen_vl_utils.vision_process import smart_nframes

    n = smart_nframes(ele, total_frames=total, video_fps=video_fps)
    return torch.linspace(0, total - 1, n).round().long().numpy()


@pytest.mark.parametrize(
    "total,vfps", [(108000, 30), (3600, 30), (300, 25), (1800, 29.97), (100, 30), (7201, 60), (20, 30), (67, 24)]
)
def test_indices_match_qwen_vl_utils(total, vfps):
    np.testing.assert_array_equal(sample_indices(total, vfps, VideoSampling()), reference_indices(total, vfps))


def test_frame_counts_match_qwen_vl_utils_over_a_grid():
    # rounding down, not to nearest, to the frame factor: a 67-frame 24 fps clip is 5.58 s -> 11.2 -> 10 frames
    grid = [
        (t, f, fps, mx)
        for t in range(4, 2500, 13)
        for f in (24, 25, 29.97, 60)
        for fps in (0.5, 2.0, 3.3)
        for mx in (16, 768)
    ]
    for total, vfps, fps, mx in grid:
        ours = sample_indices(total, vfps, VideoSampling(fps=fps, max_frames=mx))
        ref = reference_indices(total, vfps, fps=fps, max_frames=mx)
        assert np.array_equal(ours, ref), (total, vfps, fps, mx, len(ours), len(ref))


def test_a_video_shorter_than_the_frame_factor_is_encoded_not_refused():
    # the reference raises for 1 frame; we encode the one frame there is
    assert sample_indices(1, 30, VideoSampling()).tolist() == [0]


def test_sampling_limits_and_pixel_budget():
    s = VideoSampling(fps=2.0, max_frames=768)
    assert len(sample_indices(108000, 30, s)) == 768  # one hour at 2 fps would be 7200: capped
    assert len(sample_indices(108000, 30, VideoSampling(max_frames=100))) == 100
    assert len(sample_indices(108000, 30, VideoSampling(fps=0.01))) == 36  # 3600 s * 0.01
    h, w = frame_size(360, 640, 768, s, PreprocessConfig())
    assert h % 28 == 0 and w % 28 == 0 and 768 * h * w <= s.total_pixels * s.frame_factor
    with pytest.raises(ValueError, match="--fps"):
        VideoSampling(fps=0).validate()


# --------------------------------------------------------------------------- decoding
def test_probe_finds_frames_and_keyframes(two_minute_video):
    info = probe(two_minute_video)
    assert info.frames == 3600 and info.fps == 30 and info.width == 320 and info.height == 180
    assert info.keyframes[:3] == [0, 250, 500]


@pytest.mark.parametrize("mode,workers", [("thread", 1), ("thread", 3), ("process", 2)])
def test_parallel_decode_equals_sequential(short_video, mode, workers):
    info = probe(short_video)
    idx = sample_indices(info.frames, info.fps, VideoSampling(fps=3.0))
    size = frame_size(info.height, info.width, len(idx), VideoSampling(), PreprocessConfig())
    seq = []
    decode_gops(short_video, plan(idx, info.keyframes), size, lambda i, a: seq.append((i, a.copy())))
    par = list(decode_parallel(short_video, idx, info.keyframes, size, workers=workers, mode=mode))
    assert [i for i, _ in par] == [i for i, _ in seq] == idx.tolist()
    for (_, a), (_, b) in zip(par, seq):
        assert np.array_equal(a, b)


def test_planned_decode_equals_decoding_everything(short_video):
    """Seeking to each GOP and skipping unneeded frames gives the frames a full decode gives."""
    import av

    info = probe(short_video)
    idx = sample_indices(info.frames, info.fps, VideoSampling(fps=4.0))
    full, b_frames = [], 0
    with av.open(short_video) as c:
        for frame in c.decode(video=0):
            full.append(frame.to_ndarray(format="rgb24"))
            b_frames += frame.pict_type == av.video.frame.PictureType.B
    assert b_frames > len(full) // 4  # the non-reference frames decode_gops skips before a sample are there
    got = []
    decode_gops(short_video, plan(idx, info.keyframes), None, lambda i, a: got.append((i, a)))
    for i, a in got:
        assert np.array_equal(a, full[i])
    gops = plan(idx, info.keyframes)
    assert sum(g.cost for g in gops) < info.frames  # frames after a GOP's last sample are never decoded


@pytest.fixture
def bad_files(tmp_path, two_minute_video):
    import av

    audio = tmp_path / "audio_only.m4a"
    with av.open(str(audio), "w") as c:
        st = c.add_stream("aac", rate=44100)
        for i in range(20):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 44100
            frame.pts = i * 1024
            for pkt in st.encode(frame):
                c.mux(pkt)
        for pkt in st.encode():
            c.mux(pkt)
    data = open(two_minute_video, "rb").read()
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "truncated.mp4").write_bytes(data[: len(data) // 50])
    corrupted = bytearray(data)
    corrupted[:4096] = b"\x00" * 4096  # container header destroyed
    (tmp_path / "corrupted.mp4").write_bytes(bytes(corrupted))
    return {
        "audio": str(audio),
        "empty": str(tmp_path / "empty.mp4"),
        "truncated": str(tmp_path / "truncated.mp4"),
        "corrupted": str(tmp_path / "corrupted.mp4"),
    }


@pytest.mark.parametrize(
    "kind,fragment", [("audio", "no video stream"), ("empty", "empty"), ("truncated", ""), ("corrupted", "")]
)
def test_bad_files_get_a_clear_error(bad_files, kind, fragment):
    model = load_vision_model("tiny")
    with pytest.raises(VideoError) as ei:
        encode_video(bad_files[kind], model, PreprocessConfig(), VideoSampling(), workers=1, mode="thread")
    assert fragment in str(ei.value)
    assert str(ei.value)  # says why


# --------------------------------------------------------------------------- encoding
def test_uint8_patchify_matches_the_reference_layout():
    cfg = PreprocessConfig()
    frames = np.random.default_rng(0).integers(0, 256, (2, 56, 84, 3), dtype=np.uint8)
    raw = torch.from_numpy(patchify_frames_uint8(frames, cfg)).float()
    mean = torch.tensor(cfg.mean).view(3, 1) * 255
    std = torch.tensor(cfg.std).view(3, 1) * 255
    raw = ((raw.view(-1, 3, 2 * 14 * 14) - mean) / std).view(raw.shape[0], -1)
    norm = (
        torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255 - torch.tensor(cfg.mean).view(1, 3, 1, 1)
    ) / torch.tensor(cfg.std).view(1, 3, 1, 1)
    torch.testing.assert_close(raw, patchify_frames(norm, cfg), atol=1e-5, rtol=1e-5)


def test_streaming_chunks_equal_one_whole_clip_forward(short_video):
    model = load_vision_model("tiny")
    cfg = PreprocessConfig()
    small = encode_video(short_video, model, cfg, VideoSampling(), workers=2, mode="thread", max_batch_tokens=300)
    whole = encode_video(short_video, model, cfg, VideoSampling(), workers=1, mode="thread", max_batch_tokens=10**9)
    assert small.grid_thw == whole.grid_thw and small.grid_thw[0] == 20  # 40 frames -> 20 temporal groups
    assert (small.embedding - whole.embedding).abs().max().item() <= 1e-5
    assert small.timestamps_s[:3] == pytest.approx([0.0, 1.0, 2.0], abs=0.05)
    assert small.embedding.shape[0] == math.prod(small.grid_thw) // 4


def test_cli_encode_video_two_minutes(two_minute_video, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "emb.safetensors"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mimo_epd",
            "encode-video",
            two_minute_video,
            "--out",
            str(out),
            "--workers",
            "2",
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["frames_total"] == 3600 and s["frames_sampled"] == 240 and s["grid_thw"][0] == 120
    assert s["tokens"] == math.prod(s["grid_thw"]) // 4 and set(s["seconds"]) >= {"probe", "encode", "total"}
    t = load_file(str(out))
    assert t["embedding"].shape == (s["tokens"], 256) and t["timestamps_s"].shape == (120,)
    bad = subprocess.run(
        [sys.executable, "-m", "mimo_epd", "encode-video", "/nonexistent.mp4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no such file" in bad.stderr


# --------------------------------------------------------------------------- tiny and elongated frames
def tiny_video(path: str, width: int, height: int, frames: int = 8, fps: int = 4) -> str:
    """A real H.264 file of noise frames at any even size (make_test_video needs room for its moving box)."""
    import av

    rng = np.random.default_rng(width * 1000 + height)
    with av.open(path, "w") as c:
        st = c.add_stream("libx264", rate=fps)
        st.width, st.height, st.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8), format="rgb24")
            for pkt in st.encode(frame):
                c.mux(pkt)
        for pkt in st.encode():
            c.mux(pkt)
    return path


def test_frames_smaller_than_the_factor_are_scaled_up_like_the_reference(tmp_path):
    """16x16 frames: the reference smart_resize scales them up to the video min_pixels; so does the encoder."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference

    path = tiny_video(str(tmp_path / "tiny.mp4"), 16, 16)
    s, cfg = VideoSampling(), PreprocessConfig()
    r = encode_video(path, load_vision_model("tiny"), cfg, s, workers=1, mode="thread")
    n = r.frames_sampled
    budget = int(max(min(s.max_pixels, s.total_pixels / n * s.frame_factor), int(s.min_pixels * 1.05)))
    th, tw = reference(16, 16, factor=cfg.factor, min_pixels=s.min_pixels, max_pixels=budget)
    assert r.frame_size == (th, tw) and th * tw >= s.min_pixels
    assert r.grid_thw == (n // 2, th // 14, tw // 14)


def test_frames_with_aspect_ratio_over_200_are_a_video_error(tmp_path):
    path = tiny_video(str(tmp_path / "thin.mp4"), 402, 2)
    with pytest.raises(VideoError, match="frames are 402x2; aspect ratio must be at most 200"):
        encode_video(path, load_vision_model("tiny"), PreprocessConfig(), VideoSampling(), workers=1, mode="thread")
