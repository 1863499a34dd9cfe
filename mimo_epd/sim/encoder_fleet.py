"""The encoder half of a fleet at N nodes, on one virtual clock: what the node-local caches and the fleet's cache
(`--embedding-store` with `--embedding-lease`, encoder_server/cluster_cache.py) do at sizes this machine cannot
run live (`mimo-epd sim encoders --nodes 8,32`).

Model (the rules of the live system, with costs as flags):
- **Trace**: S sessions per node, pinned to nodes round-robin (as a router's KV affinity pins them), T turns each;
  each turn carries 1-2 media items drawn by Zipf popularity from one catalog the whole fleet shares (so popular
  items recur on every node). Item sizes are real images' (the cache-routing bench's mix: `grid_for` tokens, rows
  of `--hidden` x 2 bytes, MiMo's bf16). Arrivals are a Poisson stream at `--rate` requests/s per node.
- **A node**: one encoder, first come first served (`--encode-ms-per-1k-tokens` per item); its cache an LRU of
  `--node-cache-mib`; an item already being encoded on the node is waited for, not encoded twice (the in-flight
  table).
- **The fleet's cache** (mode `fleet`): an LRU of N x `--segment-mib` shared by all nodes; a node miss looks there
  first (`--store-ms`) and a hit fills the node cache; what a node encodes is written there when its encode
  finishes; a miss while the same item is being encoded elsewhere waits for that encode (the lease) instead of
  encoding again.
- A request's encoder latency is its arrival to its last item's rows (the LLM's part is not modelled).

Reported per mode: hit rate (node or fleet cache, over item lookups), encodes per request, encodes saved by the
lease, P50 / P90 request latency, encoder utilisation.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mimo_epd.common.stats import percentile


class _LRU:
    """Keys -> the time their value is there; bounded by bytes, least recently used out first."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.items: OrderedDict[int, tuple[float, int]] = OrderedDict()

    def get(self, key: int, now: float) -> bool:
        v = self.items.get(key)
        if v is None or v[0] > now:
            return False
        self.items.move_to_end(key)
        return True

    def put(self, key: int, ready: float, size: int) -> None:
        if size > self.budget or key in self.items:
            return
        self.items[key] = (ready, size)
        self.used += size
        while self.used > self.budget:
            _, (_, n) = self.items.popitem(last=False)
            self.used -= n


def trace(nodes: int, sessions: int, turns: int, catalog: int, zipf: float, rate: float, seed: int):
    """(arrival s, node, item ids) in time order, and each catalog item's tokens."""
    from mimo_epd.bench.cache_routing import catalog_tokens

    rng = np.random.default_rng(seed)
    tokens = catalog_tokens(rng, catalog)
    p = 1.0 / (rng.permutation(catalog) + 1) ** zipf
    p /= p.sum()
    n = nodes * sessions * turns
    times = np.cumsum(rng.exponential(1.0 / (rate * nodes), size=n))
    order = [(s, t) for t in range(turns) for s in range(nodes * sessions)]  # each session's turns in order
    reqs = [
        (float(times[i]), s % nodes, rng.choice(catalog, size=int(rng.integers(1, 3)), p=p))
        for i, (s, _) in enumerate(order)
    ]
    return reqs, tokens


def simulate(reqs, tokens, nodes: int, fleet: bool, a) -> dict:
    """One mode over one trace (`a`: the cost and size flags)."""
    row_bytes = a.hidden * 2
    caches = [_LRU(a.node_cache_mib << 20) for _ in range(nodes)]
    store = _LRU(nodes * a.segment_mib << 20) if fleet else None
    free = [0.0] * nodes
    busy = [0.0] * nodes
    encoding: dict[int, float] = {}  # item -> when its encode finishes (fleet-wide with the lease, else per node)
    node_encoding: list[dict[int, float]] = [{} for _ in range(nodes)]
    store_s = a.store_ms / 1e3
    lookups = hits = encodes = saved = 0
    lat = []
    for t, n, items in reqs:
        done = t
        for it in (int(x) for x in items):
            lookups += 1
            size = tokens[it] * row_bytes
            if caches[n].get(it, t):
                hits += 1
                continue
            if node_encoding[n].get(it, 0.0) > t:  # the node's in-flight table
                done = max(done, node_encoding[n][it])
                continue
            if store is not None and store.get(it, t):
                hits += 1
                caches[n].put(it, t + store_s, size)
                done = max(done, t + store_s)
                continue
            if store is not None and encoding.get(it, 0.0) > t:  # leased elsewhere: wait for its entry
                saved += 1
                ready = encoding[it] + store_s
                caches[n].put(it, ready, size)
                done = max(done, ready)
                continue
            cost = tokens[it] / 1000 * a.encode_ms_per_1k_tokens / 1e3
            start = max(t, free[n])
            free[n] = start + cost
            busy[n] += cost
            encodes += 1
            node_encoding[n][it] = encoding[it] = free[n]
            caches[n].put(it, free[n], size)
            if store is not None:
                store.put(it, free[n], size)
            done = max(done, free[n])
        lat.append(done - t)
    span = max(reqs[-1][0], max(free))
    return {
        "hit_rate": round(hits / lookups, 4),
        "encodes": encodes,
        "encodes_per_request": round(encodes / len(reqs), 4),
        "lease_waits_served": saved,
        "p50_ms": round(percentile(lat, 50) * 1e3, 2),
        "p90_ms": round(percentile(lat, 90) * 1e3, 2),
        "encoder_utilisation": round(sum(busy) / (nodes * span), 4),
    }


def run(a) -> dict:
    out = {}
    for nodes in a.nodes:
        reqs, tokens = trace(nodes, a.sessions, a.turns, a.catalog, a.zipf, a.rate, a.seed)
        local, fleet = simulate(reqs, tokens, nodes, False, a), simulate(reqs, tokens, nodes, True, a)
        out[str(nodes)] = {
            "requests": len(reqs),
            "node_local": local,
            "fleet": fleet,
            "ratios": {
                "hit_fleet_vs_node_local": round(fleet["hit_rate"] / max(local["hit_rate"], 1e-9), 3),
                "encodes_fleet_vs_node_local": round(fleet["encodes"] / max(local["encodes"], 1), 3),
                "p90_fleet_vs_node_local": round(fleet["p90_ms"] / max(local["p90_ms"], 1e-9), 3),
            },
        }
    return out
