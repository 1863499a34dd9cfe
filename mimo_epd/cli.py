"""`mimo-epd` command line. Each subcommand is one function below; `main` dispatches.

    mimo-epd version                      versions of the stack, and which PIL is active
    mimo-epd encoder [flags]              one encoder server; prints `ready host:port` once serving
    mimo-epd serve [flags]                the product on this node: router + N encoders sharing a shm cache
    mimo-epd encode --server A ITEM...    encode files/URLs through a server, one JSON line per item
    mimo-epd health --server A            exit 0 only when the server reports SERVING
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from . import __version__


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_version(args) -> int:
    import platform

    import torch

    from encoder_server.preprocess import pillow_simd_active

    try:
        import PIL

        pil = f"pillow-simd {PIL.__version__}" if pillow_simd_active() else f"pillow {PIL.__version__} (pillow-simd not installed)"
    except ImportError:  # pragma: no cover
        pil = "none"
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    info = {
        "mimo-epd": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_v,
        "cuda_available": torch.cuda.is_available(),
        "pil": pil,
    }
    for k, v in info.items():
        print(f"{k}: {v}")
    return 0


def _run_encoder(args) -> int:
    import uvloop

    from encoder_server.config import EncoderServerConfig
    from encoder_server.service import serve_encoder

    try:
        config = EncoderServerConfig.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    try:
        return uvloop.run(serve_encoder(config))
    except (OSError, ValueError, FileNotFoundError) as e:
        logging.getLogger("mimo_epd").error("cannot start the encoder: %s", e)
        return 1


def cmd_encoder(args) -> int:
    return _run_encoder(args)


def cmd_serve(args) -> int:
    import uvloop

    from encoder_server.config import EncoderServerConfig
    from mimo_epd.launcher import NodeConfig, serve_node

    try:
        enc, node = EncoderServerConfig.from_args(args), NodeConfig.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(enc.log_level)
    try:
        return uvloop.run(serve_node(enc, node))
    except (OSError, RuntimeError, ValueError) as e:
        logging.getLogger("mimo_epd").error("cannot start: %s", e)
        return 1


VIDEO_SUFFIXES = {".mp4", ".mkv", ".webm", ".mov", ".avi", ".ts", ".m4v", ".flv"}


def _is_url(item: str) -> bool:
    return item.split(":", 1)[0].lower() in ("http", "https", "data")


def cmd_encode(args) -> int:
    import grpc
    import torch

    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    items = []
    for it in args.items:
        video = args.video or Path(it.split("?")[0]).suffix.lower() in VIDEO_SUFFIXES
        kw = {"modality": encoder_pb2.VIDEO if video else encoder_pb2.IMAGE}
        if video:
            kw["video"] = encoder_pb2.VideoOptions(fps=args.fps, max_frames=args.max_frames)
        if _is_url(it):
            items.append(encoder_pb2.MediaItem(url=it, **kw))
        elif args.as_path:
            items.append(encoder_pb2.MediaItem(path=str(Path(it).resolve()), **kw))
        else:
            try:
                items.append(encoder_pb2.MediaItem(data=Path(it).read_bytes(), **kw))
            except OSError as e:
                print(f"error: cannot read {it}: {e.strerror}", file=sys.stderr)
                return 2
    max_bytes = args.max_message_mb << 20
    with grpc.insecure_channel(args.server, options=[("grpc.max_receive_message_length", max_bytes),
                                                     ("grpc.max_send_message_length", max_bytes)]) as ch:
        stub = encoder_pb2_grpc.EncoderStub(ch)
        try:
            resp = stub.Encode(encoder_pb2.EncodeRequest(items=items), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    tensors = {}
    for src, r in zip(args.items, resp.items):
        emb = r.embedding
        print(json.dumps({
            "item": src, "key": r.content_key, "num_tokens": r.num_tokens,
            "dim": int(emb.shape[-1]) if emb.shape else 0, "dtype": emb.dtype, "grid_thw": list(r.grid_thw),
            "cache_hit": r.cache_hit,
            "timings_ms": {k: round(getattr(r.timings, f"{k}_ms"), 3) for k in ("fetch", "decode", "preprocess", "queue", "encode")},
            **({"video": {"duration_s": r.video.duration_s, "frames_total": r.video.frames_total,
                          "frames_sampled": r.video.frames_sampled, "temporal_groups": len(r.timestamps_s)}}
               if r.HasField("video") else {}),
        }))
        if args.out:
            dtype = getattr(torch, emb.dtype)
            raw = torch.frombuffer(bytearray(emb.data), dtype=torch.uint8) if emb.data else torch.empty(0, dtype=torch.uint8)
            tensors[r.content_key] = raw.view(dtype).reshape(list(emb.shape)).clone()
    if args.out:
        from safetensors.torch import save_file

        save_file(tensors, args.out, metadata={"model": resp.model, "items": json.dumps(args.items)})
        print(f"saved {len(tensors)} embeddings to {args.out}", file=sys.stderr)
    return 0


def _sampling_from_args(args):
    from encoder_server.video.sampling import VideoSampling

    return VideoSampling(fps=args.fps, max_frames=args.max_frames, min_frames=args.min_frames,
                         min_pixels=args.video_min_pixels, max_pixels=args.video_max_pixels,
                         total_pixels=args.video_total_pixels)


def cmd_encode_video(args) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from encoder_server.models import load_vision_model
    from encoder_server.preprocess import PreprocessConfig
    from encoder_server.video.decode import VideoError
    from encoder_server.video.encode import encode_video

    setup_logging("warning")
    try:
        sampling = _sampling_from_args(args)
        sampling.validate()
        info = load_vision_model(args.model, args.device, args.dtype, return_info=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not Path(args.video).is_file():
        print(f"error: no such file: {args.video}", file=sys.stderr)
        return 2
    tower = info.module.config
    pre = PreprocessConfig.from_hf_dict(info.preprocessor_config) if info.preprocessor_config else \
        PreprocessConfig.preset("mimo_v2_5" if tower.patch_size == 16 else "qwen2_5_vl")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=None, transient=False, disable=args.no_progress) as bar:
        dec = bar.add_task("decoded", total=None, rate="")
        enc = bar.add_task("encoded", total=None, rate="")
        start = __import__("time").perf_counter()

        def progress(decoded: int, encoded: int, total: int) -> None:
            el = max(__import__("time").perf_counter() - start, 1e-6)
            bar.update(dec, completed=decoded, total=total, rate=f"{decoded / el:6.1f} frames/s")
            bar.update(enc, completed=encoded, total=total, rate=f"{encoded / el:6.1f} frames/s")

        try:
            result = encode_video(args.video, info.module, pre, sampling, workers=args.workers, mode=args.decode_mode,
                                  max_batch_tokens=args.max_batch_tokens, progress=progress, device=args.device)
        except VideoError as e:
            print(f"error: {args.video}: {e}", file=sys.stderr)
            return 1
        progress(result.frames_sampled, result.frames_sampled, result.frames_sampled)
    summary = {"video": args.video, "model": info.model_id, "sampling": {"fps": sampling.fps, "min_frames": sampling.min_frames,
               "max_frames": sampling.max_frames}, **result.summary()}
    if args.out:
        from safetensors.torch import save_file

        save_file({"embedding": result.embedding.contiguous(), "grid_thw": torch.tensor(result.grid_thw),
                   "timestamps_s": torch.tensor(result.timestamps_s, dtype=torch.float64)}, args.out,
                  metadata={"summary": json.dumps(summary)})
        summary["out"] = args.out
    print(json.dumps(summary))
    return 0


def cmd_make_test_video(args) -> int:
    from mimo_epd.testing.video_gen import make_test_video

    seconds = args.seconds if args.seconds else args.minutes * 60
    try:
        info = make_test_video(args.out, seconds, width=args.width, height=args.height, fps=args.fps, gop=args.gop,
                               preset=args.preset, progress=lambda i, n: print(f"\r{i}/{n} frames", end="", file=sys.stderr))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(file=sys.stderr)
    print(json.dumps(info))
    return 0


def add_sampling_arguments(p) -> None:
    from encoder_server.video.sampling import VideoSampling

    d = VideoSampling()
    p.add_argument("--fps", type=float, default=d.fps, help=f"frames sampled per second of video (default: {d.fps})")
    p.add_argument("--max-frames", type=int, default=d.max_frames, help=f"most frames sampled (default: {d.max_frames})")
    p.add_argument("--min-frames", type=int, default=d.min_frames, help=f"fewest frames sampled (default: {d.min_frames})")
    p.add_argument("--video-min-pixels", type=int, default=d.min_pixels, help=f"min pixels per frame (default: {d.min_pixels})")
    p.add_argument("--video-max-pixels", type=int, default=d.max_pixels, help=f"max pixels per frame (default: {d.max_pixels})")
    p.add_argument("--video-total-pixels", type=int, default=d.total_pixels,
                   help=f"pixel budget of all sampled frames together (default: {d.total_pixels})")


def cmd_llm(args) -> int:
    import torch
    import uvloop

    from llm_backend import LLM
    from llm_backend.service import serve_llm

    setup_logging(args.log_level)
    try:
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.startswith("cuda") else "float32")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {args.dtype!r}")
        engine = LLM(args.model, device=args.device, dtype=getattr(torch, dtype), kv_cache_tokens=args.kv_cache_tokens,
                     swa_cache_tokens=args.swa_cache_tokens, page_size=args.page_size, chunk_size=args.chunk_size,
                     enable_prefix_cache=args.prefix_cache, release_interval=args.release_interval,
                     max_running=args.max_running, fcfs=args.fcfs, wait_penalty_tokens_per_s=args.wait_penalty,
                     length_buckets=tuple(int(x) for x in args.length_buckets.split(",") if x.strip()))
        return uvloop.run(serve_llm(engine, args.host, args.port, args.encoder or None))
    except (OSError, ValueError) as e:
        logging.getLogger("mimo_epd").error("cannot start the LLM worker: %s", e)
        return 1


def cmd_generate(args) -> int:
    import grpc

    from mimo_epd.v1 import encoder_pb2, generator_pb2, generator_pb2_grpc

    media = []
    for path in args.image:
        try:
            media.append(encoder_pb2.MediaItem(data=Path(path).read_bytes(), modality=encoder_pb2.IMAGE))
        except OSError as e:
            print(f"error: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 2
    req = generator_pb2.GenerateRequest(prompt=args.prompt, media=media, sampling=generator_pb2.SamplingOptions(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, has_seed=args.seed is not None))
    with grpc.insecure_channel(args.server) as ch:
        try:
            for msg in generator_pb2_grpc.GeneratorStub(ch).Generate(req, timeout=args.timeout):
                if msg.HasField("delta"):
                    sys.stdout.write(msg.delta.text)
                    sys.stdout.flush()
                else:
                    f = msg.final
                    print()
                    print(json.dumps({"prompt_tokens": f.prompt_tokens, "media_tokens": f.media_tokens,
                                      "cached_tokens": f.cached_tokens, "completion_tokens": f.completion_tokens,
                                      "ttft_ms": round(f.ttft_ms, 2), "finish_reason": f.finish_reason}), file=sys.stderr)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def cmd_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.server) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                         timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.server}: {e.code().name}: {e.details()}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.server}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    from encoder_server.config import EncoderServerConfig
    from mimo_epd.launcher import NodeConfig

    p = argparse.ArgumentParser(prog="mimo-epd", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("version", help="print versions and which PIL build is active").set_defaults(fn=cmd_version)

    enc = sub.add_parser("encoder", help="run one encoder server")
    EncoderServerConfig.add_arguments(enc)
    enc.set_defaults(fn=cmd_encoder)

    serve = sub.add_parser("serve", help="the product on this node: N encoders sharing a shm cache behind a router")
    EncoderServerConfig.add_arguments(serve)
    NodeConfig.add_arguments(serve)
    serve.set_defaults(fn=cmd_serve)

    e = sub.add_parser("encode", help="encode image files or URLs through a running server")
    e.add_argument("items", nargs="+", metavar="ITEM", help="file path, http(s):// URL or data: URI")
    e.add_argument("--server", default="127.0.0.1:50051", help="encoder address (default: 127.0.0.1:50051)")
    e.add_argument("--out", default="", help="save the embeddings to this .safetensors file, keyed by content key")
    e.add_argument("--as-path", action="store_true",
                   help="send file items as server-side paths instead of their bytes (needs --allowed-local-dir there)")
    e.add_argument("--video", action="store_true",
                   help=f"send every item as a VIDEO (default: by extension: {' '.join(sorted(VIDEO_SUFFIXES))})")
    e.add_argument("--fps", type=float, default=0.0, help="videos: frames sampled per second (0 = server default)")
    e.add_argument("--max-frames", type=int, default=0, help="videos: most frames sampled (0 = server default)")
    e.add_argument("--timeout", type=float, default=600.0, help="RPC deadline in seconds (default: 600)")
    e.add_argument("--max-message-mb", type=int, default=256, help="largest reply accepted, MiB (default: 256)")
    e.set_defaults(fn=cmd_encode)

    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from mimo_epd.bench import cache_routing, encoder as encoder_bench, engine as engine_bench, kv_capacity, prefix_cache, \
        video as video_bench

    for name, module, help_text in (
        ("cache-routing", cache_routing, "cache hit rates: round-robin vs consistent hashing, private vs shared cache"),
        ("video", video_bench, "a long video: naive vs parallel vs the decode floor, and worker scaling"),
        ("encoder", encoder_bench, "encoder QPS/latency: naive vs pipelined vs transformers, tiny and large"),
        ("kv", kv_capacity, "KV capacity: concurrent sequences in a byte budget, hybrid dual pool vs full-only"),
        ("prefix-cache", prefix_cache, "prefix-cache hit tokens on a real trace: SWA-aware vs full-KV vs unbounded"),
        ("engine", engine_bench, "LLM engine output tokens/s and TTFT vs transformers generate (tiny, CPU)"),
    ):
        b = bsub.add_parser(name, help=help_text)
        module.add_arguments(b)
        b.set_defaults(fn=lambda args, main=module.main: print(json.dumps(main(args))) or 0)  # one JSON object

    ev = sub.add_parser("encode-video", help="encode a video file in-process, with a progress bar and a JSON summary")
    ev.add_argument("video", help="video file (any container/codec FFmpeg reads)")
    add_sampling_arguments(ev)
    ev.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory (default: tiny)")
    ev.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    ev.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    ev.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="parallel decoders (default: all cores)")
    ev.add_argument("--decode-mode", choices=["process", "thread"], default="process",
                    help="decoders as processes or threads (default: process)")
    ev.add_argument("--max-batch-tokens", type=int, default=16384, help="patches per forward (default: 16384)")
    ev.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = default) (default: 0)")
    ev.add_argument("--out", default="", help="save embedding, grid_thw and timestamps to this .safetensors file")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(fn=cmd_encode_video)

    mv = sub.add_parser("make-test-video", help="write a realistic H.264 test video with PyAV")
    mv.add_argument("--minutes", type=float, default=2.0, help="length in minutes (default: 2)")
    mv.add_argument("--seconds", type=float, default=0.0, help="length in seconds; overrides --minutes (default: 0)")
    mv.add_argument("--out", required=True, help="output file (.mp4)")
    mv.add_argument("--width", type=int, default=640, help="width (default: 640)")
    mv.add_argument("--height", type=int, default=360, help="height (default: 360)")
    mv.add_argument("--fps", type=int, default=30, help="frame rate (default: 30)")
    mv.add_argument("--gop", type=int, default=250, help="keyframe interval in frames (default: 250)")
    mv.add_argument("--preset", default="veryfast", help="x264 preset (default: veryfast)")
    mv.set_defaults(fn=cmd_make_test_video)

    llm = sub.add_parser("llm", help="run an LLM worker (Generator/Generate, streaming)")
    llm.add_argument("--model", default="tiny", help="'tiny' or a mimo_v2_flash checkpoint directory (default: tiny)")
    llm.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    llm.add_argument("--port", type=int, default=50061, help="gRPC port, 0 = any (default: 50061)")
    llm.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    llm.add_argument("--dtype", default="auto",
                     help="weights, activations and KV: float32, bfloat16, float16 or auto (bfloat16 on CUDA, else "
                          "float32) (default: auto)")
    llm.add_argument("--encoder", default="", help="encoder (or router) address for media items (default: none)")
    llm.add_argument("--kv-cache-tokens", type=int, default=16384, help="full-attention KV pool, tokens (default: 16384)")
    llm.add_argument("--swa-cache-tokens", type=int, default=4096, help="sliding-window KV pool, tokens (default: 4096)")
    llm.add_argument("--page-size", type=int, default=1, help="prefix-cache match granularity (default: 1)")
    llm.add_argument("--chunk-size", type=int, default=512, help="prefill chunk, tokens (default: 512)")
    llm.add_argument("--release-interval", type=int, default=16, help="decode steps between SWA releases (default: 16)")
    llm.add_argument("--max-running", type=int, default=16, help="requests running at once (default: 16)")
    llm.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                     help="SWA-aware radix prefix cache (default: on)")
    llm.add_argument("--fcfs", action="store_true", help="first come first served instead of fewest uncached tokens first")
    llm.add_argument("--wait-penalty", type=float, default=2048.0,
                     help="uncached tokens forgiven per second of waiting, so nothing starves (default: 2048)")
    llm.add_argument("--length-buckets", default="65536,262144",
                     help="prompt-length bucket bounds; buckets take turns at admission (default: 65536,262144)")
    llm.add_argument("--log-level", default="info", help="debug, info, warning or error (default: info)")
    llm.set_defaults(fn=cmd_llm)

    g = sub.add_parser("generate", help="stream a generation from an LLM worker")
    g.add_argument("--server", default="127.0.0.1:50061", help="LLM worker address (default: 127.0.0.1:50061)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--image", action="append", default=[], help="an image file (repeatable); needs a worker with --encoder")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (default: 0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    g.add_argument("--timeout", type=float, default=600.0, help="RPC deadline in seconds (default: 600)")
    g.set_defaults(fn=cmd_generate)

    lt = sub.add_parser("loadtest", help="headless Locust load tests of the gRPC API")
    ltsub = lt.add_subparsers(dest="loadtest", required=True)
    from loadtest import run as loadtest_run

    b = ltsub.add_parser("encoder", help="Locust against an encoder: QPS, P50/P90/P99, failures (JSON)")
    loadtest_run.add_arguments(b)
    b.set_defaults(fn=loadtest_run.run)

    h = sub.add_parser("health", help="exit 0 only when the server reports SERVING")
    h.add_argument("--server", default="127.0.0.1:50051", help="server address (default: 127.0.0.1:50051)")
    h.add_argument("--service", default="", help="service name to check (default: '' = the whole server)")
    h.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds (default: 5)")
    h.set_defaults(fn=cmd_health)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
