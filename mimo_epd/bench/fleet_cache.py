"""`mimo-epd bench cache-routing --nodes N`: the node-local embedding cache against the fleet's (Mooncake Store and the
encode lease, encoder_server/cluster_cache.py), live on this machine.

N encoder servers stand for N nodes, each with its own in-process cache (`--node-cache-bytes`), loaded by the same
trace in two runs: `node_local` (each node only has its own cache) and `fleet` (`--embedding-store` on one
`mooncake_master`, `--embedding-lease` on one `redis-server`). The trace: `--sessions` sessions of `--turns`
requests, each session pinned to one node (sessions spread round-robin, as affinity routing pins a conversation),
each request with 1-2 images drawn by Zipf popularity from a shared catalog of small PNGs, so popular media repeat
across sessions and therefore across nodes. Requests run closed-loop at `--concurrency`.

Reported per run: encodes (vision forward items summed over the nodes' `encoder_batch_items`), encodes per request,
hit rate (1 - encodes / items), fleet hits and lease waits served (encodes the lease saved), QPS and latency. Every
item's rows are checked equal across the two runs (relative L2 within 1e-5: an item may be encoded in differently
packed batches in the two runs; `outputs_max_rel_l2` is the largest difference). `ratios.l3_hit_vs_node_local` is the fleet run's hit rate over the
node-local run's; `ratios.encodes_fleet_vs_node_local` the encodes.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from mimo_epd.bench.common import closed_loop, latency_stats


def _png(arr: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def trace(args) -> tuple[list[bytes], list[tuple[int, list[int]]]]:
    """(the catalog's PNG bytes, [(node, item indices)] per request in arrival order: turn by turn, each session's
    next request on its node)."""
    from mimo_epd.testing.media_server import photo_like

    rng = np.random.default_rng(args.seed)
    sizes = rng.integers(48, 160, size=(args.live_catalog, 2))
    catalog = [_png(photo_like(int(h), int(w), seed=i)) for i, (h, w) in enumerate(sizes)]
    ranks = rng.permutation(args.live_catalog) + 1
    p = 1.0 / ranks**args.zipf
    p /= p.sum()
    reqs = []
    for _turn in range(args.turns):
        for s in range(args.sessions):
            n = int(rng.integers(1, 3))
            reqs.append((s % args.nodes, [int(i) for i in rng.choice(args.live_catalog, size=n, replace=False, p=p)]))
    return catalog, reqs


def _run(args, catalog, reqs, extra: list[str]) -> tuple[dict, list]:
    """One run: `args.nodes` encoders started with `extra`, the trace through them; (report, rows per request)."""
    import grpc

    from mimo_epd.testing.redis_server import free_port
    from mimo_epd.testing.servers import scrape, start_server
    from mimo_epd.v1 import encoder_pb2 as pb
    from mimo_epd.v1 import encoder_pb2_grpc

    ports = [free_port() for _ in range(args.nodes)]
    base = ["--cache-bytes", str(args.node_cache_bytes), "--decode-workers", "1", "--torch-threads", "1", *extra]
    nodes = [start_server([*base, "--metrics-port", str(p)]) for p in ports]
    rows: list = [None] * len(reqs)
    try:
        if "--embedding-store" in extra:
            deadline = time.monotonic() + 60
            while any(scrape(p).get("encoder_cluster_cache_connected", 0) < 1 for p in ports):
                if time.monotonic() > deadline:
                    raise RuntimeError("the embedding store did not connect")
                time.sleep(0.1)
        before = [scrape(p) for p in ports]

        async def go():
            chans = [grpc.aio.insecure_channel(n.address) for n in nodes]
            stubs = [encoder_pb2_grpc.EncoderStub(c) for c in chans]

            async def send(i: int) -> None:
                node, items = reqs[i]
                req = pb.EncodeRequest(items=[pb.MediaItem(data=catalog[j]) for j in items])
                r = await stubs[node].Encode(req, timeout=120)
                rows[i] = [bytes(it.embedding.data) for it in r.items]

            try:
                return await closed_loop(send, len(reqs), args.concurrency)
            finally:
                for c in chans:
                    await c.close()

        lat, wall, failures = asyncio.run(go())
        after = [scrape(p) for p in ports]
    finally:
        for n in nodes:
            n.stop()

    def total(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before))

    items = sum(len(it) for _, it in reqs)
    encodes = int(total("encoder_batch_items_sum"))
    return {
        **latency_stats(lat, wall),
        "failures": failures,
        "items": items,
        "encodes": encodes,
        "encodes_per_request": round(encodes / len(reqs), 4),
        "hit_rate": round(1 - encodes / items, 4),
        "node_hits": int(total('encoder_cache_lookups_total{result="hit"}')),
        "fleet_hits": int(total('encoder_cache_lookups_total{result="fleet_hit"}')),
        "lease_waits_served": int(total('encoder_cluster_cache_total{event="lease_waits_served"}')),
        "store_writes": int(total('encoder_cluster_cache_total{event="writes"}')),
    }, rows


MATCH_REL_L2 = 1e-5  # an item's rows may come from differently packed batches in the two runs


def _worst_rel(a: list, b: list) -> float:
    """The largest relative L2 difference of one item's rows between two runs (inf for a missing reply)."""
    worst = 0.0
    for ra, rb in zip(a, b):
        if ra is None or rb is None or len(ra) != len(rb):
            return float("inf")
        for x, y in zip(ra, rb):
            u, v = np.frombuffer(x, "<f4"), np.frombuffer(y, "<f4")
            if u.shape != v.shape:
                return float("inf")
            worst = max(worst, float(np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-12)))
    return worst


