"""Host/store -> device KV copies, layer by layer.

Loads are queued while the scheduler admits requests (`PendingLoads`: a hit that ends in the host tier or in the
shared store gets fresh device slots at once, their KV is copied later). The runner turns the queue into one
`LayerwiseLoad` per forward: the copies run in layer order on a side thread (CPU) or a side stream (CUDA), and
layer l's attention waits only for layer l's copies, so loading overlaps the forward of the earlier layers.
The time attention actually waited is the *exposed* load time; the rest of the copy time was hidden.

`flush()` runs what is queued synchronously: the tiers call it before they read device slots or free host slots
that a queued copy still uses, so a copy can never read or write a slot after it changed owner.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class LoadStats:
    loads: int = 0  # forwards that had copies to run
    copy_s: float = 0.0  # time spent copying (side thread / stream)
    exposed_s: float = 0.0  # time attention waited for a layer's copies
    flushes: int = 0  # synchronous flushes (a tier needed the slots before the forward)

    def as_dict(self) -> dict:
        return {
            "loads": self.loads,
            "copy_ms": round(self.copy_s * 1e3, 3),
            "exposed_ms": round(self.exposed_s * 1e3, 3),
            "hidden_ms": round(max(0.0, self.copy_s - self.exposed_s) * 1e3, 3),
            "flushes": self.flushes,
        }


@dataclass
class PendingLoads:
    """Copies queued for the next forward. Host copies are index lists; store copies carry their tensors."""

    host: dict = field(default_factory=lambda: {False: ([], []), True: ([], [])})  # sliding -> (src, dst)
    tensors: list = field(default_factory=list)  # (sliding, dst slots, {layer: (k, v)})
    srcs: dict = field(default_factory=lambda: {False: set(), True: set()})  # host slots read
    dsts: dict = field(default_factory=lambda: {False: set(), True: set()})  # device slots written

    def add_host(self, sliding: bool, src: list[int], dst: list[int]) -> None:
        s, d = self.host[sliding]
        s.extend(src)
        d.extend(dst)
        self.srcs[sliding].update(src)
        self.dsts[sliding].update(dst)

    def add_tensors(self, sliding: bool, dst: list[int], per_layer: dict) -> None:
        self.tensors.append((sliding, list(dst), per_layer))
        self.dsts[sliding].update(dst)

    def touches(self, sliding: bool, host=(), device=()) -> bool:
        """Whether a queued copy reads one of these host slots or writes one of these device slots."""
        return any(s in self.srcs[sliding] for s in host) or any(s in self.dsts[sliding] for s in device)

    def __bool__(self) -> bool:
        return bool(self.tensors or self.host[False][0] or self.host[True][0])

    def take(self) -> "PendingLoads":
        out = PendingLoads(self.host, self.tensors)
        self.host = {False: ([], []), True: ([], [])}
        self.tensors = []
        self.srcs, self.dsts = {False: set(), True: set()}, {False: set(), True: set()}
        return out


class LoadPlan:
    """One forward's copies, as index tensors on the right devices."""

    def __init__(self, loads: PendingLoads, device_pools, host_kv):
        dev = next(iter(device_pools.k.values())).device
        self.pools, self.host_kv = device_pools, host_kv
        self.idx = {}
        for sliding, (src, dst) in loads.host.items():
            if src:
                self.idx[sliding] = (
                    torch.tensor(src, dtype=torch.long),
                    torch.tensor(dst, dtype=torch.long, device=dev),
                )
        self.tensors = [(sl, torch.tensor(dst, dtype=torch.long, device=dev), per) for sl, dst, per in loads.tensors]
        self.nbytes = 0

    def apply_layer(self, layer: int, non_blocking: bool = False) -> None:
        sliding = self.pools.sliding[layer]
        k, v = self.pools.k[layer], self.pools.v[layer]
        if sliding in self.idx:
            src, dst = self.idx[sliding]
            hk, hv = self.host_kv.k[layer][src], self.host_kv.v[layer][src]
            k[dst] = hk.to(k.device, non_blocking=non_blocking)
            v[dst] = hv.to(v.device, non_blocking=non_blocking)
            self.nbytes += hk.numel() * hk.element_size() + hv.numel() * hv.element_size()
        for sl, dst, per in self.tensors:
            if sl == sliding and layer in per:
                tk, tv = per[layer]
                k[dst] = tk.to(k.device, k.dtype, non_blocking=non_blocking)
                v[dst] = tv.to(v.device, v.dtype, non_blocking=non_blocking)
                self.nbytes += tk.numel() * tk.element_size() + tv.numel() * tv.element_size()

    def apply_all(self) -> None:
        for layer in self.pools.k:
            self.apply_layer(layer)


class LayerwiseLoad:
    """Runs a plan layer by layer next to the forward; `wait(layer)` blocks until that layer's copies are done."""

    def __init__(self, plan: LoadPlan, stats: LoadStats):
        self.plan, self.stats = plan, stats
        self.layers = list(plan.pools.k)
        dev = next(iter(plan.pools.k.values())).device
        self.cuda = dev.type == "cuda"
        self.error: BaseException | None = None
        stats.loads += 1
        if self.cuda:
            # A side stream: layer l's copies are ordered before event l; attention of layer l waits on it.
            self.stream = torch.cuda.Stream(device=dev)
            self.events = {}
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            self.stream.wait_stream(torch.cuda.current_stream(dev))  # after the writes of the previous step
            with torch.cuda.stream(self.stream):
                for layer in self.layers:
                    plan.apply_layer(layer, non_blocking=True)
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record(self.stream)
                    self.events[layer] = ev
            self._start = start
        else:
            self.done = {layer: threading.Event() for layer in self.layers}
            self.thread = threading.Thread(target=self._run, name="kv-layer-load", daemon=True)
            self._t0 = time.perf_counter()
            self.thread.start()

    def _run(self) -> None:
        try:
            for layer in self.layers:
                self.plan.apply_layer(layer)
                self.done[layer].set()
        except BaseException as e:  # noqa: BLE001 - reported to the forward by wait()
            self.error = e
            for ev in self.done.values():
                ev.set()
        finally:
            self.copy_s = time.perf_counter() - self._t0

    def wait(self, layer: int) -> None:
        if self.cuda:
            ev = self.events.get(layer)
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
            return
        ev = self.done.get(layer)
        if ev is None:
            return
        if not ev.is_set():
            t0 = time.perf_counter()
            ev.wait()
            self.stats.exposed_s += time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError(f"loading KV for layer {layer} failed: {self.error}") from self.error

    def finish(self) -> None:
        """After the forward: every layer is loaded (a model that skipped a layer still gets its KV)."""
        if self.cuda:
            last = self.events[self.layers[-1]]
            last.synchronize()
            self.stats.copy_s += self._start.elapsed_time(last) / 1e3
            return
        self.thread.join()
        self.stats.copy_s += self.copy_s
        if self.error is not None:
            raise RuntimeError(f"loading KV failed: {self.error}") from self.error
