"""`mimo-epd loadtest encoder`: a headless Locust run against an encoder (started here unless --server).

Starts a local media server with generated photo-like JPEGs (also written to a directory for the
bytes task), runs `locust --headless` with loadtest/locustfile.py, keeps Locust's CSV files, and prints
one JSON summary with QPS, P50/P90/P99 and failures.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mimo_epd.testing.media_server import MediaServer, generate_pool

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def _aggregated(stats_csv: Path) -> dict:
    with stats_csv.open() as f:
        rows = list(csv.DictReader(f))
    agg = next(r for r in rows if r["Name"] == "Aggregated")
    num = lambda k: float(agg[k]) if agg.get(k) not in (None, "", "N/A") else 0.0  # noqa: E731
    return {"requests": int(num("Request Count")), "failures": int(num("Failure Count")),
            "qps": round(num("Requests/s"), 3), "avg_ms": round(num("Average Response Time"), 2),
            "p50_ms": num("50%"), "p90_ms": num("90%"), "p99_ms": num("99%"),
            "by_task": {r["Name"]: {"requests": int(float(r["Request Count"])), "p90_ms": float(r["90%"] or 0)}
                        for r in rows if r["Name"] != "Aggregated"}}


def run(args) -> int:
    import importlib.util

    if importlib.util.find_spec("locust") is None:  # not imported here: it monkey-patches the process
        print("error: locust is not installed: pip install 'mimo-epd[loadtest]'", file=sys.stderr)
        return 2
    from mimo_epd.bench.common import start_server

    out_dir = Path(args.csv_dir or tempfile.mkdtemp(prefix="mimo-loadtest-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    images = generate_pool([(480, 640), (1080, 1920)], per_size=2)
    img_dir = out_dir / "images"
    img_dir.mkdir(exist_ok=True)
    for name, data in images.items():
        (img_dir / name).write_bytes(data)
    server = None
    with MediaServer(images) as media:
        address = args.server
        if not address:
            server = start_server(["--url-allowlist", "127.0.0.1/32", "--cache-bytes", "0"])
            address = server.address
        env = {**os.environ, "MIMO_EPD_MEDIA_URLS": ",".join(media.url(n) for n in images),
               "MIMO_EPD_IMAGES_DIR": str(img_dir)}
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--users", str(args.users),
               "--spawn-rate", str(args.spawn_rate), "--run-time", args.run_time, "--host", address,
               "--csv", str(out_dir / "locust"), "--only-summary", "--stop-timeout", "30"]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        finally:
            if server is not None:
                server.stop()
    stats_csv = out_dir / "locust_stats.csv"
    if not stats_csv.exists():
        print(proc.stderr[-3000:], file=sys.stderr)
        print("error: locust wrote no statistics", file=sys.stderr)
        return 1
    summary = {"loadtest": "encoder", "server": address, "users": args.users, "spawn_rate": args.spawn_rate,
               "run_time": args.run_time, "csv": str(out_dir / "locust_stats.csv"), **_aggregated(stats_csv)}
    print(json.dumps(summary))
    return 0 if summary["failures"] == 0 and proc.returncode == 0 else 1


def add_arguments(p) -> None:
    p.add_argument("--users", type=int, default=8, help="concurrent Locust users (default: 8)")
    p.add_argument("--spawn-rate", type=float, default=8, help="users started per second (default: 8)")
    p.add_argument("--run-time", default="30s", help="Locust run time, e.g. 30s, 2m (default: 30s)")
    p.add_argument("--server", default="", help="encoder or router address; empty = start a local encoder (default: '')")
    p.add_argument("--csv-dir", default="", help="where Locust's CSV files go (default: a new temporary directory)")
    p.add_argument("--timeout-s", type=float, default=3600, help="kill Locust after this many seconds (default: 3600)")
