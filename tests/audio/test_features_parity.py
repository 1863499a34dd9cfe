"""Log-mel features against transformers' `WhisperFeatureExtractor` (128 mel bins, 16 kHz, 30-s windows).

Each window of ours must equal the extractor run on that window's samples (padding="max_length"), on a
speech-like signal, silence, a clipped signal, one shorter than a window and one spanning three windows;
the valid frame counts must equal the extractor's attention-mask sums. Measured: max abs difference 0.0
(bit-identical on the CPU; the same torch operations in the same order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from encoder_server.audio.features import AudioFeatureConfig, LogMel, mel_filter_bank
from mimo_epd.testing.audio_gen import speech_like

CFG = AudioFeatureConfig()
RATE = CFG.sampling_rate


def _speech(seconds: float, seed: int = 0) -> np.ndarray:
    return np.concatenate(list(speech_like(seconds, RATE, seed)))


SIGNALS = {
    "speech_short": lambda: _speech(4.3),
    "silence": lambda: np.zeros(RATE * 3, np.float32),
    "clipped": lambda: np.clip(_speech(6.0, seed=3) * 20.0, -1.0, 1.0),
    "speech_three_windows": lambda: _speech(2 * 30 + 7.55, seed=1),
    "exact_window": lambda: _speech(30.0, seed=2),
}


@pytest.fixture(scope="module")
def extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(**CFG.hf_kwargs())


def test_filter_bank_equals_the_extractors(extractor):
    np.testing.assert_array_equal(mel_filter_bank(CFG), extractor.mel_filters)


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_features_equal_whisper_feature_extractor(extractor, name):
    x = SIGNALS[name]().astype(np.float32)
    ours, frames = LogMel(CFG).features(x)
    w = CFG.window_samples
    assert ours.shape == (-(-x.size // w), CFG.n_mels, CFG.window_frames)
    for i in range(ours.shape[0]):
        ref = extractor(x[i * w : (i + 1) * w], sampling_rate=RATE, return_tensors="np", return_attention_mask=True)
        diff = np.abs(ours[i].numpy() - ref["input_features"][0]).max()
        assert diff <= 1e-6, f"{name} window {i}: max abs diff {diff}"
        assert frames[i] == int(ref["attention_mask"].sum())


def test_batched_windows_equal_one_by_one():
    lm = LogMel(CFG)
    windows, _ = lm.windows(_speech(75.0, seed=4))
    together = lm(windows)
    for i in range(windows.shape[0]):
        torch.testing.assert_close(lm(windows[i : i + 1])[0], together[i], rtol=0, atol=1e-6)


def test_fingerprint_names_every_setting():
    assert AudioFeatureConfig().fingerprint() != AudioFeatureConfig(n_mels=80).fingerprint()
    assert "chunk_length=30" in CFG.fingerprint()
