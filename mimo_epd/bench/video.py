"""`mimo-epd bench video`: encoding a long video: ours (parallel, naive) vs qwen-vl-utils readers vs the decode floor.

Every mode samples the same frame indices (the qwen-vl-utils convention: n = clamp(duration x fps) rounded to
a multiple of 2, `linspace(0, total - 1, n).round()`) at the same frame size, and ends with the same
embedding (uint8 patchify + the same vision tower, in chunks of `--max-batch-tokens` patches).
- `floor`: the file decoded with PyAV on every core (one process per core, contiguous GOP ranges), every
  frame, frames discarded, nothing else;
- `parallel`: the product path (`encode_video`): keyframe plan, only the needed GOP prefixes decoded by
  one decoder per core, sampled frames scaled at the decoder, streamed into the tower; `parallel_threads`:
  the same with decoder threads instead of processes;
- `naive`: PyAV decodes every frame in order with FFmpeg's own threading (`thread_type=AUTO`), only the
  sampled ones are converted to RGB, resized with torchvision (bicubic, antialiased) and encoded;
- `qwen_vl_utils_<backend>`: `qwen_vl_utils.fetch_video(nframes=n, our pixel bounds)` with each reader backend
  (`torchcodec`, `decord`, `torchvision`), each in its own process (bench/peers/qwen_vl_video.py), then the
  same encode step; a backend that cannot run here reports the reader's own error;
- `scaling`: the parallel path with 1, 2, ... workers, so a many-core figure can be projected.
Peak RSS: ours, of this process and its decoder processes (sampled every 0.2 s); a peer, its process's VmHWM.
`frames_match`: every peer that ran produced the same indices and frame size as ours, its frames are within
FRAME_TOLERANCE mean |diff| (0-255 levels; FFmpeg's scaler at the decoder vs torchvision's antialiased bicubic
after it) of ours, and its embedding within EMBED_TOLERANCE relative L2 of ours.
The test video is generated once (`make-test-video`, 640x360 H.264 30 fps, GOP 250) and reused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from encoder_server.models import load_vision_model
from encoder_server.preprocess import PreprocessConfig, patchify_frames, resize_torch
from encoder_server.video.decode import decode_floor, decode_parallel, plan, probe
from encoder_server.video.encode import encode_video
from encoder_server.video.sampling import VideoSampling, frame_size, sample_indices
from mimo_epd.bench.peers.proc import RssSampler
from mimo_epd.testing.video_gen import make_test_video

BACKENDS = ("torchcodec", "decord", "torchvision")
FRAME_TOLERANCE = 3.0  # mean |diff| in 0-255 levels over the kept frames (measured: 1.4)
EMBED_TOLERANCE = 0.06  # relative L2 of the whole video embedding (measured: 0.028, naive's torchvision resize too)
KEEP_EVERY = 16  # frames kept for the pixel check: every 16th sampled frame


def log(msg: str) -> None:
    print(f"[bench video] {msg}", file=sys.stderr, flush=True)


def naive(path: str, model, pre: PreprocessConfig, sampling: VideoSampling, max_batch_tokens: int) -> torch.Tensor:
    import av

    info = probe(path)
    idx = sample_indices(info.frames, info.fps, sampling)
    th, tw = frame_size(info.height, info.width, len(idx), sampling, pre)
    wanted = set(idx.tolist())
    kept = []
    with av.open(path) as c:
        st = c.streams.video[0]
        st.thread_type = "AUTO"  # FFmpeg's frame + slice threads on every core
        for i, frame in enumerate(c.decode(st)):
            if i in wanted:  # only the sampled frames become RGB
                kept.append(frame.to_ndarray(format="rgb24"))
    tp, ps = pre.temporal_patch_size, pre.patch_size
    if len(kept) % tp:
        kept += [kept[-1]] * (tp - len(kept) % tp)
    mean = torch.tensor(pre.mean).view(1, 3, 1, 1)
    std = torch.tensor(pre.std).view(1, 3, 1, 1)
    groups = len(kept) // tp
    chunk = max(1, max_batch_tokens // ((th // ps) * (tw // ps)))
    outs = []
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        pv = []
        for g in range(g0, g1):
            frames = resize_torch(torch.from_numpy(np.stack(kept[g * tp : (g + 1) * tp])).permute(0, 3, 1, 2), (th, tw))
            pv.append(patchify_frames((frames.float() / 255 - mean) / std, pre))
        with torch.inference_mode():
            outs.append(model(torch.cat(pv), torch.tensor([[g1 - g0, th // ps, tw // ps]])))
    return torch.cat(outs)


def our_frames(path: str, idx: np.ndarray, keyframes: list[int], size: tuple[int, int], workers: int) -> np.ndarray:
    """Every KEEP_EVERY-th sampled frame as our decoders produce it (untimed; for the pixel check)."""
    return np.stack(
        [
            a
            for n, (_, a) in enumerate(decode_parallel(path, idx, keyframes, size, workers=workers, mode="thread"))
            if n % KEEP_EVERY == 0
        ]
    )


def run_peer(
    backend: str, path: str, n: int, sampling: VideoSampling, model: str, max_batch_tokens: int, workdir: str
) -> tuple[dict, dict]:
    """One qwen-vl-utils backend in its own process -> (its report, its arrays)."""
    if backend != "torchvision" and importlib.util.find_spec(backend) is None:
        return {"ran": False, "error": f"{backend} is not installed"}, {}
    out_dir = os.path.join(workdir, backend)
    os.makedirs(out_dir, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "mimo_epd.bench.peers.qwen_vl_video",
        "--backend",
        backend,
        "--video",
        path,
        "--nframes",
        str(n),
        "--min-pixels",
        str(sampling.min_pixels),
        "--max-pixels",
        str(sampling.max_pixels),
        "--total-pixels",
        str(sampling.total_pixels),
        "--model",
        model,
        "--max-batch-tokens",
        str(max_batch_tokens),
        "--keep-every",
        str(KEEP_EVERY),
        "--out",
        out_dir,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"ran": False, "error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}"}, {}
    rep = json.loads(lines[-1])
    if "error" in rep:
        return {"ran": False, "error": rep["error"], "peak_rss_mb": rep.get("peak_rss_mb")}, {}
    arrays = {k: np.load(os.path.join(out_dir, f"{k}.npy")) for k in ("embedding", "frames", "indices")}
    return {"ran": True, **rep}, arrays


def compare(peer: dict, arrays: dict, idx: np.ndarray, ours_frames: np.ndarray, ours_emb: np.ndarray) -> dict:
    same_idx = bool(np.array_equal(arrays["indices"], idx))
    same_size = tuple(arrays["frames"].shape) == tuple(ours_frames.shape)
    out = {"indices_equal": same_idx, "frame_size_equal": same_size}
    if same_size:
        d = np.abs(arrays["frames"].astype(np.int16) - ours_frames.astype(np.int16))
        out.update(frame_mean_abs_diff=round(float(d.mean()), 3), frame_max_abs_diff=int(d.max()))
    if arrays["embedding"].shape == ours_emb.shape:
        out["embedding_rel_l2"] = float(
            f"{np.linalg.norm(arrays['embedding'] - ours_emb) / np.linalg.norm(ours_emb):.3g}"
        )
    out["match"] = bool(
        same_idx
        and same_size
        and out.get("frame_mean_abs_diff", 1e9) <= FRAME_TOLERANCE
        and out.get("embedding_rel_l2", 1e9) <= EMBED_TOLERANCE
    )
    return out


def timed(fn, *a, **kw):
    with RssSampler() as rss:
        t = time.perf_counter()
        res = fn(*a, **kw)
        sec = time.perf_counter() - t
    return res, round(sec, 3), round(rss.peak / 2**20, 1)


def mimo_naive(path: str, model, pre: PreprocessConfig, sampling: VideoSampling, max_batch_tokens: int) -> torch.Tensor:
    """MiMo's video the reference's way: PyAV decodes every frame in order (FFmpeg's threads), the sampled ones kept
    at full size; then MiMo's processor's batch transform over all of them at once (one bilinear float resize,
    normalise, the last frame repeated to a pair) and the tower in chunks of `max_batch_tokens` patches."""
    import av

    from encoder_server.preprocess import resize_bilinear_floats

    info = probe(path)
    idx = sample_indices(info.frames, info.fps, sampling)
    th, tw = frame_size(info.height, info.width, len(idx), sampling, pre)
    wanted, kept = set(idx.tolist()), []
    with av.open(path) as c:
        st = c.streams.video[0]
        st.thread_type = "AUTO"
        for i, frame in enumerate(c.decode(st)):
            if i in wanted:
                kept.append(frame.to_ndarray(format="rgb24"))
    x = resize_bilinear_floats(torch.from_numpy(np.stack(kept)).permute(0, 3, 1, 2), (th, tw))
    del kept
    mean = torch.tensor(pre.mean).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(pre.std).view(1, 3, 1, 1) * 255.0
    pv = patchify_frames(x.sub_(mean).div_(std), pre)
    del x
    gh, gw = th // pre.patch_size, tw // pre.patch_size
    groups, per = pv.shape[0] // (gh * gw), gh * gw
    chunk = max(1, max_batch_tokens // per)
    outs = []
    with torch.inference_mode():
        for g0 in range(0, groups, chunk):
            g1 = min(groups, g0 + chunk)
            outs.append(model(pv[g0 * per : g1 * per], torch.tensor([[g1 - g0, gh, gw]])))
    return torch.cat(outs)


def video_facts(path: str, info, idx: np.ndarray, res, generated) -> dict:
    """What the JSON says about the video and our encoding of it (`res`: our VideoEncodeResult)."""
    return {
        "path": path,
        "duration_s": round(info.duration_s, 2),
        "frames_total": info.frames,
        "frames_sampled": int(len(idx)),
        "resolution": f"{info.width}x{info.height}",
        "fps": info.fps,
        "keyframes": len(info.keyframes),
        "frames_decoded_by_plan": int(sum(g.cost for g in plan(idx, info.keyframes))),
        "frame_size": f"{res.frame_size[1]}x{res.frame_size[0]}",
        "tokens": int(res.embedding.shape[0]),
        "generated": generated,
    }


def main_mimo(args) -> dict:
    """`--tower mimo`: MiMo's ViT and video rules (a make-checkpoint --like v2.5 tower, its processor_config's
    sampling: 2 fps, 8 to 256 frames, MiMo's frame budget) on the same file: ours (`encode_video`: the keyframe
    plan, full-size frames from parallel decoders, a float resize per frame pair, streamed into the tower) in
    processes and in threads, against `mimo_naive` (the reference's way), and the decode floor. The qwen-vl-utils
    readers are Qwen's convention, not run here."""
    from mimo_epd.bench.audio import _mimo_checkpoint

    cores = os.cpu_count() or 2
    minutes = 10 / 60 if args.quick else args.minutes
    cache = Path(args.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    path = args.file or str(cache / f"test-video-{round(minutes * 60)}s-640x360.mp4")
    generated = None if Path(path).exists() else make_test_video(path, minutes * 60)
    info = probe(path)
    loaded = load_vision_model(_mimo_checkpoint(cache), return_info=True)
    model, pre = loaded.module, PreprocessConfig.from_hf_dict(loaded.preprocessor_config)
    sampling = VideoSampling.mimo(loaded.preprocessor_config.get("processor_config"), pre.factor)
    idx = sample_indices(info.frames, info.fps, sampling)
    workers = args.workers or cores
    seconds: dict = {}
    peak: dict = {}
    _, seconds["floor"], peak["floor"] = timed(decode_floor, path, info.keyframes, info.frames, workers)
    runs = {}
    for mode in ("process", "thread"):
        name = "parallel" if mode == "process" else "parallel_threads"
        runs[name], _, peak[name] = timed(
            encode_video, path, model, pre, sampling, workers=workers, mode=mode, max_batch_tokens=args.max_batch_tokens
        )
        seconds[name] = round(runs[name].seconds["total"], 3)
        log(f"{name}: {seconds[name]}s")
    naive_emb, seconds["naive"], peak["naive"] = timed(mimo_naive, path, model, pre, sampling, args.max_batch_tokens)
    log(f"naive: {seconds['naive']}s")
    res = runs["parallel"]
    ours = res.embedding
    rel = float((naive_emb - ours).norm() / ours.norm()) if naive_emb.shape == ours.shape else float("inf")
    same_threads = torch.equal(runs["parallel_threads"].embedding, ours)
    return {
        "bench": "video",
        "tower": "mimo",
        "bounded": args.quick or args.minutes < 60,
        "video": video_facts(path, info, idx, res, generated),
        "cores": cores,
        "workers": workers,
        "sampling": {"fps": sampling.fps, "min_frames": sampling.min_frames, "max_frames": sampling.max_frames},
        "seconds": seconds,
        "peak_rss_mb": peak,
        "parallel_stages": {k: round(v, 3) for k, v in res.seconds.items()},
        "naive_embedding_rel_l2": float(f"{rel:.3g}"),
        "outputs_match": rel <= 1e-5 and same_threads,
        "ratios": {
            "naive_vs_parallel": round(seconds["naive"] / seconds["parallel"], 3),
            "parallel_vs_floor": round(seconds["parallel"] / seconds["floor"], 3),
            "threads_vs_processes": round(seconds["parallel_threads"] / seconds["parallel"], 3),
        },
    }


def main(args) -> dict:
    if args.transport:
        from .embedding_transfer import main as main_transport

        return main_transport(args)
    if args.tower == "mimo":
        return main_mimo(args)
    cores = os.cpu_count() or 2
    minutes = 10 / 60 if args.quick else args.minutes
    cache = Path(args.cache_dir).expanduser()
    path = args.file or str(cache / f"test-video-{round(minutes * 60)}s-640x360.mp4")
    generated = None
    if not Path(path).exists():
        generated = make_test_video(path, minutes * 60)
    info = probe(path)
    model = load_vision_model(args.model)
    pre = PreprocessConfig.preset("qwen2_5_vl")
    sampling = VideoSampling(fps=args.fps, max_frames=args.max_frames)
    idx = sample_indices(info.frames, info.fps, sampling)
    size = frame_size(info.height, info.width, len(idx), sampling, pre)
    workers = args.workers or cores
    seconds: dict = {}
    peak: dict = {}
    _, seconds["floor"], peak["floor"] = timed(decode_floor, path, info.keyframes, info.frames, workers)
    log(f"floor: {seconds['floor']}s")
    res, _, peak["parallel"] = timed(
        encode_video,
        path,
        model,
        pre,
        sampling,
        workers=workers,
        mode="process",
        max_batch_tokens=args.max_batch_tokens,
    )
    seconds["parallel"] = round(res.seconds["total"], 3)
    log(f"parallel: {seconds['parallel']}s")
    ours_emb = res.embedding.numpy()
    thread, _, peak["parallel_threads"] = timed(
        encode_video, path, model, pre, sampling, workers=workers, mode="thread", max_batch_tokens=args.max_batch_tokens
    )
    seconds["parallel_threads"] = round(thread.seconds["total"], 3)
    log(f"parallel_threads: {seconds['parallel_threads']}s")
    naive_emb, seconds["naive"], peak["naive"] = timed(naive, path, model, pre, sampling, args.max_batch_tokens)
    log(f"naive: {seconds['naive']}s")
    ours_frames = our_frames(path, idx, info.keyframes, size, workers)
    peers: dict = {}
    with tempfile.TemporaryDirectory() as workdir:
        for backend in BACKENDS if args.peers else ():
            name = f"qwen_vl_utils_{backend}"
            rep, arrays = run_peer(backend, path, len(idx), sampling, args.model, args.max_batch_tokens, workdir)
            if rep["ran"]:
                rep["check"] = compare(rep, arrays, idx, ours_frames, ours_emb)
                seconds[name] = rep["seconds"]["total"]
                peak[name] = rep["peak_rss_mb"]
                log(
                    f"{name}: {seconds[name]}s (fetch_video {rep['seconds']['fetch_video']}s) "
                    f"match={rep['check']['match']}"
                )
            else:
                log(f"{name}: could not run: {rep['error']}")
            peers[name] = rep
    scaling = {}
    for w in range(1, cores + 1):
        scaling[str(w)] = round(
            seconds["parallel"]
            if w == workers
            else encode_video(
                path, model, pre, sampling, workers=w, mode="process", max_batch_tokens=args.max_batch_tokens
            ).seconds["total"],
            3,
        )
    log(f"scaling: {scaling}")
    ran = [k for k, v in peers.items() if v["ran"]]
    naive_rel = float(np.linalg.norm(naive_emb.numpy() - ours_emb) / np.linalg.norm(ours_emb))
    ratios = {
        "naive_vs_parallel": round(seconds["naive"] / seconds["parallel"], 3),
        "parallel_vs_floor": round(seconds["parallel"] / seconds["floor"], 3),
        "threads_vs_processes": round(seconds["parallel_threads"] / seconds["parallel"], 3),
    }
    best = None
    if ran:
        best = min(ran, key=lambda k: seconds[k])
        ratios["vs_best_qwen_vl_utils"] = round(seconds[best] / seconds["parallel"], 3)
        ratios["fetch_video_vs_our_total"] = round(peers[best]["seconds"]["fetch_video"] / seconds["parallel"], 3)
    return {
        "bench": "video",
        "video": video_facts(path, info, idx, res, generated),
        "cores": cores,
        "workers": workers,
        "sampling": {"fps": sampling.fps, "max_frames": sampling.max_frames},
        "seconds": seconds,
        "peak_rss_mb": peak,
        "parallel_stages": {k: round(v, 3) for k, v in res.seconds.items()},
        "peers": peers,
        "best_qwen_vl_utils": best,
        "peers_installed": {b: (importlib.util.find_spec(b) is not None) for b in BACKENDS},
        "tolerance": {
            "frame_mean_abs_diff": FRAME_TOLERANCE,
            "embedding_rel_l2": EMBED_TOLERANCE,
            "frames_checked": f"every {KEEP_EVERY}th sampled frame",
        },
        "naive_embedding_rel_l2": float(f"{naive_rel:.3g}"),
        "frames_match": bool(ran) and all(peers[k]["check"]["match"] for k in ran),
        "scaling": scaling,
        "ratios": ratios,
    }


def add_arguments(p) -> None:
    import argparse

    p.add_argument("--minutes", type=float, default=60.0, help="length of the generated test video (default: 60)")
    p.add_argument("--file", default="", help="use this video instead of a generated one")
    p.add_argument(
        "--cache-dir", default="~/.cache/mimo-epd", help="where generated videos are kept (default: ~/.cache/mimo-epd)"
    )
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second (default: 2.0)")
    p.add_argument("--max-frames", type=int, default=768, help="most frames sampled (default: 768)")
    p.add_argument("--workers", type=int, default=0, help="parallel decoders (0 = every core) (default: 0)")
    p.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="patches per forward, every mode (default: 16384)"
    )
    p.add_argument("--model", default="tiny", help="vision model (default: tiny)")
    p.add_argument(
        "--peers", action=argparse.BooleanOptionalAction, default=True, help="run the qwen-vl-utils peers (default: on)"
    )
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI): a 10-second video")
    p.add_argument(
        "--transport",
        action="store_true",
        help="instead: the video's embeddings from a live encoder as gRPC bytes vs over Mooncake's transfer engine "
        "(mimo_epd/bench/embedding_transfer.py)",
    )
    p.add_argument("--rounds", type=int, default=5, help="--transport: timed rounds of each transport (default: 5)")
    p.add_argument(
        "--tower",
        choices=["qwen", "mimo"],
        default="qwen",
        help="qwen (Qwen2.5-VL's rules and tower, against the qwen-vl-utils readers) or mimo (MiMo-V2.5's ViT and "
        "video rules from a make-checkpoint --like v2.5 tower, against the reference's way; --fps and "
        "--max-frames are then the checkpoint's) (default: qwen)",
    )