def main(args) -> dict:
    from mimo_epd.testing.mooncake_master import MooncakeMaster, master_binary
    from mimo_epd.testing.redis_server import RedisServer

    if master_binary() is None or shutil.which("redis-server") is None:
        raise SystemExit("bench cache-routing --nodes needs the mooncake-transfer-engine wheel and redis-server")
    if args.quick:
        args.live_catalog, args.sessions, args.turns = 40, 8, 4
    t0 = time.perf_counter()
    catalog, reqs = trace(args)
    local, rows_local = _run(args, catalog, reqs, [])
    with tempfile.TemporaryDirectory(prefix="mimo-epd-fleet-") as d:
        master, redis = MooncakeMaster(Path(d)), RedisServer(Path(d))
        master.start()
        redis.start()
        try:
            seg = ["--embedding-store-segment-bytes", str(args.store_segment_bytes)]
            fleet, rows_fleet = _run(
                args, catalog, reqs, ["--embedding-store", master.url, "--embedding-lease", redis.url, *seg]
            )
        finally:
            master.stop()
            redis.stop()
    worst = _worst_rel(rows_local, rows_fleet)
    return {
        "bench": "cache-routing",
        "live": True,
        "bounded": args.quick,
        "workload": {
            "nodes": args.nodes,
            "catalog_items": args.live_catalog,
            "sessions": args.sessions,
            "turns": args.turns,
            "requests": len(reqs),
            "items_per_request": "1-2 uniform, distinct",
            "zipf": args.zipf,
            "node_cache_bytes": args.node_cache_bytes,
            "concurrency": args.concurrency,
            "seed": args.seed,
        },
        "node_local": local,
        "fleet": fleet,
        "outputs_max_rel_l2": worst,
        "outputs_match": worst <= MATCH_REL_L2,
        "ratios": {
            "l3_hit_vs_node_local": round(fleet["hit_rate"] / local["hit_rate"], 3) if local["hit_rate"] else None,
            "encodes_fleet_vs_node_local": round(fleet["encodes"] / local["encodes"], 3) if local["encodes"] else None,
            "qps_fleet_vs_node_local": round(fleet["qps"] / local["qps"], 3),
            "p90_fleet_vs_node_local": round(fleet["p90_ms"] / local["p90_ms"], 3),
        },
        "seconds": round(time.perf_counter() - t0, 2),
    }
