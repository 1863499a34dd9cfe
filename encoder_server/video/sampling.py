"""Which frames of a video are encoded, and at what size (the qwen-vl-utils convention).

The peer users compare us with is qwen-vl-utils 0.0.14 (`smart_nframes` + `torch.linspace`), so its arithmetic
is followed exactly, including two details a summary of the formula leaves open:
- n = clamp(duration * fps, min_frames, max_frames), never more than the frames the video has, then rounded
  *down* to a multiple of `frame_factor` (the reference's `floor_by_factor`; rounding to nearest gives 12
  frames where it gives 10 for a 5.6 s clip);
- indices = linspace(0, total - 1, n).round() in float32, as `torch.linspace` computes it: on a one-hour
  30 fps video float64 would pick 2 of the 768 frames one frame later.
Each frame is resized with smart_resize under the video pixel bounds, with its budget shrunk so that
n * pixels <= total_pixels.

MiMo's processor (`processor="mimo"`, `VideoSampling.mimo`) takes decoded frames and their times; which frames
is decided before it, so the count and indices above serve it too, with the defaults of the checkpoint's
`processor_config` (2 fps, 8 to 256 frames). Its frame size is its own: the budget is
max(min_pixels, min(total_pixels * 2 // n, max_pixels)) for n sampled frames, then MiMo's smart_resize (small frames
scaled to the factor first), and frames are resized as floats after decoding at full size (video/encode.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..preprocess import PreprocessConfig, mimo_smart_resize, smart_resize


@dataclass(frozen=True)
class VideoSampling:
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)
    processor: str = "qwen2_vl"  # whose frame-size rule: qwen2_vl or mimo

    @classmethod
    def mimo(cls, processor_config: dict | None, unit: int = 32) -> "VideoSampling":
        """MiMo's defaults from a checkpoint's `processor_config` (`unit`: patch x merge), the processor's own where
        it names none."""
        pc = processor_config or {}
        return cls(
            fps=float(pc.get("fps") or 2.0),
            min_frames=int(pc.get("min_frames") or 8),
            max_frames=int(pc.get("max_frames") or 256),
            min_pixels=int(pc.get("video_min_pixels") or 4 * unit * unit),
            max_pixels=int(pc.get("video_max_pixels") or 4096 * unit * unit),
            total_pixels=int(pc.get("video_total_max_pixels") or 16384 * unit * unit),
            processor="mimo",
        )

    def validate(self) -> None:
        if not (self.fps > 0 and math.isfinite(self.fps)):  # NaN fails every comparison: test what is allowed
            raise ValueError(f"--fps must be a positive finite number, got {self.fps}")
        if self.min_frames < 1 or self.max_frames < self.min_frames:
            raise ValueError(f"need 1 <= --min-frames <= --max-frames, got {self.min_frames} and {self.max_frames}")

    def fingerprint(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))


def _floor_by(x: float, f: int) -> int:
    return int(math.floor(x / f) * f)


def _ceil_by(x: float, f: int) -> int:
    return int(math.ceil(x / f) * f)


def num_frames(total_frames: int, video_fps: float, s: VideoSampling) -> int:
    if total_frames < 1:
        raise ValueError("the video has no frames")
    f = s.frame_factor
    lo = _ceil_by(s.min_frames, f)
    hi = _floor_by(s.max_frames, f)
    n = min(max(total_frames / video_fps * s.fps, lo), hi, total_frames)
    n = _floor_by(n, f)
    # fewer than frame_factor frames (a 1-frame video, --max-frames 1): the reference refuses; we take what there is
    return int(n) if n >= f else max(1, min(total_frames, s.max_frames))


def sample_indices(total_frames: int, video_fps: float, s: VideoSampling) -> np.ndarray:
    n = num_frames(total_frames, video_fps, s)
    # float32 like the reference's torch.linspace (see the module docstring); torch rounds half to even, as numpy
    return torch.linspace(0, total_frames - 1, n).round().long().numpy()


def frame_size(height: int, width: int, n_frames: int, s: VideoSampling, pre: PreprocessConfig) -> tuple[int, int]:
    """Target (h, w) of every sampled frame."""
    if s.processor == "mimo":
        budget = max(s.min_pixels, min(s.total_pixels * s.frame_factor // max(n_frames, 1), s.max_pixels))
        return mimo_smart_resize(height, width, pre.factor, s.min_pixels, budget)
    max_pixels = max(min(s.max_pixels, s.total_pixels / n_frames * s.frame_factor), int(s.min_pixels * 1.05))
    return smart_resize(height, width, pre.factor, s.min_pixels, int(max_pixels))
