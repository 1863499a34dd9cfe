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


def _is_url(item: str) -> bool:
    return item.split(":", 1)[0].lower() in ("http", "https", "data")


def cmd_encode(args) -> int:
    import grpc
    import torch

    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    items = []
    for it in args.items:
        if _is_url(it):
            items.append(encoder_pb2.MediaItem(url=it, modality=encoder_pb2.IMAGE))
        elif args.as_path:
            items.append(encoder_pb2.MediaItem(path=str(Path(it).resolve()), modality=encoder_pb2.IMAGE))
        else:
            try:
                items.append(encoder_pb2.MediaItem(data=Path(it).read_bytes(), modality=encoder_pb2.IMAGE))
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
    e.add_argument("--timeout", type=float, default=120.0, help="RPC deadline in seconds (default: 120)")
    e.add_argument("--max-message-mb", type=int, default=256, help="largest reply accepted, MiB (default: 256)")
    e.set_defaults(fn=cmd_encode)

    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from mimo_epd.bench import cache_routing, encoder as encoder_bench

    b = bsub.add_parser("cache-routing", help="cache hit rates: round-robin vs consistent hashing, private vs shared cache")
    cache_routing.add_arguments(b)
    b.set_defaults(fn=cache_routing.run)
    b = bsub.add_parser("encoder", help="encoder QPS/latency: naive vs pipelined vs transformers, tiny and large")
    encoder_bench.add_arguments(b)
    b.set_defaults(fn=encoder_bench.run)

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
