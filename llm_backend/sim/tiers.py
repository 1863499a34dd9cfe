"""Pricing the KV tiers' loads in simulated steps (TTFT with loads at PCIe / network bandwidth vs
recompute).

A simulated worker may run the real `TieredRadixCache` (llm_backend.kv.tiers) below its device pools in bookkeeping mode:
slots, pages and bytes move, no tensor does. A hit that ends in the host tier or the shared store queues its KV
for the next forward, exactly as in the engine; here the bytes of that step's loads are priced:

- host -> device at `pcie_bytes_per_s` per GPU of the worker (each GPU loads its own shard of the heads, so
  the worker's aggregate is gpus x that);
- store -> device at `store_bytes_per_s` per worker (the node's network link to the store; the PCIe hop after it
  is faster and pipelined behind it);
- `overlap` (the engine's layerwise loading): layer l's attention waits only for layer l's copy, so a step with
  loads takes max(compute, load + compute / layers) — the copies run beside the forward and only the last
  layer's compute cannot hide behind them; without overlap it takes compute + load.

Write-backs (device -> host, device -> store) run asynchronously beside the forward (a side stream, the store's
writer thread) and are not priced. The recompute alternative is the same worker without tiers: a miss in the
device pools is prefilled again, priced by the cost model like any prefill.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierLinks:
    pcie_bytes_per_s: float = 50e9  # per GPU, host -> device (PCIe Gen5 x16: 64 GB/s peak, ~50 GB/s measured)
    store_bytes_per_s: float = 12.5e9  # per worker, store -> worker (a 100 Gb/s NIC)
    store_latency_s: float = 0.0  # per step that reads the store: one lookup round trip (measured per store)
    gpus: int = 1
    layers: int = 1
    overlap: bool = True

    def load_seconds(self, host_bytes: int, store_bytes: int) -> float:
        h = host_bytes / (self.pcie_bytes_per_s * max(1, self.gpus)) if host_bytes else 0.0
        s = store_bytes / self.store_bytes_per_s + self.store_latency_s if store_bytes else 0.0
        return h + s

    def step_seconds(self, compute_s: float, load_s: float) -> float:
        if load_s <= 0:
            return compute_s
        if self.overlap:
            return max(compute_s, load_s + compute_s / max(1, self.layers))
        return compute_s + load_s


@dataclass
class LoadTotals:
    """What a worker's loads cost over a run (seconds are virtual)."""

    loads: int = 0  # steps that loaded something
    host_bytes: int = 0
    store_bytes: int = 0
    load_s: float = 0.0  # copy time
    exposed_s: float = 0.0  # step time added by the copies (load_s - exposed_s was hidden behind compute)

    def add(self, host_bytes: int, store_bytes: int, load_s: float, compute_s: float, step_s: float) -> None:
        self.loads += 1
        self.host_bytes += host_bytes
        self.store_bytes += store_bytes
        self.load_s += load_s
        self.exposed_s += step_s - compute_s

    def as_dict(self) -> dict:
        return {
            "loads": self.loads,
            "host_bytes": self.host_bytes,
            "store_bytes": self.store_bytes,
            "load_s": round(self.load_s, 4),
            "exposed_s": round(self.exposed_s, 4),
        }
