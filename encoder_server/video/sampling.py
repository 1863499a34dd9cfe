"""Which frames of a video are encoded, and at what size (the qwen-vl-utils convention, reference.md §3).

n = round to a multiple of `frame_factor` of clamp(duration * fps, min_frames, max_frames), never more
than the frames the video has; indices = linspace(0, total - 1, n).round(); each frame is resized with
smart_resize under the video pixel bounds, with its budget shrunk so that n * pixels <= total_pixels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..preprocess import PreprocessConfig, smart_resize


@dataclass(frozen=True)
class VideoSampling:
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)

    def validate(self) -> None:
        if self.fps <= 0:
            raise ValueError(f"--fps must be positive, got {self.fps}")
        if self.min_frames < 1 or self.max_frames < self.min_frames:
            raise ValueError(f"need 1 <= --min-frames <= --max-frames, got {self.min_frames} and {self.max_frames}")

    def fingerprint(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))


def _round_by(x: float, f: int) -> int:
    return int(round(x / f) * f)


def _floor_by(x: float, f: int) -> int:
    return int(math.floor(x / f) * f)


def _ceil_by(x: float, f: int) -> int:
    return int(math.ceil(x / f) * f)


def num_frames(total_frames: int, video_fps: float, s: VideoSampling) -> int:
    if total_frames < 1:
        raise ValueError("the video has no frames")
    f = s.frame_factor
    lo = _ceil_by(s.min_frames, f)
    hi = _floor_by(min(s.max_frames, total_frames), f)
    n = total_frames / video_fps * s.fps
    n = min(max(n, lo), hi) if hi >= lo else min(total_frames, lo)
    n = _round_by(n, f) if n >= f else n
    return int(max(1, min(n, total_frames)))


def sample_indices(total_frames: int, video_fps: float, s: VideoSampling) -> np.ndarray:
    n = num_frames(total_frames, video_fps, s)
    return np.linspace(0, total_frames - 1, n).round().astype(np.int64)


def frame_size(height: int, width: int, n_frames: int, s: VideoSampling, pre: PreprocessConfig) -> tuple[int, int]:
    """Target (h, w) of every sampled frame."""
    max_pixels = max(min(s.max_pixels, s.total_pixels / n_frames * s.frame_factor), int(s.min_pixels * 1.05))
    return smart_resize(height, width, pre.factor, s.min_pixels, int(max_pixels))
