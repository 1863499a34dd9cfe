"""Streaming video encoding: sampled frames flow from the parallel decoder into patches and the vision
tower while decoding continues.

Frames arrive in order, already scaled to the target size by the decoder; every `temporal_patch_size`
(2) consecutive frames form one temporal group; groups are cut into uint8 patches and sent through the
tower in chunks of at most `max_batch_tokens` patches. The Qwen2.5-VL tower never attends across
temporal groups (windows and full-attention segments are per group), so chunking gives exactly the
embedding of a whole-clip forward, with memory bounded by one chunk plus the decoder's queues.

MiMo's tower (`pre.exact_floats`) attends within each frame pair too, so the same chunking is exact for it; its
frames are decoded at full size and each group is resized as floats (bilinear, no rounding), normalised and cut
into float patches (`float_group_patches`), as MiMo's processor does to the same decoded frames.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..preprocess import ImageSizeError, PreprocessConfig, patchify_frames, resize_bilinear_floats
from .decode import VideoError, VideoInfo, decode_parallel, probe
from .sampling import VideoSampling, frame_size, sample_indices


def patchify_frames_uint8(frames: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    """[T, H, W, 3] uint8 frames (T = temporal_patch_size) -> [gh*gw, 3*T*P*P] uint8 patches, in the HF
    processor's layout (merge-block-major; channel, time, row, column inside a patch), not normalised:
    the tower normalises inside its patch embedding."""
    t, h, w, c = frames.shape
    p, m = config.patch_size, config.merge_size
    gh, gw = h // p, w // p
    x = frames.reshape(t, gh // m, m, p, gw // m, m, p, c).transpose(1, 4, 2, 5, 7, 0, 3, 6)
    return np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p)


def float_group_patches(frames: np.ndarray, size: tuple[int, int], config: PreprocessConfig) -> torch.Tensor:
    """[T, H, W, 3] uint8 full-size frames -> MiMo's [gh*gw, 3*T*P*P] float32 patches at `size` (h, w): bilinear
    float resize, (x - 255 mean) / (255 std), the processor's patch layout."""
    batch = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    x = resize_bilinear_floats(batch, size)
    mean = torch.tensor(config.mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(config.std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    return patchify_frames(x.sub_(mean).div_(std), config)


@dataclass
class VideoEncodeResult:
    embedding: torch.Tensor  # [tokens, hidden]
    grid_thw: tuple[int, int, int]
    timestamps_s: list[float]  # start time of each temporal group
    end_s: float  # where the sampled span ends (segment_end)
    info: VideoInfo
    frames_sampled: int
    frame_size: tuple[int, int]
    seconds: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            **self.info.summary(),
            "frames_sampled": self.frames_sampled,
            "frame_size": f"{self.frame_size[1]}x{self.frame_size[0]}",
            "grid_thw": list(self.grid_thw),
            "tokens": int(self.embedding.shape[0]),
            "hidden": int(self.embedding.shape[1]),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


def plan_video(
    path: str,
    pre: PreprocessConfig,
    sampling: VideoSampling,
    max_frames_total: int | None,
    max_duration_s: float | None,
) -> tuple[VideoInfo, list[int], tuple[int, int]]:
    """The probe, the sampled frame indices and the resized frame size; VideoError for what cannot be encoded."""
    import os

    sampling.validate()
    if os.path.getsize(path) == 0:
        raise VideoError("empty item (0 bytes)")
    info = probe(path, max_frames_total)
    if max_duration_s and info.duration_s > max_duration_s:
        raise VideoError(
            f"the video lasts {info.duration_s:.1f}s, over the limit of {max_duration_s:g}s (--max-video-seconds)"
        )
    indices = sample_indices(info.frames, info.fps, sampling)
    try:  # frames smaller than the resize factor are scaled up (as images are); only the aspect ratio can fail
        size = frame_size(info.height, info.width, len(indices), sampling, pre)
    except ImageSizeError as e:
        raise VideoError(str(e).replace("image is", "frames are", 1)) from None
    return info, indices, size


class _ChunkEncoder:
    """Frames in, embeddings out: temporal groups of `temporal_patch_size` frames are patchified and encoded in
    chunks of at most `groups_per_chunk` groups, so memory holds one chunk of pixels at a time."""

    def __init__(self, model, pre: PreprocessConfig, grid_hw: tuple[int, int], max_batch_tokens: int, device) -> None:
        self.model, self.pre, self.device = model, pre, device
        self.gh, self.gw = grid_hw
        self.groups_per_chunk = max(1, max_batch_tokens // (self.gh * self.gw))
        self.outputs: list[torch.Tensor] = []
        self.chunk: list = []  # uint8 patches (numpy), or MiMo's float patches (torch)
        self.group: list[np.ndarray] = []
        self.timing = {"wait_decode": 0.0, "patchify": 0.0, "encode": 0.0}
        self.encoded = 0  # frames encoded (groups x temporal_patch_size)

    def add(self, arr: np.ndarray) -> bool:
        """Adds one frame; True when it starts a temporal group. Encodes a chunk when it is full."""
        starts = not self.group
        self.group.append(arr)
        if len(self.group) == self.pre.temporal_patch_size:
            self._close_group()
            if len(self.chunk) >= self.groups_per_chunk:
                self.flush()
        return starts

    def finish(self) -> torch.Tensor:
        """Pads the last group by repeating its last frame (as the processor does), encodes the rest."""
        if self.group:
            self.group.extend([self.group[-1]] * (self.pre.temporal_patch_size - len(self.group)))
            self._close_group()
        self.flush()
        if not self.outputs:
            raise VideoError("no frame was decoded")
        return torch.cat(self.outputs)

    def _close_group(self) -> None:
        t = time.perf_counter()
        if self.pre.exact_floats:
            size = (self.gh * self.pre.patch_size, self.gw * self.pre.patch_size)
            self.chunk.append(float_group_patches(np.stack(self.group), size, self.pre))
        else:
            self.chunk.append(patchify_frames_uint8(np.stack(self.group), self.pre))
        self.group.clear()
        self.timing["patchify"] += time.perf_counter() - t

    def flush(self) -> None:
        if not self.chunk:
            return
        t = time.perf_counter()
        pv = torch.cat(self.chunk) if self.pre.exact_floats else torch.from_numpy(np.concatenate(self.chunk))
        pv = pv.to(self.device)
        grid = torch.tensor([[len(self.chunk), self.gh, self.gw]])
        with torch.inference_mode():
            self.outputs.append(self.model(pv, grid).cpu())
        self.encoded += len(self.chunk) * self.pre.temporal_patch_size
        self.chunk.clear()
        self.timing["encode"] += time.perf_counter() - t


def encode_video(
    path: str,
    model: torch.nn.Module,
    pre: PreprocessConfig,
    sampling: VideoSampling,
    workers: int = 2,
    mode: str = "process",
    max_batch_tokens: int = 16384,
    max_frames_total: int | None = None,
    progress=None,
    device: str | torch.device = "cpu",
    max_duration_s: float | None = None,
) -> VideoEncodeResult:
    """Encodes one video file. `progress(decoded, encoded, total)` is called as frames advance."""
    t0 = time.perf_counter()
    info, indices, (th, tw) = plan_video(path, pre, sampling, max_frames_total, max_duration_s)
    gh, gw = th // pre.patch_size, tw // pre.patch_size
    enc = _ChunkEncoder(model, pre, (gh, gw), max_batch_tokens, device)
    model.patch_embed.set_input_normalization(pre.mean, pre.std)
    t_probe = time.perf_counter() - t0
    timestamps: list[float] = []
    decode_size = None if pre.exact_floats else (th, tw)  # MiMo resizes the full frames as floats
    frames = decode_parallel(path, indices, info.keyframes, decode_size, workers=workers, mode=mode)
    decoded = 0
    t_wait = time.perf_counter()
    for idx, arr in frames:
        enc.timing["wait_decode"] += time.perf_counter() - t_wait
        decoded += 1
        encoded_before = enc.encoded
        if enc.add(arr):
            timestamps.append(idx / info.fps)
        if progress and ((decoded - 1) % 16 == 0 or enc.encoded != encoded_before):
            progress(decoded, min(enc.encoded, len(indices)), len(indices))
        t_wait = time.perf_counter()
    emb = enc.finish()
    if progress:
        progress(decoded, min(enc.encoded, len(indices)), len(indices))
    seconds = {"probe": t_probe, **enc.timing, "total": time.perf_counter() - t0}
    grid = (len(timestamps), gh, gw)
    end = segment_end([i / info.fps for i in indices])
    return VideoEncodeResult(emb, grid, timestamps, end, info, len(indices), (th, tw), seconds)


def segment_end(times: list[float]) -> float:
    """Where a span of sampled frames ends: the last frame's time plus the spacing of the first two (one second for
    a single frame), computed as MiMo's processor computes it from its float32 frame times (fps = 1 / spacing, end =
    last + 1 / fps), so its soundtrack rows split at the same places."""
    t = [float(np.float32(x)) for x in times]
    fps = 1.0 if len(t) < 2 else 1.0 / (t[1] - t[0])
    return t[-1] + 1.0 / fps
