"""Peer video path: `qwen_vl_utils.fetch_video` (the Qwen2.5-VL model card's video reader) with one reader
backend (`torchcodec`, `decord` or `torchvision`), then the same encode step as ours (uint8 patchify + our
vision tower), in its own process so that its peak memory is its own and a crashing reader cannot take the
benchmark down.

    python -m mimo_epd.bench.peers.qwen_vl_video --backend decord --video F --nframes N --out DIR
prints one JSON line: backend asked and used, seconds (fetch, encode, total), peak RSS (VmHWM), frames shape,
or `error` with the reader's own message. DIR receives `embedding.npy`, `indices.npy` and `frames.npy` (every
`--keep-every`-th sampled frame, rounded to uint8, [n, H, W, 3]) for the benchmark's match check.

`nframes` is passed so both sides sample the same count; qwen-vl-utils then picks
`linspace(0, total - 1, n).round()`, the indices ours uses. The pixel bounds (`min_pixels`, `max_pixels`,
`total_pixels`) are ours, so the frame size is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, choices=["torchcodec", "decord", "torchvision"])
    p.add_argument("--video", required=True)
    p.add_argument("--nframes", type=int, required=True)
    p.add_argument("--min-pixels", type=int, required=True)
    p.add_argument("--max-pixels", type=int, required=True)
    p.add_argument("--total-pixels", type=int, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--keep-every", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.environ["FORCE_QWENVL_VIDEO_READER"] = args.backend  # read by qwen_vl_utils at import
    out: dict = {"backend": args.backend}
    try:
        out.update(run(args))
    except Exception as e:  # noqa: BLE001 - the reader's own error is the report
        out["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
    with open("/proc/self/status") as f:
        out["peak_rss_mb"] = round(next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024, 1)
    print(json.dumps(out), flush=True)
    return 0


def run(args) -> dict:
    import logging

    import numpy as np
    import qwen_vl_utils.vision_process as vp
    import torch

    from encoder_server.models import load_vision_model
    from encoder_server.preprocess import PreprocessConfig
    from encoder_server.video.encode import patchify_frames_uint8

    pre = PreprocessConfig.preset("qwen2_5_vl")
    model = load_vision_model(args.model)
    model.patch_embed.set_input_normalization(pre.mean, pre.std)
    # fetch_video silently falls back to torchvision when the chosen reader raises: catch that and report it.
    fell_back: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "error, use torchvision" in record.getMessage():
                fell_back.append(record.getMessage())

    vp.logger.addHandler(Catch())
    t0 = time.perf_counter()
    video, meta = vp.fetch_video(
        {
            "video": args.video,
            "nframes": args.nframes,
            "min_pixels": args.min_pixels,
            "max_pixels": args.max_pixels,
            "total_pixels": args.total_pixels,
        },
        return_video_metadata=True,
    )
    t_fetch = time.perf_counter() - t0
    if fell_back:
        raise RuntimeError(fell_back[0])
    frames = video.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()  # [n, H, W, 3]
    n, h, w, _ = frames.shape
    tp, ps = pre.temporal_patch_size, pre.patch_size
    if n % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - n % tp, 0)])
    per_group = (h // ps) * (w // ps)
    groups = frames.shape[0] // tp
    chunk = max(1, args.max_batch_tokens // per_group)
    t1 = time.perf_counter()
    outs = []
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        pv = np.concatenate([patchify_frames_uint8(frames[g * tp : (g + 1) * tp], pre) for g in range(g0, g1)])
        with torch.inference_mode():
            outs.append(model(torch.from_numpy(pv), torch.tensor([[g1 - g0, h // ps, w // ps]])))
    emb = torch.cat(outs).numpy()
    t_encode = time.perf_counter() - t1
    np.save(os.path.join(args.out, "embedding.npy"), emb)
    np.save(os.path.join(args.out, "frames.npy"), frames[: n : args.keep_every])
    np.save(os.path.join(args.out, "indices.npy"), np.asarray(list(meta.get("frames_indices", [])), np.int64))
    return {
        "backend_used": meta.get("video_backend", args.backend),
        "frames": [n, h, w],
        "seconds": {
            "fetch_video": round(t_fetch, 3),
            "encode": round(t_encode, 3),
            "total": round(t_fetch + t_encode, 3),
        },
    }


if __name__ == "__main__":
    sys.exit(main())
