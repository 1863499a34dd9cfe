"""`mimo-epd bench cache-routing`: multimodal cache hit rates under round-robin vs consistent-hash
routing, with private per-encoder caches vs the shared node cache (`--nodes N`: live, the node-local cache vs the
fleet's across N encoder servers, bench/fleet_cache.py).

A catalog of distinct images (realistic sizes -> realistic embedding sizes) is requested with Zipf
popularity; each request carries 1-4 items. The same request stream is replayed through:

- `rr_private`:   round-robin request placement, each encoder with its own in-process LRU (EmbeddingLRU);
- `hash_private`: items placed by the hash ring (mimo_epd.router.hash_ring), private LRUs;
- `rr_shared` / `hash_shared`: the same placements, one shm_cache.ShmCache (real shared memory) of
  the same total bytes as the private caches together.

Only the caches and the ring are exercised (no encoding): hit rates depend on placement and capacity,
not on how long a forward takes.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import torch

from encoder_server.embedding_cache import CachedEmbedding, EmbeddingLRU
from encoder_server.preprocess import PreprocessConfig, grid_for
from mimo_epd.router.hash_ring import HashRing

SIZES = [(480, 640), (720, 1280), (1080, 1920), (2160, 3840), (800, 800), (1024, 768)]


def catalog_tokens(rng, catalog: int) -> list[int]:
    """Merged tokens of `catalog` images of real sizes (SIZES, drawn from `rng`) under Qwen2.5-VL's preprocessing."""
    cfg = PreprocessConfig()
    tokens = []
    for _ in range(catalog):
        h, w = SIZES[rng.integers(len(SIZES))]
        t, gh, gw = grid_for(h, w, cfg)
        tokens.append(t * gh * gw // 4)
    return tokens


def build_workload(catalog: int, requests: int, zipf: float, seed: int, hidden: int = 256):
    rng = np.random.default_rng(seed)
    tokens = catalog_tokens(rng, catalog)
    nbytes = np.array(tokens, np.int64) * hidden * 4
    ranks = rng.permutation(catalog) + 1  # popularity independent of size
    p = 1.0 / ranks**zipf
    p /= p.sum()
    counts = rng.integers(1, 5, size=requests)
    items = rng.choice(catalog, size=int(counts.sum()), p=p)
    reqs = np.split(items, np.cumsum(counts)[:-1])
    keys = [f"{i:032x}" for i in range(catalog)]
    return reqs, nbytes, keys


def _place(reqs, mode: str, encoders: int, ring: HashRing, keys):
    for r, items in enumerate(reqs):
        for it in items:
            yield it, (r % encoders if mode == "rr" else ring_index(ring, keys[it]))


_ring_cache: dict = {}


def ring_index(ring: HashRing, key: str) -> int:
    v = _ring_cache.get(key)
    if v is None:
        v = _ring_cache[key] = int(ring.owner(key).removeprefix("encoder-"))
    return v


def run_private(reqs, nbytes, keys, mode, encoders, cap_each, ring) -> dict:
    caches = [EmbeddingLRU(cap_each) for _ in range(encoders)]
    hits = lookups = 0
    for it, e in _place(reqs, mode, encoders, ring, keys):
        lookups += 1
        if caches[e].get(keys[it]) is not None:
            hits += 1
        else:
            caches[e].put(keys[it], CachedEmbedding(torch.empty(int(nbytes[it]) // 4), (1, 2, 2)))
    return {"hit_rate": hits / lookups, "lookups": lookups, "hits": hits, "evictions": sum(c.evictions for c in caches)}


def run_shared(reqs, nbytes, keys, mode, encoders, cap_total, ring) -> dict:
    from shm_cache import ShmCache

    name = f"mimo-bench-{uuid.uuid4().hex[:10]}"
    # slot table + pins overhead on top of the data arena, so the data arena equals cap_total
    overhead = 4096 + 65536 * 128 + 4096 * 16 + 4096
    cache = ShmCache.open(name, cap_total + overhead)
    try:
        hits = lookups = 0
        blob = np.zeros(int(nbytes.max()), np.uint8)
        for it, _e in _place(reqs, mode, encoders, ring, keys):
            lookups += 1
            entry = cache.get(keys[it], verify=False)
            if entry is not None:
                hits += 1
                entry.release()
            else:
                cache.put(keys[it], blob[: int(nbytes[it])], (1, 2, 2))
        st = cache.stats()
        return {"hit_rate": hits / lookups, "lookups": lookups, "hits": hits, "evictions": st["evictions"]}
    finally:
        cache.unlink()
        cache.close()


def main(args) -> dict:
    if args.hot:
        from mimo_epd.bench.hot_item import main as hot

        return hot(args)
    if args.nodes:
        from mimo_epd.bench.fleet_cache import main as live

        return live(args)
    quick = args.quick
    catalog = 300 if quick else args.catalog
    requests = 2000 if quick else args.requests
    t0 = time.perf_counter()
    reqs, nbytes, keys = build_workload(catalog, requests, args.zipf, args.seed)
    ring = HashRing([f"encoder-{i}" for i in range(args.encoders)], vnodes=args.vnodes)
    _ring_cache.clear()
    cap_each = int(nbytes.sum() * args.cache_fraction)
    results = {}
    for mode in ("rr", "hash"):
        results[f"{mode}_private"] = run_private(reqs, nbytes, keys, mode, args.encoders, cap_each, ring)
        results[f"{mode}_shared"] = run_shared(reqs, nbytes, keys, mode, args.encoders, cap_each * args.encoders, ring)
    hit = {k: round(v["hit_rate"], 4) for k, v in results.items()}
    best_private = max(hit["rr_private"], hit["hash_private"])
    sensitivity = []
    if not quick:
        for z in (0.7, 0.9, 1.1):
            for frac in (0.02, 0.05, 0.1):
                r2, nb2, k2 = build_workload(catalog, requests // 2, z, args.seed + 1)
                _ring_cache.clear()
                c2 = int(nb2.sum() * frac)
                rr = run_private(r2, nb2, k2, "rr", args.encoders, c2, ring)["hit_rate"]
                hs = run_private(r2, nb2, k2, "hash", args.encoders, c2, ring)["hit_rate"]
                sensitivity.append(
                    {
                        "zipf": z,
                        "cache_fraction": frac,
                        "rr_private": round(rr, 4),
                        "hash_private": round(hs, 4),
                        "hash_vs_rr_private": round(hs / rr, 3),
                    }
                )
    return {
        "bench": "cache-routing",
        "workload": {
            "catalog_items": catalog,
            "requests": requests,
            "item_lookups": results["rr_private"]["lookups"],
            "items_per_request": "1-4 uniform",
            "zipf": args.zipf,
            "encoders": args.encoders,
            "catalog_bytes": int(nbytes.sum()),
            "per_encoder_cache_bytes": cap_each,
            "per_encoder_cache_fraction_of_catalog": args.cache_fraction,
            "shared_cache_bytes": cap_each * args.encoders,
            "vnodes": args.vnodes,
            "seed": args.seed,
        },
        "hit_rate": hit,
        "detail": results,
        "ratios": {
            "hash_vs_rr_private": round(hit["hash_private"] / hit["rr_private"], 3),
            "shared_vs_best_private": round(max(hit["rr_shared"], hit["hash_shared"]) / best_private, 3),
            "hash_shared_vs_rr_private": round(hit["hash_shared"] / hit["rr_private"], 3),
        },
        "sensitivity": sensitivity,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def add_arguments(p) -> None:
    p.add_argument("--catalog", type=int, default=2000, help="distinct images (default: 2000)")
    p.add_argument("--requests", type=int, default=20000, help="requests replayed (default: 20000)")
    p.add_argument("--encoders", type=int, default=4, help="encoder instances (default: 4)")
    p.add_argument("--zipf", type=float, default=0.9, help="Zipf exponent of item popularity (default: 0.9)")
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.05,
        help="each private cache's size as a fraction of the catalog's bytes (default: 0.05)",
    )
    p.add_argument("--vnodes", type=int, default=160, help="virtual nodes per encoder (default: 160)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI)")
    p.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="live: this many encoder servers as nodes, the node-local cache vs the fleet's (Mooncake Store and the "
        "encode lease) on a trace of sessions whose media repeat across nodes (bench/fleet_cache.py; 0 = the cache "
        "replay above) (default: 0)",
    )
    p.add_argument(
        "--hot",
        action="store_true",
        help="live: one hot item, plain consistent hashing vs bounded loads, on one node (bench/hot_item.py)",
    )
    p.add_argument("--hot-requests", type=int, default=400, help="--hot: requests (default: 400)")
    p.add_argument(
        "--hot-fraction", type=float, default=0.5, help="--hot: share asking for the hot item (default: 0.5)"
    )
    p.add_argument("--hot-encoders", type=int, default=2, help="--hot: encoders of the node (default: 2)")
    p.add_argument(
        "--hot-load-factor", type=float, default=1.25, help="--hot: the bounded run's factor (default: 1.25)"
    )
    p.add_argument("--live-catalog", type=int, default=120, help="live: distinct images (default: 120)")
    p.add_argument("--sessions", type=int, default=32, help="live: sessions, pinned to nodes round-robin (default: 32)")
    p.add_argument("--turns", type=int, default=8, help="live: requests per session (default: 8)")
    p.add_argument("--concurrency", type=int, default=8, help="live: clients at once (default: 8)")
    p.add_argument(
        "--node-cache-bytes", type=int, default=16 << 20, help="live: each node's own cache (default: 16 MiB)"
    )
    p.add_argument(
        "--store-segment-bytes",
        type=int,
        default=256 << 20,
        help="live: each node's share of the store (default: 256 MiB)",
    )
