"""Measures a shared KV store's transport (`--kv-store` URLs of the benchmarks): write and read bytes per second
and the latency of one lookup, through the store's own backend calls (`SharedKVStore._write` / `_read`, what the
tier uses under the page format), with `count` values of `value_bytes` random bytes under a fresh namespace.

- write: `count` sequential writes (replace = the SET path of a page with its window);
- read: the same keys in lookups of `batch` keys (one MGET / one batch_get_into each);
- lookup latency: `count` single-key lookups, P50 / P99.
Seconds are wall time on this machine (loopback here: what a NIC adds is not in them)."""

from __future__ import annotations

import os
import time
import uuid


def measure(url: str, value_bytes: int = 1 << 20, count: int = 48, batch: int = 8) -> dict:
    from llm_backend.kv.tiers import open_store

    store = open_store(
        url, f"probe:{uuid.uuid4().hex}", buffer_bytes=max(16 << 20, 2 * batch * value_bytes), segment_bytes=1 << 30
    )
    try:
        if not store.wait_connected(30):
            raise SystemExit(f"--kv-store {url}: did not connect within 30 s")
        value = os.urandom(value_bytes)
        keys = [store.key(i) for i in range(count)]
        t0 = time.perf_counter()
        for k in keys:
            if not store._write(k, value, replace=True):
                raise SystemExit(f"--kv-store {url}: the store refused a {value_bytes}-byte value")
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = 0
        for i in range(0, count, batch):
            got += sum(len(v or b"") for v in store._read(keys[i : i + batch]))
        read_s = time.perf_counter() - t0
        if got != count * value_bytes:
            raise SystemExit(f"--kv-store {url}: read back {got} of {count * value_bytes} bytes")
        lat = []
        for k in keys:
            t0 = time.perf_counter()
            store._read([k])
            lat.append(time.perf_counter() - t0)
        lat.sort()
        return {
            "value_bytes": value_bytes,
            "values": count,
            "write_bytes_per_s": round(count * value_bytes / write_s),
            "read_bytes_per_s": round(count * value_bytes / read_s),
            "lookup_ms": {
                "p50": round(lat[len(lat) // 2] * 1e3, 4),
                "p99": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 4),
            },
        }
    finally:
        store.close()
