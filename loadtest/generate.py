"""`mimo-epd loadtest generate`: a headless Locust run of generation against `serve` (started here unless
--http / --grpc are given): streamed chat completions over HTTP and Generate over gRPC.

Runs `locust --headless` with loadtest/generate_locustfile.py, keeps Locust's CSV files with --csv-dir (else
in a temporary directory removed at the end), and prints one
JSON summary: QPS, end-to-end and time-to-first-token P50/P90/P99, completion tokens per second, failures
grouped by status, and the same per API. `--workload chat` shares a few system prompts between users and
grows multi-turn sessions (prefix caching matters); `--workload images` adds an inline image to every
question.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from loadtest.locust_cmd import locust_command, results_dir

LOCUSTFILE = Path(__file__).with_name("generate_locustfile.py")


HTTP_APIS = ("chat", "completions", "responses", "messages")


def _percentiles(values: list[float]) -> dict:
    from mimo_epd.common.stats import summary

    return summary(values, 1.0, 2, "_ms")


def summarize(records: list[dict]) -> dict:
    """QPS, latency percentiles, tokens/s and failures of the raw records the Locust users wrote."""
    if not records:
        return {"requests": 0, "failures": 0, "qps": 0.0, "tokens_per_s": 0.0, "failures_by_status": {}}
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    ok = [r for r in records if not r["error"]]
    tokens = sum(r["tokens"] for r in ok)
    by_status = Counter(r["error"].split(":", 1)[0] for r in records if r["error"])
    e2e = _percentiles([r["e2e_ms"] for r in ok])
    return {
        "requests": len(records),
        "failures": len(records) - len(ok),
        "seconds": round(wall, 3),
        "qps": round(len(records) / wall, 3) if wall > 0 else 0.0,
        **e2e,
        "e2e_ms": e2e,
        "ttft_ms": _percentiles([r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "failures_by_status": dict(by_status),
        "failure_examples": {
            k: next(r["error"] for r in records if r["error"] and r["error"].startswith(k))[:300] for k in by_status
        },
    }


def run(args) -> int:
    """The load test; Locust's CSV files go to --csv-dir, or to a temporary directory removed at the end."""
    with results_dir(args.csv_dir, "mimo-loadtest-generate-") as out_dir:
        return _run(args, out_dir)


def _refusal(args) -> str:
    """Why the arguments cannot run ("" when they can)."""
    import importlib.util

    if importlib.util.find_spec("locust") is None:  # not imported here: it monkey-patches the process
        return "locust is not installed: pip install 'mimo-epd[loadtest]'"
    if not args.apis or any(a not in HTTP_APIS for a in args.apis.split(",")):
        return f"--apis takes {', '.join(HTTP_APIS)}, got {args.apis!r}"
    if args.workload not in ("chat", "images"):
        return f"--workload must be chat or images, got {args.workload!r}"
    return ""


def _run(args, out_dir: Path) -> int:
    refusal = _refusal(args)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    from mimo_epd.testing.servers import start_server

    img_dir = out_dir / "images"
    if args.workload == "images":
        from mimo_epd.testing.media_server import generate_pool

        img_dir.mkdir(exist_ok=True)
        for name, data in generate_pool([(224, 224), (320, 480)], per_size=3).items():
            (img_dir / name).write_bytes(data)
    server = None
    http, grpc_addr = args.http, args.grpc
    try:
        if not http and not grpc_addr:
            server = start_server(["--http-port", "0", *args.serve_args.split()], subcommand="serve", timeout=600)
            http, grpc_addr = server.http_address, server.address
        if http and "://" not in http:
            http = "http://" + http
        results = out_dir / "records.json"
        env = {
            **os.environ,
            "MIMO_EPD_GEN_HTTP": http,
            "MIMO_EPD_GEN_GRPC": grpc_addr,
            "MIMO_EPD_GEN_GRPC_SHARE": str(args.grpc_share),
            "MIMO_EPD_GEN_WORKLOAD": args.workload,
            "MIMO_EPD_GEN_HTTP_APIS": args.apis,
            "MIMO_EPD_GEN_MAX_TOKENS": str(args.max_tokens),
            "MIMO_EPD_GEN_IMAGES_DIR": str(img_dir),
            "MIMO_EPD_GEN_RESULTS": str(results),
        }
        cmd = locust_command(
            LOCUSTFILE,
            users=args.users,
            spawn_rate=args.spawn_rate,
            run_time=args.run_time,
            host=http or grpc_addr,
            csv_prefix=out_dir / "locust",
            stop_timeout_s=60,
        )
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    finally:
        if server is not None:
            server.stop()
    if not results.exists():
        print(proc.stderr[-3000:], file=sys.stderr)
        print("error: locust wrote no records", file=sys.stderr)
        return 1
    records = json.loads(results.read_text())
    summary = {
        "loadtest": "generate",
        "workload": args.workload,
        "http": http,
        "grpc": grpc_addr,
        "users": args.users,
        "spawn_rate": args.spawn_rate,
        "run_time": args.run_time,
        "max_tokens": args.max_tokens,
        "grpc_share": args.grpc_share if grpc_addr else 0.0,
        "csv": str(out_dir / "locust_stats.csv") if args.csv_dir else None,
        **summarize(records),
        "by_api": {
            api: summarize([r for r in records if r["api"] == api]) for api in sorted({r["api"] for r in records})
        },
    }
    if summary["failures"]:
        print(f"loadtest: {summary['failures']} of {summary['requests']} requests failed:", file=sys.stderr)
        for code, example in summary["failure_examples"].items():
            print(f"  {code}: {example}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if summary["failures"] == 0 and summary["requests"] > 0 and proc.returncode == 0 else 1


def add_arguments(p) -> None:
    p.add_argument("--users", type=int, default=4, help="concurrent Locust users (default: 4)")
    p.add_argument("--spawn-rate", type=float, default=4, help="users started per second (default: 4)")
    p.add_argument("--run-time", default="30s", help="Locust run time, e.g. 30s, 2m (default: 30s)")
    p.add_argument(
        "--workload",
        default="chat",
        choices=("chat", "images"),
        help="chat: shared system prompts, multi-turn sessions; images: an inline image per question (default: chat)",
    )
    p.add_argument(
        "--http",
        default="",
        help="HTTP API base, e.g. http://127.0.0.1:8000; with --grpc empty too, a "
        "`serve` is started here (default: '')",
    )
    p.add_argument("--grpc", default="", help="Generate address, e.g. 127.0.0.1:50051 (default: '')")
    p.add_argument(
        "--apis",
        default="chat",
        help="HTTP APIs the users take turns with, comma-separated: chat (/v1/chat/completions), completions "
        "(/v1/completions), responses (/v1/responses), messages (/v1/messages); the same conversation each "
        "(default: chat)",
    )
    p.add_argument(
        "--grpc-share",
        type=float,
        default=0.25,
        help="fraction of requests sent over gRPC Generate when both APIs are given (default: 0.25)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request (default: 16)")
    p.add_argument("--serve-args", default="", help="extra flags for the `serve` started here (default: '')")
    p.add_argument(
        "--csv-dir",
        default="",
        help="keep Locust's CSV files in this directory (default: a temporary one, removed at the end)",
    )
    p.add_argument("--timeout-s", type=float, default=3600, help="kill Locust after this many seconds (default: 3600)")
