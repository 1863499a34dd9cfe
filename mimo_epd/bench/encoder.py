"""`mimo-epd bench encoder`: encoder QPS and latency, naive vs pipelined vs a transformers baseline.

Setup: a local HTTP media server with generated photo-like JPEGs of the `--mix` sizes; every request
asks for one image by URL with a fresh token, so bytes (and content keys) never repeat: no cache hit,
no in-flight de-duplication, the full cost every time. Servers run with `--cache-bytes 0`.

Modes, each against the same closed-loop load (`--concurrency` clients, `--requests` requests, after
a warm-up) on a fresh server process:
- `naive`: the same server with every switch off (`--no-pipeline --no-batching --decode-workers 0
  --no-jpeg-draft --resize-in device --decoder pil`): one request at a time through fetch -> decode ->
  preprocess -> forward; `naive_turbo` (tiny only) is the same with the default `turbo` JPEG decoder, so the
  decoder's share of the gain can be told apart from the pipeline's;
- `pipelined`: the defaults (overlapped stages, cross-request batching, decode processes with shm
  handoff, libjpeg-turbo decode, JPEG draft decode, resize in the decoders);
- `transformers`: what a user would write: per request, download, PIL decode, `Qwen2VLImageProcessor`,
  transformers' vision model with the same weights, in this process, one request at a time.
Stage busy fractions come from the server's Prometheus counters: busy seconds / (wall x workers).

Both encoder sizes run: `tiny` (forward cheap next to decode, like a GPU deployment) and `large`
(a random config whose forward dominates on this CPU).
"""
from __future__ import annotations

import asyncio
import io
import os
import socket
import tempfile
import time
import urllib.request
import uuid

import grpc
import torch

from encoder_server.models import TINY_VISION_CONFIG, VisionConfig, random_model, save_checkpoint
from mimo_epd.bench.common import closed_loop, latency_stats, scrape, start_server
from mimo_epd.testing.media_server import MediaServer, generate_pool
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

LARGE_VISION_CONFIG = VisionConfig(depth=6, hidden_size=192, intermediate_size=384, num_heads=3, patch_size=14,
                                   window_size=112, out_hidden_size=256, fullatt_block_indexes=[5])
NAIVE_FLAGS = ["--no-pipeline", "--no-batching", "--decode-workers", "0", "--no-jpeg-draft", "--resize-in", "device",
               "--resize-backend", "torch", "--decoder", "pil"]
PIPELINED_FLAGS: list[str] = []
STAGES = ("fetch", "decode", "preprocess", "encode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_mix(spec: str) -> list[tuple[int, int, int]]:
    """'640x480:1,1920x1080:1' -> [(h, w, weight)]."""
    out = []
    for part in spec.split(","):
        size, _, weight = part.partition(":")
        w, h = (int(v) for v in size.lower().split("x"))
        out.append((h, w, int(weight or 1)))
    return out


def request_names(mix, per_size: int, n: int) -> list[str]:
    seq = [f"{w}x{h}-{i}.jpg" for h, w, weight in mix for _ in range(weight) for i in range(per_size)]
    # interleave sizes deterministically
    seq = sorted(seq, key=lambda s: (int(s.rsplit("-", 1)[1].split(".")[0]), s))
    return [seq[i % len(seq)] for i in range(n)]


async def _run_load(address: str, media: MediaServer, names: list[str], concurrency: int) -> tuple[list, float, int]:
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        stub = encoder_pb2_grpc.EncoderStub(ch)

        async def send(i: int):
            item = encoder_pb2.MediaItem(url=media.url(names[i], uuid.uuid4().hex), modality=encoder_pb2.IMAGE)
            await stub.Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=600)

        return await closed_loop(send, len(names), concurrency)


