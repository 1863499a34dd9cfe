"""`mimo-epd make-test-audio` and `mimo-epd encode-audio`: a 40-s file written, then encoded in two parallel
ranges (30 s + 10 s) by two decoder processes; JSON on stdout, and the saved embedding equals the
transformers reference."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.audio.reference import hf_embedding, pyav_samples
from tests.conftest import ROOT


def _cli(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "mimo_epd", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_make_and_encode_audio(tmp_path):
    from safetensors.torch import load_file

    from encoder_server.models.audio_loader import load_audio_model

    path = str(tmp_path / "talk.mp3")
    made = _cli("make-test-audio", "--seconds", "40", "--out", path, "--no-progress")
    assert made["codec"] == "libmp3lame" and made["bytes"] > 0
    out = str(tmp_path / "emb.safetensors")
    summary = _cli(
        "encode-audio", path, "--workers", "2", "--chunk-seconds", "30", "--parallel-above-s", "0",
        "--out", out, "--no-progress",
    )  # fmt: skip
    assert summary["windows"] == 2 and summary["num_tokens"] == 1000 and summary["hidden"] == 256
    saved = load_file(out)
    assert saved["window_tokens"].tolist() == [750, 250]
    ref = hf_embedding(pyav_samples(path), load_audio_model("tiny").module)
    rel = ((saved["embedding"] - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel
    assert torch.isfinite(saved["embedding"]).all()


def test_encode_audio_refuses_a_file_without_sound(tmp_path):
    from mimo_epd.testing.video_gen import make_test_video

    path = str(tmp_path / "silent.mp4")
    make_test_video(path, 0.5, width=64, height=48)
    r = subprocess.run(
        [sys.executable, "-m", "mimo_epd", "encode-audio", path, "--no-progress", "--workers", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and "no audio stream" in r.stderr, r.stderr[-2000:]
