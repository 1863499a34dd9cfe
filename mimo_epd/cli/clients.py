"""Client commands against a running server: `health`, `encode`, `generate`.

They import grpc and the generated stubs only (no torch), so each call costs well under a second.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from .common import error

DEFAULT_SERVER = "127.0.0.1:50051"  # where `make serve` / `mimo-epd serve` listens
VIDEO_SUFFIXES = {".mp4", ".mkv", ".webm", ".mov", ".avi", ".ts", ".m4v", ".flv"}
URL_SCHEMES = ("http", "https")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NOT_RUNNING = f"is the server running? (`make serve` starts one on {DEFAULT_SERVER})"


class ItemError(ValueError):
    pass


def item_name(item: str) -> str:
    """How an item is shown in output: a `data:` URI as `data:<mime>;<N> bytes`, anything else as given."""
    if not item.startswith("data:"):
        return item
    head, _, payload = item[5:].partition(",")
    mime = head.split(";")[0] or "text/plain"
    if head.endswith(";base64"):
        payload = re.sub(r"\s", "", payload)
        n = len(payload) * 3 // 4 - payload[-2:].count("=")
    else:
        from urllib.parse import unquote_to_bytes

        n = len(unquote_to_bytes(payload))
    return f"data:{mime};{n} bytes"


def media_item(item: str, video: bool, as_path: bool = False, fps: float = 0.0, max_frames: int = 0):
    """A MediaItem for a command-line item: http(s):// URLs and data: URIs are sent as URLs, anything else
    with a `scheme://` is refused, and a local file is sent as its bytes (or its path with `as_path`)."""
    from mimo_epd.v1 import encoder_pb2

    video = video or Path(item.split("?")[0]).suffix.lower() in VIDEO_SUFFIXES
    kw = {"modality": encoder_pb2.VIDEO if video else encoder_pb2.IMAGE}
    if video:
        kw["video"] = encoder_pb2.VideoOptions(fps=fps, max_frames=max_frames)
    m = _SCHEME.match(item)
    if m and m.group(1).lower() in URL_SCHEMES or item.startswith("data:"):
        return encoder_pb2.MediaItem(url=item, **kw)
    if m:
        raise ItemError(f"{item}: unsupported scheme {m.group(1)}:// (items are files, http(s):// URLs or data: URIs)")
    if as_path:
        return encoder_pb2.MediaItem(path=str(Path(item).resolve()), **kw)
    try:
        return encoder_pb2.MediaItem(data=Path(item).read_bytes(), **kw)
    except OSError as e:
        raise ItemError(f"cannot read {item}: {e.strerror}") from None


def rpc_error(e, server: str, names: list[str] | None = None) -> int:
    """Prints a failed call's status on stderr; `item N:` in the message gets the item's name appended."""
    import grpc

    details = e.details() or ""
    if names:
        details = re.sub(
            r"^item (\d+):",
            lambda m: f"item {m.group(1)} ({names[int(m.group(1))]}):" if int(m.group(1)) < len(names) else m.group(0),
            details,
        )
    hint = ""
    if e.code() == grpc.StatusCode.UNAVAILABLE and "connect" in details.lower():
        hint = f"; {_NOT_RUNNING}"
    elif e.code() == grpc.StatusCode.UNIMPLEMENTED:
        hint = " (this server does not serve that API: an encoder has no Generate, nor has `serve --no-llm`)"
    print(f"error: {server}: {e.code().name}: {details}{hint}", file=sys.stderr)
    return 1


def _channel(server: str, max_message_mb: int = 256):
    import grpc

    limit = max_message_mb << 20
    return grpc.insecure_channel(
        server, options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )


# ---------------------------------------------------------------------------------------------- health
def _services(channel, timeout: float) -> list[str]:
    """Service names the server lists through reflection (empty when it has no reflection)."""
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        for resp in stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=timeout
        ):
            return [
                s.name
                for s in resp.list_services_response.service
                if not s.name.startswith(("grpc.health.", "grpc.reflection."))
            ]
    except grpc.RpcError:
        pass
    return []


def run_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(args.server) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                known = _services(ch, args.timeout)
                listed = ", ".join(repr(s) for s in ["", *known]) if known else "'' (the whole server)"
                return error(f"{args.server}: unknown service {args.service!r}; this server checks: {listed}", 1)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return error(f"{args.server}: no answer within {args.timeout:g}s; {_NOT_RUNNING}", 1)
            return rpc_error(e, args.server)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.server}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def add_health_flags(h) -> None:
    h.add_argument("--server", default=DEFAULT_SERVER, help=f"server address (default: {DEFAULT_SERVER})")
    h.add_argument("--service", default="", help="service name to check (default: '' = the whole server)")
    h.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds (default: 5)")


# ---------------------------------------------------------------------------------------------- encode
def save_embeddings(path: str, model: str, names: list[str], responses) -> int:
    """Writes a .safetensors file: one tensor per distinct content key, and in the metadata `items`, the
    JSON list of {"item", "key", "num_tokens", "grid_thw"} in request order (which key belongs to which item)."""
    import numpy as np
    from safetensors import TensorSpec, serialize_file

    specs, keep_alive, items = {}, [], []
    for name, r in zip(names, responses):
        emb = r.embedding
        items.append({"item": name, "key": r.content_key, "num_tokens": r.num_tokens, "grid_thw": list(r.grid_thw)})
        if r.content_key in specs:
            continue
        buf = np.frombuffer(emb.data, dtype=np.uint8) if emb.data else np.zeros(0, np.uint8)
        keep_alive.append(buf)  # the spec holds a raw pointer into it
        specs[r.content_key] = TensorSpec(
            dtype=emb.dtype, shape=list(emb.shape), data_ptr=buf.ctypes.data, data_len=buf.nbytes
        )
    serialize_file(specs, path, metadata={"model": model, "items": json.dumps(items)})
    return len(specs)


def run_encode(args) -> int:
    import grpc

    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    names = [item_name(it) for it in args.items]
    try:
        items = [media_item(it, args.video, args.as_path, args.fps, args.max_frames) for it in args.items]
    except ItemError as e:
        return error(str(e))
    with _channel(args.server, args.max_message_mb) as ch:
        try:
            resp = encoder_pb2_grpc.EncoderStub(ch).Encode(encoder_pb2.EncodeRequest(items=items), timeout=args.timeout)
        except grpc.RpcError as e:
            return rpc_error(e, args.server, names)
    for name, r in zip(names, resp.items):
        emb = r.embedding
        print(
            json.dumps(
                {
                    "item": name,
                    "key": r.content_key,
                    "num_tokens": r.num_tokens,
                    "dim": int(emb.shape[-1]) if emb.shape else 0,
                    "dtype": emb.dtype,
                    "grid_thw": list(r.grid_thw),
                    "cache_hit": r.cache_hit,
                    "timings_ms": {
                        k: round(getattr(r.timings, f"{k}_ms"), 3)
                        for k in ("fetch", "decode", "preprocess", "queue", "encode")
                    },
                    **(
                        {
                            "video": {
                                "duration_s": r.video.duration_s,
                                "frames_total": r.video.frames_total,
                                "frames_sampled": r.video.frames_sampled,
                                "temporal_groups": len(r.timestamps_s),
                            }
                        }
                        if r.HasField("video")
                        else {}
                    ),
                }
            ),
            flush=True,
        )
    if args.out:
        from safetensors import SafetensorError

        try:
            n = save_embeddings(args.out, resp.model, names, resp.items)
        except (OSError, SafetensorError) as e:
            return error(f"cannot write {args.out}: {e}", 1)
        print(f"saved {n} embeddings to {args.out} (metadata 'items' maps each item to its key)", file=sys.stderr)
    return 0


def add_encode_flags(e) -> None:
    e.add_argument("items", nargs="+", metavar="ITEM", help="image or video file, http(s):// URL or data: URI")
    e.add_argument("--server", default=DEFAULT_SERVER, help=f"encoder or router address (default: {DEFAULT_SERVER})")
    e.add_argument(
        "--out",
        default="",
        help="save the embeddings to this .safetensors file: one tensor per content key, "
        "metadata 'items' maps each item to its key (default: none)",
    )
    e.add_argument(
        "--as-path",
        action="store_true",
        help="send file items as server-side paths instead of their bytes (needs --allowed-local-dir there)",
    )
    e.add_argument(
        "--video",
        action="store_true",
        help=f"send every item as a VIDEO (default: by extension: {' '.join(sorted(VIDEO_SUFFIXES))})",
    )
    e.add_argument("--fps", type=float, default=0.0, help="videos: frames sampled per second (0 = server default)")
    e.add_argument("--max-frames", type=int, default=0, help="videos: most frames sampled (0 = server default)")
    e.add_argument("--timeout", type=float, default=600.0, help="RPC deadline in seconds (default: 600)")
    e.add_argument("--max-message-mb", type=int, default=256, help="largest reply accepted, MiB (default: 256)")


# ---------------------------------------------------------------------------------------------- generate
def shown(text: str) -> str:
    """Generated text as a terminal may show it: control characters other than newline and tab (ESC sequences,
    carriage returns, bells, which a model can emit and which would drive the terminal) written as escapes."""
    return "".join(c if c in "\n\t" or not (ord(c) < 32 or 0x7F <= ord(c) < 0xA0) else repr(c)[1:-1] for c in text)


def run_generate(args) -> int:
    import grpc

    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    names = [item_name(it) for it in args.image]
    try:
        media = [media_item(it, video=False) for it in args.image]
    except ItemError as e:
        return error(str(e))
    req = generator_pb2.GenerateRequest(
        prompt=args.prompt,
        media=media,
        sampling=generator_pb2.SamplingOptions(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            has_seed=args.seed is not None,
        ),
    )
    started = False
    tty = sys.stdout.isatty()  # a terminal gets control bytes escaped; a pipe gets the text as generated
    with _channel(args.server) as ch:
        try:
            for msg in generator_pb2_grpc.GeneratorStub(ch).Generate(req, timeout=args.timeout):
                if msg.HasField("delta"):
                    started = True
                    sys.stdout.write(shown(msg.delta.text) if tty else msg.delta.text)
                    sys.stdout.flush()
                else:
                    f = msg.final
                    print()
                    print(
                        json.dumps(
                            {
                                "prompt_tokens": f.prompt_tokens,
                                "media_tokens": f.media_tokens,
                                "cached_tokens": f.cached_tokens,
                                "completion_tokens": f.completion_tokens,
                                "ttft_ms": round(f.ttft_ms, 2),
                                "finish_reason": f.finish_reason,
                            }
                        ),
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            if started:
                print()
            return rpc_error(e, args.server, names)
    return 0


def add_generate_flags(g) -> None:
    g.add_argument(
        "--server", default=DEFAULT_SERVER, help=f"`serve` router or LLM worker address (default: {DEFAULT_SERVER})"
    )
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="ITEM",
        help="an image file, http(s):// URL or data: URI (repeatable); a bare `mimo-epd llm` needs --encoder",
    )
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (default: 0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    g.add_argument("--timeout", type=float, default=600.0, help="RPC deadline in seconds (default: 600)")


def register(commands) -> None:
    commands.command("health", "exit 0 only when the server reports SERVING", setup=add_health_flags, run=run_health)
    commands.command(
        "encode",
        "encode image/video files or URLs through a running server, one JSON line per item",
        setup=add_encode_flags,
        run=run_encode,
        epilog=f"example:\n  mimo-epd encode --server {DEFAULT_SERVER} photo.jpg https://example.com/cat.png "
        "--out emb.safetensors",
    )
    commands.command(
        "generate",
        "stream a generation (text on stdout, token counts on stderr)",
        setup=add_generate_flags,
        run=run_generate,
        epilog=f'example:\n  mimo-epd generate --server {DEFAULT_SERVER} --prompt "What is in the picture?" '
        "--image photo.jpg",
    )