def run_server_mode(model_arg: str, flags: list[str], media: MediaServer, names: list[str], warmup: list[str],
                    concurrency: int) -> dict:
    port = _free_port()
    server = start_server(["--model", model_arg, "--url-allowlist", "127.0.0.1/32", "--cache-bytes", "0",
                           "--metrics-port", str(port), "--max-pending", "100000", *flags])
    try:
        asyncio.run(_run_load(server.address, media, warmup, concurrency))
        before, t0 = scrape(port), time.perf_counter()
        lat, wall, failures = asyncio.run(_run_load(server.address, media, names, concurrency))
        after, t1 = scrape(port), time.perf_counter()
    finally:
        server.stop()
    stats = latency_stats(lat, wall)
    stats["failures"] = failures
    busy = {}
    for st in STAGES:
        key = f'encoder_stage_busy_seconds_total{{stage="{st}"}}'
        workers = after.get(f'encoder_stage_workers{{stage="{st}"}}', 1.0)
        busy[st] = round((after.get(key, 0.0) - before.get(key, 0.0)) / ((t1 - t0) * workers), 3)
    stats["stage_busy"] = busy
    compute = {k: v for k, v in busy.items() if k != "fetch"}
    stats["bottleneck_stage"] = max(compute, key=compute.get)
    stats["bottleneck_busy"] = compute[stats["bottleneck_stage"]]
    batches = after.get("encoder_batch_items_count", 0) - before.get("encoder_batch_items_count", 0)
    items = after.get("encoder_batch_items_sum", 0) - before.get("encoder_batch_items_sum", 0)
    stats["avg_batch_items"] = round(items / batches, 2) if batches else 0.0
    stage_ms = {}
    for st in ("fetch", "decode", "preprocess", "queue", "encode"):
        c = after.get(f'encoder_stage_seconds_count{{stage="{st}"}}', 0) - before.get(f'encoder_stage_seconds_count{{stage="{st}"}}', 0)
        s = after.get(f'encoder_stage_seconds_sum{{stage="{st}"}}', 0) - before.get(f'encoder_stage_seconds_sum{{stage="{st}"}}', 0)
        stage_ms[st] = round(s / c * 1e3, 2) if c else 0.0
    stats["avg_stage_ms"] = stage_ms
    return stats


def run_transformers(ckpt_dir: str, media: MediaServer, names: list[str], warmup: list[str]) -> dict:
    """The baseline a user would write with transformers, one request at a time, in-process."""
    from PIL import Image, ImageOps
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor()
    model = Qwen2_5_VisionTransformerPretrainedModel.from_pretrained(ckpt_dir, torch_dtype=torch.float32).eval()

    def one(name: str) -> None:
        data = urllib.request.urlopen(media.url(name, uuid.uuid4().hex), timeout=60).read()
        img = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        inputs = processor(images=[img], return_tensors="pt")
        with torch.no_grad():
            model(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])

    for name in warmup:
        one(name)
    lat = []
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        one(name)
        lat.append(time.perf_counter() - t0)
    return latency_stats(lat, time.perf_counter() - start)


def ratios(modes: dict) -> dict:
    n, p, t = modes["naive"], modes["pipelined"], modes.get("transformers")
    out = {"qps_vs_naive": round(p["qps"] / n["qps"], 3), "p90_vs_naive": round(p["p90_ms"] / n["p90_ms"], 3),
           "avg_vs_naive": round(p["avg_ms"] / n["avg_ms"], 3)}
    if t:
        out["qps_vs_transformers"] = round(p["qps"] / t["qps"], 3)
    return out


