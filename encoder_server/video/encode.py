"""Streaming video encoding: sampled frames flow from the parallel decoder into patches and the vision
tower while decoding continues.

Frames arrive in order, already scaled to the target size by the decoder; every `temporal_patch_size`
(2) consecutive frames form one temporal group; groups are cut into uint8 patches and sent through the
tower in chunks of at most `max_batch_tokens` patches. The Qwen2.5-VL tower never attends across
temporal groups (windows and full-attention segments are per group), so chunking gives exactly the
embedding of a whole-clip forward, with memory bounded by one chunk plus the decoder's queues.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..preprocess import ImageSizeError, PreprocessConfig
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


@dataclass
class VideoEncodeResult:
    embedding: torch.Tensor  # [tokens, hidden]
    grid_thw: tuple[int, int, int]
    timestamps_s: list[float]  # start time of each temporal group
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
    sampling.validate()
    t0 = time.perf_counter()
    import os

    if os.path.getsize(path) == 0:
        raise VideoError("empty item (0 bytes)")
    info = probe(path, max_frames_total)
    if max_duration_s and info.duration_s > max_duration_s:
        raise VideoError(
            f"the video lasts {info.duration_s:.1f}s, over the limit of {max_duration_s:g}s (--max-video-seconds)"
        )
    indices = sample_indices(info.frames, info.fps, sampling)
    try:  # frames smaller than the resize factor are scaled up (as images are); only the aspect ratio can fail
        th, tw = frame_size(info.height, info.width, len(indices), sampling, pre)
    except ImageSizeError as e:
        raise VideoError(str(e).replace("image is", "frames are", 1)) from None
    tp, p = pre.temporal_patch_size, pre.patch_size
    gh, gw = th // p, tw // p
    per_group = gh * gw
    groups_per_chunk = max(1, max_batch_tokens // per_group)
    model.patch_embed.set_input_normalization(pre.mean, pre.std)
    t_probe = time.perf_counter() - t0

    outputs: list[torch.Tensor] = []
    chunk: list[np.ndarray] = []
    group: list[np.ndarray] = []
    timestamps: list[float] = []
    timing = {"wait_decode": 0.0, "patchify": 0.0, "encode": 0.0}
    decoded = encoded = 0

    def flush() -> None:
        nonlocal encoded
        if not chunk:
            return
        t = time.perf_counter()
        pv = torch.from_numpy(np.concatenate(chunk)).to(device)
        grid = torch.tensor([[len(chunk), gh, gw]])
        with torch.inference_mode():
            outputs.append(model(pv, grid).cpu())
        encoded += len(chunk) * tp
        chunk.clear()
        timing["encode"] += time.perf_counter() - t
        if progress:
            progress(decoded, min(encoded, len(indices)), len(indices))

    frames = decode_parallel(path, indices, info.keyframes, (th, tw), workers=workers, mode=mode)
    t_wait = time.perf_counter()
    for n, (idx, arr) in enumerate(frames):
        timing["wait_decode"] += time.perf_counter() - t_wait
        decoded += 1
        if not group:
            timestamps.append(idx / info.fps)
        group.append(arr)
        if len(group) == tp:
            t = time.perf_counter()
            chunk.append(patchify_frames_uint8(np.stack(group), pre))
            group.clear()
            timing["patchify"] += time.perf_counter() - t
            if len(chunk) >= groups_per_chunk:
                flush()
        if progress and n % 16 == 0:
            progress(decoded, encoded, len(indices))
        t_wait = time.perf_counter()
    if group:  # pad the last temporal group by repeating its last frame, as the processor does
        group.extend([group[-1]] * (tp - len(group)))
        chunk.append(patchify_frames_uint8(np.stack(group), pre))
    flush()
    if not outputs:
        raise VideoError("no frame was decoded")
    emb = torch.cat(outputs)
    seconds = {"probe": t_probe, **timing, "total": time.perf_counter() - t0}
    return VideoEncodeResult(emb, (len(timestamps), gh, gw), timestamps, info, len(indices), (th, tw), seconds)
