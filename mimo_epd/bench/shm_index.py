"""`mimo-epd bench shm-index`: per-lookup time of the shared-memory embedding store (shm_cache) as the number of
entries grows (1K, 100K, 1M by default), for hits and misses, through the real segment in /dev/shm.

For each size a fresh segment is created with `max_entries` = that size and an arena that holds exactly that
many small payloads, filled with puts (random 128-bit keys, as content keys are), then timed:
- `contains_*_us`: one key lookup under the node-wide lock (flock + index probe);
- `get_hit_us` / `get_miss_us`: a full read (lookup, pin, view, release; `verify=False`, as integrity checks are
  separate: see shm_cache/store.py);
- `scan_us`: what the previous lookup did before anything else, a scan of the key column
  (`np.flatnonzero(key_lo == lo)`), on the same segment, for comparison;
- `put_us`: mean time of the puts that filled it; `probes_mean` / `probes_max`: index buckets probed per hit
  over a sample of keys.
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np

from shm_cache import ShmCache, metadata_bytes
from shm_cache.index import FREE, MAX_PROBE, _mix


def _keys(rng: np.random.Generator, n: int) -> list[bytes]:
    raw = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    return [bytes(r) for r in raw]


def _per_call_us(fn, keys: list[bytes]) -> float:
    t0 = time.perf_counter()
    for k in keys:
        fn(k)
    return (time.perf_counter() - t0) / len(keys) * 1e6


def _probes(cache: ShmCache, keys: list[bytes]) -> list[int]:
    idx = cache._index
    out = []
    for k in keys:
        lo, hi = int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little")
        b = _mix(lo, hi) & idx.mask
        for p in range(1, MAX_PROBE + 1):
            v = int(idx.table[b])
            if v == FREE or (v >= 0 and int(idx.key_lo[v]) == lo and int(idx.key_hi[v]) == hi):
                break
            b = (b + p) & idx.mask
        out.append(p)
    return out


def run_size(n: int, payload: int, lookups: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    keys = _keys(rng, n)
    absent = _keys(rng, lookups)
    span = (payload + 63) // 64 * 64
    size = metadata_bytes(n) + max(n * span, 1 << 20) + (1 << 20)
    name = f"mimo-bench-{uuid.uuid4().hex[:10]}"
    cache = ShmCache.open(name, size, max_entries=n, verify_sample_rate=0.0)
    try:
        blob = np.arange(payload, dtype=np.uint8)
        t0 = time.perf_counter()
        for k in keys:
            if not cache.put(k, blob):
                raise SystemExit(f"bench shm-index: a put was refused at {n} entries (arena too small?)")
        put_us = (time.perf_counter() - t0) / n * 1e6
        st = cache.stats()
        assert st["entries"] == n and st["evictions"] == 0, st
        sample = [keys[int(i)] for i in rng.integers(0, n, lookups)]

        def get(k):
            e = cache.get(k, verify=False)
            if e is not None:
                e.release()

        cache.contains(sample[0])  # warm
        out = {
            "entries": n,
            "put_us": round(put_us, 2),
            "contains_hit_us": round(_per_call_us(cache.contains, sample), 2),
            "contains_miss_us": round(_per_call_us(cache.contains, absent), 2),
            "get_hit_us": round(_per_call_us(get, sample), 2),
            "get_miss_us": round(_per_call_us(get, absent), 2),
        }
        lo_col = cache._key_lo
        scan_keys = sample[: max(10, min(lookups, 2_000_000 // max(n, 1)))]
        out["scan_us"] = round(
            _per_call_us(lambda k: np.flatnonzero(lo_col == np.uint64(int.from_bytes(k[:8], "little"))), scan_keys), 2
        )
        probes = _probes(cache, sample[:2000])
        out["probes_mean"] = round(float(np.mean(probes)), 3)
        out["probes_max"] = int(max(probes))
        hits = sum(cache.contains(k) for k in sample[:1000])
        misses = sum(not cache.contains(k) for k in absent[:1000])
        out["checked_hits"], out["checked_misses"] = hits, misses  # every sampled key found, every absent one not
        return out
    finally:
        cache.unlink()
        cache.close()


def main(args) -> dict:
    sizes = [1000, 10_000] if args.quick else [int(x) for x in args.sizes.split(",")]
    lookups = 2000 if args.quick else args.lookups
    free = os.statvfs("/dev/shm")
    t0 = time.perf_counter()
    results = {str(n): run_size(n, args.payload_bytes, lookups, args.seed + i) for i, n in enumerate(sizes)}
    smallest, largest = results[str(sizes[0])], results[str(sizes[-1])]
    return {
        "bench": "shm-index",
        "workload": {
            "sizes": sizes,
            "payload_bytes": args.payload_bytes,
            "lookups_per_size": lookups,
            "keys": "random 128-bit",
            "dev_shm_free_bytes": free.f_bavail * free.f_frsize,
        },
        "results": results,
        "ratios": {
            f"contains_hit_{sizes[-1]}_vs_{sizes[0]}": round(
                largest["contains_hit_us"] / smallest["contains_hit_us"], 3
            ),
            f"get_hit_{sizes[-1]}_vs_{sizes[0]}": round(largest["get_hit_us"] / smallest["get_hit_us"], 3),
            f"get_miss_{sizes[-1]}_vs_{sizes[0]}": round(largest["get_miss_us"] / smallest["get_miss_us"], 3),
            f"scan_vs_contains_hit_at_{sizes[-1]}": round(largest["scan_us"] / largest["contains_hit_us"], 3),
        },
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="1000,100000,1000000", help="entry counts, comma-separated (default: 1K,100K,1M)")
    p.add_argument("--payload-bytes", type=int, default=64, help="bytes per entry (default: 64)")
    p.add_argument("--lookups", type=int, default=20000, help="timed lookups per size and kind (default: 20000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI): 1K and 10K entries")
