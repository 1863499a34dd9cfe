"""`mimo-epd bench audio`: a long audio file through our path vs the transformers path, and short clips
under load.

- `hour`: one file of `--minutes` minutes (`make-test-audio`, 16 kHz mono FLAC, generated once and reused)
  encoded by `ours` (`encode_audio_file`: parallel ranges on `--workers` decoder processes, features in
  them, windows batched into the tower) and by `transformers` (bench/peers/hf_audio.py: PyAV in one pass,
  `WhisperFeatureExtractor` batched, transformers' `Qwen2AudioEncoder` batched; the same windows and
  weights). Each runs in its own process, so its peak RSS (VmHWM, decoders included for ours) is its own.
  `outputs_match`: the two embeddings have the same shape and a relative L2 difference under 1e-4.
- `clips`: `--clips` short clips (2-10 s, distinct bytes, so no cache hits) sent at `--concurrency` through
  our real encoder server (gRPC on loopback, decode processes, the batcher) vs a peer that a transformers
  user would write: a thread pool running the transformers path per request with its own model copy
  (`clips_peer`). QPS and P90.
`ratios`: `hour_vs_transformers` (their seconds / ours) and `clips_qps_vs_peer` (ours / theirs).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mimo_epd.bench.common import closed_loop, latency_stats
from mimo_epd.testing.audio_gen import make_test_audio

MATCH_REL_L2 = 1e-4


def _child(mode: str, path: str, workers: int, out: str, chunk_s: float) -> None:
    """Runs one mode of the `hour` part in this (child) process and writes its result as JSON + tensor."""
    import resource

    import torch

    from encoder_server.audio.encode import AudioPlan, encode_audio_file
    from encoder_server.models.audio_loader import load_audio_model

    model = load_audio_model("tiny").module
    t0 = time.perf_counter()
    if mode == "ours":
        res = encode_audio_file(path, model, AudioPlan(chunk_s=chunk_s, parallel_above_s=0), workers=workers)
        emb, seconds = res.embedding, {"decode_wait": res.seconds["wait_decode"], "encode": res.seconds["encode"]}
    else:
        from mimo_epd.bench.peers.hf_audio import run

        emb, seconds = run(path, model)
    total = time.perf_counter() - t0
    torch.save(emb, out + ".pt")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rep = {"seconds": round(total, 3), "shares": {k: round(v / total, 3) for k, v in seconds.items()}}
    rep["peak_rss_mb"] = round(peak / 1024, 1)
    Path(out).write_text(json.dumps(rep))


def _run_child(mode: str, path: str, workers: int, tmp: str, chunk_s: float) -> tuple[dict, object]:
    import torch

    out = os.path.join(tmp, mode + ".json")
    code = f"from mimo_epd.bench.audio import _child; _child({mode!r}, {path!r}, {workers}, {out!r}, {chunk_s})"
    subprocess.run([sys.executable, "-c", code], check=True)
    return json.loads(Path(out).read_text()), torch.load(out + ".pt")


def hour(args, cache: Path) -> dict:
    import tempfile

    path = args.file or str(cache / f"test-audio-{round(args.minutes * 60)}s.flac")
    if not Path(path).exists():
        make_test_audio(path, args.minutes * 60)
    workers = args.workers or os.cpu_count() or 2
    with tempfile.TemporaryDirectory() as tmp:
        ours, a = _run_child("ours", path, workers, tmp, args.chunk_seconds)
        theirs, b = _run_child("transformers", path, workers, tmp, args.chunk_seconds)
    rel = float((a - b).norm() / b.norm()) if a.shape == b.shape else float("inf")
    return {
        "file": path,
        "minutes": args.minutes,
        "workers": workers,
        "tokens": int(a.shape[0]),
        "ours": ours,
        "transformers": theirs,
        "rel_l2": rel,
        "outputs_match": a.shape == b.shape and rel < MATCH_REL_L2,
    }


def _clips(n: int, cache: Path) -> list[bytes]:
    out = []
    for i in range(n):
        p = cache / f"clip-{i}.wav"
        if not p.exists():
            make_test_audio(str(p), 2.0 + (i * 37 % 9), seed=1000 + i)
        out.append(p.read_bytes())
    return out


def clips_ours(clips: list[bytes], concurrency: int) -> dict:
    import grpc

    from mimo_epd.testing.servers import start_server
    from mimo_epd.v1 import encoder_pb2 as pb
    from mimo_epd.v1 import encoder_pb2_grpc

    srv = start_server(["--decode-workers", "2", "--cache-bytes", "0"])
    try:

        async def go():
            async with grpc.aio.insecure_channel(srv.address) as ch:
                stub = encoder_pb2_grpc.EncoderStub(ch)

                async def send(i):
                    await stub.Encode(pb.EncodeRequest(items=[pb.MediaItem(data=clips[i], modality=pb.AUDIO)]))

                await send(0)  # warm-up
                return await closed_loop(send, len(clips), concurrency)

        lat, wall, failures = asyncio.run(go())
    finally:
        srv.stop()
    return {**latency_stats(lat, wall), "failures": failures}


def clips_peer(clips: list[bytes], concurrency: int) -> dict:
    """A transformers user's server: requests on a thread pool of `concurrency`, each decoded with PyAV,
    featurised with `WhisperFeatureExtractor` and encoded by `Qwen2AudioEncoder` (one model, shared)."""
    import concurrent.futures
    import tempfile

    from encoder_server.models.audio_loader import load_audio_model
    from mimo_epd.bench.peers import hf_audio

    ours = load_audio_model("tiny").module
    enc, proj = hf_audio.hf_modules(ours)
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=ours.config.num_mel_bins)

    def one(data: bytes) -> None:
        with tempfile.NamedTemporaryFile(suffix=".wav") as f:
            f.write(data)
            f.flush()
            samples = hf_audio.load_pyav(f.name)
        b = fe(samples, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
        hf_audio.encode_windows(enc, proj, b["input_features"], b["attention_mask"].sum(-1))

    pool = concurrent.futures.ThreadPoolExecutor(concurrency)

    async def go():
        loop = asyncio.get_running_loop()

        async def send(i):
            await loop.run_in_executor(pool, one, clips[i])

        await send(0)
        return await closed_loop(send, len(clips), concurrency)

    try:
        lat, wall, failures = asyncio.run(go())
    finally:
        pool.shutdown()
    return {**latency_stats(lat, wall), "failures": failures}


def main(args) -> dict:
    cache = Path(args.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.minutes, args.clips = 2.0, 16
    h = hour(args, cache)
    clips = _clips(args.clips, cache)
    ours, peer = clips_ours(clips, args.concurrency), clips_peer(clips, args.concurrency)
    return {
        "bench": "audio",
        "bounded": args.quick or args.minutes < 60,
        "hour": h,
        "clips": {"n": len(clips), "concurrency": args.concurrency, "ours": ours, "peer": peer},
        "outputs_match": h["outputs_match"],
        "ratios": {
            "hour_vs_transformers": round(h["transformers"]["seconds"] / h["ours"]["seconds"], 3),
            "clips_qps_vs_peer": round(ours["qps"] / peer["qps"], 3) if peer["qps"] else None,
        },
    }


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=60.0, help="length of the long test file (default: 60)")
    p.add_argument("--file", default="", help="use this audio file instead of the generated one")
    p.add_argument("--workers", type=int, default=0, help="our range decoders, 0 = one per core (default: 0)")
    p.add_argument("--chunk-seconds", type=float, default=300.0, help="our decoded range length (default: 300)")
    p.add_argument("--clips", type=int, default=64, help="short clips sent under load (default: 64)")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending clips at once (default: 8)")
    p.add_argument("--cache-dir", default="~/.cache/mimo-epd/bench-audio", help="where test files are kept")
    p.add_argument("--quick", action="store_true", help="bounded run: a 2-minute file and 16 clips")