def run_size(size: str, media: MediaServer, mix, args, workdir: str) -> dict:
    cfg = TINY_VISION_CONFIG if size == "tiny" else LARGE_VISION_CONFIG
    ckpt = os.path.join(workdir, size)
    save_checkpoint(random_model(cfg, seed=0), ckpt)
    model_arg = "tiny" if size == "tiny" else ckpt
    n = args.requests if size == "tiny" else max(8, args.requests // 4)
    names = request_names(mix, args.per_size, n)
    warmup = request_names(mix, args.per_size, max(4, 2 * len(mix)))
    modes = {
        "naive": run_server_mode(model_arg, NAIVE_FLAGS, media, names, warmup, args.concurrency),
        "pipelined": run_server_mode(model_arg, PIPELINED_FLAGS, media, names, warmup, args.concurrency),
    }
    tf_names = names[: max(len(mix), min(len(names), args.transformers_requests))]
    modes["transformers"] = run_transformers(ckpt, media, tf_names, warmup[: len(mix)])
    result = {"requests": n, "modes": modes, "ratios": ratios(modes)}
    if size == "tiny":
        nt = run_server_mode(model_arg, [f for f in NAIVE_FLAGS if f not in ("--decoder", "pil")], media, names,
                             warmup, args.concurrency)
        result["naive_turbo"] = {k: nt[k] for k in ("qps", "avg_ms", "p90_ms", "avg_stage_ms")}
        result["ratios"]["qps_vs_naive_turbo"] = round(modes["pipelined"]["qps"] / nt["qps"], 3)
    if size == "tiny" and args.decoders:
        decoders = {}
        for dec in ("turbo", "pil", "torchvision", "dali"):
            if dec == "dali":
                try:
                    import nvidia.dali  # noqa: F401
                except ImportError:
                    decoders[dec] = "not installed"
                    continue
            flags = ["--decoder", dec]
            if dec not in ("turbo", "pil"):
                flags += ["--no-jpeg-draft"]  # draft decode is a libjpeg-turbo/PIL feature here
            r = run_server_mode(model_arg, flags, media, names[: max(8, n // 2)], warmup, args.concurrency)
            decoders[dec] = {k: r[k] for k in ("qps", "avg_ms", "p90_ms", "avg_stage_ms")}
        decoders["pil_no_draft"] = {k: v for k, v in run_server_mode(
            model_arg, ["--decoder", "pil", "--no-jpeg-draft"], media, names[: max(8, n // 2)], warmup, args.concurrency).items()
            if k in ("qps", "avg_ms", "p90_ms", "avg_stage_ms")}
        result["decoders"] = decoders
    return result


def main(args) -> dict:
    if args.quick:
        args.requests, args.concurrency, args.per_size, args.transformers_requests = 12, 4, 1, 4
        args.mix = args.mix if args.mix != DEFAULT_MIX else "320x240:1,1280x720:1"
        args.decoders = False
    mix = parse_mix(args.mix)
    t0 = time.perf_counter()
    images = generate_pool([(h, w) for h, w, _ in mix], args.per_size)
    from encoder_server.preprocess import pillow_simd_active

    out: dict = {"bench": "encoder", "config": {
        "requests": args.requests, "concurrency": args.concurrency, "mix": args.mix, "images_per_size": args.per_size,
        "cpu_cores": os.cpu_count(), "pil": "pillow-simd" if pillow_simd_active() else "pillow",
        "naive_flags": " ".join(NAIVE_FLAGS), "pipelined_flags": " ".join(PIPELINED_FLAGS) or "(defaults)",
        "load": "closed loop, one image per request by URL, unique bytes per request, cache off"}}
    with tempfile.TemporaryDirectory() as workdir, MediaServer(images) as media:
        tiny = run_size("tiny", media, mix, args, workdir)
        out.update(modes=tiny["modes"], ratios=tiny["ratios"], naive_turbo=tiny["naive_turbo"])
        if "decoders" in tiny:
            out["decoders"] = tiny["decoders"]
        if args.model_size in ("both", "large"):
            large = run_size("large", media, mix, args, workdir)
            out["large"] = {"requests": large["requests"], "modes": large["modes"], "ratios": large["ratios"]}
    r = out["ratios"]
    out["goals"] = {"qps_vs_naive>=2.5": r["qps_vs_naive"] >= 2.5, "p90_vs_naive<=0.8": r["p90_vs_naive"] <= 0.8,
                    "avg_vs_naive<=1.0": r["avg_vs_naive"] <= 1.0,
                    "qps_vs_transformers>=3": r.get("qps_vs_transformers", 0) >= 3,
                    "bottleneck_busy>=0.85": out["modes"]["pipelined"]["bottleneck_busy"] >= 0.85}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


DEFAULT_MIX = "640x480:1,1920x1080:1,3840x2160:1"


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=240, help="measured requests per mode (large: a quarter) (default: 240)")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default: 16)")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"image sizes WxH:weight, comma-separated (default: {DEFAULT_MIX})")
    p.add_argument("--per-size", type=int, default=4, help="distinct images generated per size (default: 4)")
    p.add_argument("--transformers-requests", type=int, default=60,
                   help="requests for the (slow, sequential) transformers baseline (default: 60)")
    p.add_argument("--model-size", choices=["tiny", "large", "both"], default="both",
                   help="tiny runs always; large adds the forward-bound config (default: both)")
    p.add_argument("--decoders", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="also compare decoder backends (turbo, pil, torchvision, dali) on tiny (default: on)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI)")
