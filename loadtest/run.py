"""`mimo-epd loadtest encoder`: a headless Locust run against an encoder or `serve` (a local encoder is
started here unless --server).

Generates photo-like JPEGs (written to a directory; Locust users send them as bytes), probes the server
once, runs `locust --headless` with loadtest/locustfile.py, keeps Locust's CSV files, and prints one JSON
summary on stdout: QPS, P50/P90/P99, failures and `failures_by_status`. With `--urls`, half the items are
URLs on a media server this command starts on 127.0.0.1; a server's URL policy refuses loopback
addresses unless it runs with `--url-allowlist 127.0.0.1/32`, and the probe says so before the run.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

from loadtest.locust_cmd import locust_command, results_dir

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
_ALLOW_HINT = "--url-allowlist 127.0.0.1/32"


def _aggregated(stats_csv: Path) -> dict:
    with stats_csv.open() as f:
        rows = list(csv.DictReader(f))
    agg = next(r for r in rows if r["Name"] == "Aggregated")
    num = lambda k: float(agg[k]) if agg.get(k) not in (None, "", "N/A") else 0.0  # noqa: E731
    return {
        "requests": int(num("Request Count")),
        "failures": int(num("Failure Count")),
        "qps": round(num("Requests/s"), 3),
        "avg_ms": round(num("Average Response Time"), 2),
        "p50_ms": num("50%"),
        "p90_ms": num("90%"),
        "p99_ms": num("99%"),
        "by_task": {
            r["Name"]: {
                "requests": int(float(r["Request Count"])),
                "failures": int(float(r["Failure Count"])),
                "p90_ms": float(r["90%"] or 0),
            }
            for r in rows
            if r["Name"] != "Aggregated"
        },
    }


def failures_by_status(failures_csv: Path) -> tuple[dict[str, int], dict[str, str]]:
    """({status code: failed requests}, {status code: one example message}) from locust_failures.csv, whose
    Error column holds `CODE: details` (loadtest/locustfile.py records failures that way)."""
    counts: dict[str, int] = {}
    examples: dict[str, str] = {}
    if not failures_csv.exists():
        return counts, examples
    with failures_csv.open() as f:
        for row in csv.DictReader(f):
            m = re.match(r"^([A-Z_]+): (.*)$", row["Error"], re.S)
            code, details = (m.group(1), m.group(2)) if m else ("OTHER", row["Error"])
            counts[code] = counts.get(code, 0) + int(float(row["Occurrences"]))
            examples.setdefault(code, f"{row['Name']}: {details}"[:300])
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])), examples


def probe(address: str, item, timeout: float = 120.0):
    """One Encode call before the run: None when it succeeds, else the grpc.RpcError."""
    import grpc

    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        try:
            encoder_pb2_grpc.EncoderStub(ch).Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=timeout)
            return None
        except grpc.RpcError as e:
            return e


def check_server(address: str, images: dict[str, bytes], media) -> int:
    """Probe `address` with one byte item (and one URL item when `media` serves them) before the load: 0 when both
    succeed, else the exit code after printing why (1: the server fails, 2: it refuses the load's URLs)."""
    import grpc

    from mimo_epd.v1 import encoder_pb2

    first = next(iter(images))
    err = probe(address, encoder_pb2.MediaItem(data=images[first] + b"mimo-epd:probe"))
    if err is not None:
        hint = (
            "; is the server running? (`make serve` starts one on 127.0.0.1:50051)"
            if err.code() == grpc.StatusCode.UNAVAILABLE
            else ""
        )
        print(f"error: {address}: the probe request failed: {err.code().name}: {err.details()}{hint}", file=sys.stderr)
        return 1
    if media is None:
        return 0
    err = probe(address, encoder_pb2.MediaItem(url=media.url(first, "probe")))
    if err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED:
        print(
            f"error: {address} refuses the load test's media URLs ({media.url(first)}): {err.details()}\n"
            f"  its URL policy refuses loopback addresses: restart it with `{_ALLOW_HINT}`, or run "
            "without --urls (every item sent as bytes)",
            file=sys.stderr,
        )
        return 2
    if err is not None:
        print(f"error: {address}: a URL item failed: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    return 0


def run(args) -> int:
    """The load test; Locust's CSV files go to --csv-dir, or to a temporary directory removed at the end."""
    with results_dir(args.csv_dir, "mimo-loadtest-") as out_dir:
        return _run(args, out_dir)


def write_media(out_dir: Path, images: dict[str, bytes], audio_fraction: float) -> tuple[Path, Path]:
    """The load's images (and, with --audio-fraction, four 2-8 s clips) under `out_dir`, for the Locust users."""
    img_dir = out_dir / "images"
    img_dir.mkdir(exist_ok=True)
    for name, data in images.items():
        (img_dir / name).write_bytes(data)
    audio_dir = out_dir / "audio"
    if audio_fraction > 0:
        from mimo_epd.testing.audio_gen import make_test_audio

        audio_dir.mkdir(exist_ok=True)
        for i in range(4):
            make_test_audio(str(audio_dir / f"clip-{i}.wav"), 2.0 + 2 * i, seed=100 + i)
    return img_dir, audio_dir


def _run(args, out_dir: Path) -> int:
    import importlib.util

    from mimo_epd.testing.media_server import MediaServer, generate_pool
    from mimo_epd.testing.servers import start_server

    if importlib.util.find_spec("locust") is None:  # not imported here: it monkey-patches the process
        print(
            "error: locust is not installed (it is a dependency of mimo-epd: `make install` reinstalls it)",
            file=sys.stderr,
        )
        return 2
    images = generate_pool([(480, 640), (1080, 1920)], per_size=2)
    img_dir, audio_dir = write_media(out_dir, images, args.audio_fraction)
    server = None
    proc = None
    with MediaServer(images) if args.urls else nullcontext() as media:
        address = args.server
        try:
            if not address:
                print("loadtest: starting a local encoder (--server to test a running one)", file=sys.stderr)
                server = start_server(["--url-allowlist", "127.0.0.1/32", "--cache-bytes", "0"])
                address = server.address
            urls = [media.url(n) for n in images] if media else []
            rc = check_server(address, images, media)
            if rc:
                return rc
            env = {
                **os.environ,
                "MIMO_EPD_MEDIA_URLS": ",".join(urls),
                "MIMO_EPD_IMAGES_DIR": str(img_dir),
                "MIMO_EPD_AUDIO_DIR": str(audio_dir),
                "MIMO_EPD_AUDIO_FRACTION": str(args.audio_fraction),
            }
            cmd = locust_command(
                LOCUSTFILE,
                users=args.users,
                spawn_rate=args.spawn_rate,
                run_time=args.run_time,
                host=address,
                csv_prefix=out_dir / "locust",
                stop_timeout_s=30,
            )
            print(
                f"loadtest: {args.users} users for {args.run_time} against {address} "
                f"({'bytes and URLs' if urls else 'bytes'})",
                file=sys.stderr,
            )
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        finally:
            if server is not None:
                server.stop()
    stats_csv = out_dir / "locust_stats.csv"
    if not stats_csv.exists():
        print(proc.stderr[-3000:], file=sys.stderr)
        print("error: locust wrote no statistics", file=sys.stderr)
        return 1
    by_status, examples = failures_by_status(out_dir / "locust_failures.csv")
    summary = {
        "loadtest": "encoder",
        "server": address,
        "users": args.users,
        "spawn_rate": args.spawn_rate,
        "run_time": args.run_time,
        "items": "bytes+urls" if args.urls else "bytes",
        "audio_fraction": args.audio_fraction,
        "csv": str(stats_csv) if args.csv_dir else None,
        **_aggregated(stats_csv),
        "failures_by_status": by_status,
    }
    if by_status:
        print(f"loadtest: {summary['failures']} of {summary['requests']} requests failed:", file=sys.stderr)
        for code, n in by_status.items():
            print(f"  {n:7d} {code}: {examples[code]}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if summary["failures"] == 0 and proc.returncode == 0 else 1


def add_arguments(p) -> None:
    p.add_argument("--users", type=int, default=8, help="concurrent Locust users (default: 8)")
    p.add_argument("--spawn-rate", type=float, default=8, help="users started per second (default: 8)")
    p.add_argument("--run-time", default="30s", help="Locust run time, e.g. 30s, 2m (default: 30s)")
    p.add_argument(
        "--server", default="", help="encoder or `serve` address; empty = start a local encoder (default: '')"
    )
    p.add_argument(
        "--urls",
        action="store_true",
        help="also send items as URLs on a media server started here on 127.0.0.1 (the server needs "
        f"{_ALLOW_HINT}); default: every item is sent as bytes",
    )
    p.add_argument(
        "--audio-fraction",
        type=float,
        default=0.0,
        help="share of requests carrying a 2-8 s audio clip (AUDIO item) instead of an image (default: 0)",
    )
    p.add_argument(
        "--csv-dir",
        default="",
        help="keep Locust's CSV files in this directory (default: a temporary one, removed at the end)",
    )
    p.add_argument("--timeout-s", type=float, default=3600, help="kill Locust after this many seconds (default: 3600)")
