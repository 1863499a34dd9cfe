"""`mimo-epd bench video`: encoding a long video, naive vs parallel vs the decode floor.

- `floor`: the file decoded with PyAV on every core (one process per core, contiguous GOP ranges), every
  frame, frames discarded, nothing else;
- `naive`: one thread decodes every frame and converts each to RGB at full resolution; then the sampled
  frames are preprocessed (torch resize, normalise, patchify) and encoded one temporal group at a time;
- `parallel`: the product path (`encode_video`): keyframe plan, only the needed GOP prefixes decoded by
  one decoder per core, sampled frames scaled at the decoder, streamed into the tower;
- `scaling`: the parallel path with 1, 2, ... workers, so a many-core figure can be projected.
The test video is generated once (`make-test-video`, 640x360 H.264 30 fps, GOP 250) and reused.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from encoder_server.models import load_vision_model
from encoder_server.preprocess import PreprocessConfig, patchify_frames, resize_torch
from encoder_server.video.decode import decode_floor, probe
from encoder_server.video.encode import encode_video
from encoder_server.video.sampling import VideoSampling, frame_size, sample_indices
from mimo_epd.testing.video_gen import make_test_video


def naive(path: str, model, pre: PreprocessConfig, sampling: VideoSampling) -> float:
    import av

    t0 = time.perf_counter()
    info = probe(path)
    idx = sample_indices(info.frames, info.fps, sampling)
    th, tw = frame_size(info.height, info.width, len(idx), sampling, pre)
    wanted = set(idx.tolist())
    kept = []
    with av.open(path) as c:
        st = c.streams.video[0]
        st.codec_context.thread_count = 1
        for i, frame in enumerate(c.decode(st)):
            rgb = frame.to_ndarray(format="rgb24")  # every frame, full resolution
            if i in wanted:
                kept.append(rgb)
    mean = torch.tensor(pre.mean).view(1, 3, 1, 1)
    std = torch.tensor(pre.std).view(1, 3, 1, 1)
    for g in range(0, len(kept), pre.temporal_patch_size):
        pair = kept[g:g + pre.temporal_patch_size]
        pair += [pair[-1]] * (pre.temporal_patch_size - len(pair))
        frames = resize_torch(torch.from_numpy(np.stack(pair)).permute(0, 3, 1, 2), (th, tw))
        pv = patchify_frames((frames.float() / 255 - mean) / std, pre)
        model(pv, torch.tensor([[1, th // pre.patch_size, tw // pre.patch_size]]))
    return time.perf_counter() - t0


def main(args) -> dict:
    cores = os.cpu_count() or 2
    minutes = 0.5 if args.quick else args.minutes
    cache = Path(args.cache_dir).expanduser()
    path = args.file or str(cache / f"test-video-{minutes:g}min-640x360.mp4")
    generated = None
    if not Path(path).exists():
        generated = make_test_video(path, minutes * 60)
    info = probe(path)
    model = load_vision_model(args.model)
    pre = PreprocessConfig.preset("qwen2_5_vl")
    sampling = VideoSampling(fps=args.fps, max_frames=args.max_frames)
    idx = sample_indices(info.frames, info.fps, sampling)
    workers = args.workers or cores
    seconds: dict = {}
    t = time.perf_counter()
    decode_floor(path, info.keyframes, info.frames, workers)
    seconds["floor"] = round(time.perf_counter() - t, 3)
    res = encode_video(path, model, pre, sampling, workers=workers, mode="process")
    seconds["parallel"] = round(res.seconds["total"], 3)
    thread = encode_video(path, model, pre, sampling, workers=workers, mode="thread")
    seconds["parallel_threads"] = round(thread.seconds["total"], 3)
    seconds["naive"] = round(naive(path, model, pre, sampling), 3)
    scaling = {}
    for w in range(1, cores + 1):
        scaling[str(w)] = round(seconds["parallel"] if w == workers else
                                encode_video(path, model, pre, sampling, workers=w, mode="process").seconds["total"], 3)
    from encoder_server.video.decode import plan

    decoded = sum(g.cost for g in plan(idx, info.keyframes))
    return {
        "bench": "video",
        "video": {"path": path, "duration_s": round(info.duration_s, 2), "frames_total": info.frames,
                  "frames_sampled": int(len(idx)), "resolution": f"{info.width}x{info.height}", "fps": info.fps,
                  "keyframes": len(info.keyframes), "frames_decoded_by_plan": int(decoded),
                  "frame_size": f"{res.frame_size[1]}x{res.frame_size[0]}", "tokens": int(res.embedding.shape[0]),
                  "generated": generated},
        "cores": cores, "workers": workers, "sampling": {"fps": sampling.fps, "max_frames": sampling.max_frames},
        "seconds": seconds,
        "parallel_stages": {k: round(v, 3) for k, v in res.seconds.items()},
        "scaling": scaling,
        "ratios": {"naive_vs_parallel": round(seconds["naive"] / seconds["parallel"], 3),
                   "parallel_vs_floor": round(seconds["parallel"] / seconds["floor"], 3),
                   "threads_vs_processes": round(seconds["parallel_threads"] / seconds["parallel"], 3)},
        "goals": {"naive_vs_parallel>=1.8": seconds["naive"] / seconds["parallel"] >= 1.8,
                  "parallel_vs_floor<=1.2": seconds["parallel"] / seconds["floor"] <= 1.2},
    }


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=60.0, help="length of the generated test video (default: 60)")
    p.add_argument("--file", default="", help="use this video instead of a generated one")
    p.add_argument("--cache-dir", default="~/.cache/mimo-epd", help="where generated videos are kept (default: ~/.cache/mimo-epd)")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second (default: 2.0)")
    p.add_argument("--max-frames", type=int, default=768, help="most frames sampled (default: 768)")
    p.add_argument("--workers", type=int, default=0, help="parallel decoders (0 = every core) (default: 0)")
    p.add_argument("--model", default="tiny", help="vision model (default: tiny)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI): a 30-second video")
