"""Log-mel features of mono audio, numerically equal to transformers' `WhisperFeatureExtractor`.

Algorithm (what `WhisperFeatureExtractor(feature_size=n_mels)` computes with its torch path, per window):

1. the waveform (float32, mono, at `sampling_rate`) is cut into windows of `chunk_length` seconds; each
   window is zero-padded at the end to exactly `chunk_length * sampling_rate` samples (the extractor's
   `padding="max_length"`), so every window yields `chunk_length * sampling_rate / hop_length` frames;
2. `torch.stft` with a periodic Hann window of `n_fft`, `center=True` (reflect padding); the last frame is
   dropped; power spectrum `|X|^2`;
3. the Slaney-scale, Slaney-normalised mel filter bank (0 Hz to 8 kHz) applied as `filters.T @ power`;
4. `log10(max(mel, 1e-10))`, floored at `max - 8` per window, then `(x + 4) / 4`.

Invariants: a window's features depend only on its own samples (the max in step 4 is per window, as the
extractor's batched path takes it), so windows can be computed in any batch on any device; the number of
valid frames of a window is `ceil(samples / hop_length)`, the extractor's attention-mask sum.
`AudioFeatureConfig.fingerprint()` names every setting and is part of audio content keys.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AudioFeatureConfig:
    n_mels: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30  # seconds per window
    max_frequency: float = 8000.0

    @property
    def window_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def window_frames(self) -> int:
        return self.window_samples // self.hop_length

    def fingerprint(self) -> str:
        """A stable string of every field; part of audio content keys."""
        return ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))

    def hf_kwargs(self) -> dict:
        """The `WhisperFeatureExtractor(**kwargs)` that computes the same features."""
        return dict(
            feature_size=self.n_mels,
            sampling_rate=self.sampling_rate,
            hop_length=self.hop_length,
            chunk_length=self.chunk_length,
            n_fft=self.n_fft,
        )


# MiMo's audio (encoder_server/models/mimo_audio.py): what its items are decoded at and the settings its content keys
# name. Its log-mel is computed by the model (fixed HTK settings); `chunk_length` is its tokenizer's segment (60 s).
MIMO_AUDIO_FEATURES = AudioFeatureConfig(
    n_mels=128, sampling_rate=24000, hop_length=240, n_fft=960, chunk_length=60, max_frequency=12000.0
)


def _hz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    min_log_hz, min_log_mel, logstep = 1000.0, 15.0, 27.0 / np.log(6.4)
    mels = 3.0 * freq / 200.0
    log_region = freq >= min_log_hz
    mels[log_region] = min_log_mel + np.log(freq[log_region] / min_log_hz) * logstep
    return mels


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    min_log_hz, min_log_mel, logstep = 1000.0, 15.0, np.log(6.4) / 27.0
    freq = 200.0 * mels / 3.0
    log_region = mels >= min_log_mel
    freq[log_region] = min_log_hz * np.exp(logstep * (mels[log_region] - min_log_mel))
    return freq


def mel_filter_bank(cfg: AudioFeatureConfig) -> np.ndarray:
    """`[n_fft // 2 + 1, n_mels]` triangular filters on the Slaney mel scale with Slaney area normalisation
    (float64, as the extractor builds them)."""
    n_freqs = 1 + cfg.n_fft // 2
    fft_freqs = np.linspace(0, cfg.sampling_rate // 2, n_freqs)
    mel_min = _hz_to_mel_slaney(np.array([0.0]))[0]
    mel_max = _hz_to_mel_slaney(np.array([cfg.max_frequency]))[0]
    filter_freqs = _mel_to_hz_slaney(np.linspace(mel_min, mel_max, cfg.n_mels + 2))
    diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down, up))
    enorm = 2.0 / (filter_freqs[2 : cfg.n_mels + 2] - filter_freqs[: cfg.n_mels])
    return filters * np.expand_dims(enorm, 0)


class LogMel:
    """Computes windows' features on one device; the filter bank and the Hann window are built once."""

    def __init__(self, cfg: AudioFeatureConfig = AudioFeatureConfig(), device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.filters = torch.from_numpy(mel_filter_bank(cfg)).to(self.device, torch.float32)
        self.window = torch.hann_window(cfg.n_fft, device=self.device)

    def windows(self, samples: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Cuts mono float32 samples into zero-padded windows: `([n, window_samples], valid samples each)`."""
        x = torch.as_tensor(samples, dtype=torch.float32).reshape(-1)
        w = self.cfg.window_samples
        n = max(1, math.ceil(x.numel() / w))
        out = torch.zeros(n * w, dtype=torch.float32)
        out[: x.numel()] = x
        valid = [min(w, x.numel() - i * w) for i in range(n)]
        return out.view(n, w), valid

    def valid_frames(self, valid_samples: int) -> int:
        return math.ceil(valid_samples / self.cfg.hop_length)

    @torch.inference_mode()
    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        """`[n, window_samples]` float32 -> `[n, n_mels, window_frames]` float32 on this object's device."""
        x = windows.to(self.device, torch.float32)
        stft = torch.stft(x, self.cfg.n_fft, self.cfg.hop_length, window=self.window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()
        log_spec = torch.clamp(self.filters.T @ power, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0

    def features(self, samples: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """All windows of one signal: `([n, n_mels, window_frames], valid frames per window)`."""
        windows, valid = self.windows(samples)
        return self(windows), [self.valid_frames(v) for v in valid]
