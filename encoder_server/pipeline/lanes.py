"""Where each forward worker runs its tower: its lane.

The batcher runs up to N forwards at once, each on its own thread of the forward pool, each on its own batch.
A thread takes a lane the first time it runs a forward and keeps it:
- on a CPU every lane shares the one tower and runs it with the tuner's intra-op thread count (OpenMP's count
  is per calling thread, so it is set on the lane's own thread before each forward);
- on CUDA the same rule is encoder data parallelism: worker i runs on device i mod D (D = the devices given,
  `cuda` = every visible one) with its own CUDA stream and that device's replica of the tower, so two workers
  on one device overlap on two streams and workers on two devices run in parallel. Inputs move to the lane's
  device on its stream; the lane waits for its stream before handing the output back.
Invariants: a thread always uses the same lane; a device holds one replica however many lanes use it; a lane's
output equals the single-thread forward's (same weights, same inputs; the tests check it on the CPU path).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


def lane_devices(device: str, workers: int, visible: int | None = None) -> list[str]:
    """The device of each of `workers` lanes: `cuda` spreads them over the visible devices (worker i on
    device i mod D); `cuda:K` and `cpu` put all of them on that one device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        n = visible if visible is not None else torch.cuda.device_count()
        return [f"cuda:{i % max(1, n)}" for i in range(workers)]
    return [str(dev)] * workers


@dataclass
class Lane:
    index: int
    device: torch.device
    module: torch.nn.Module
    stream: object = None  # a torch.cuda.Stream on CUDA

    def context(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)  # type: ignore[arg-type]

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, threads: int = 0) -> torch.Tensor:
        if threads and self.device.type == "cpu" and threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # this thread's OpenMP count
        with self.context():
            out = self.module(pixel_values.to(self.device, non_blocking=True), grid_thw)
            if self.stream is not None:
                self.stream.synchronize()  # type: ignore[attr-defined]
        return out


class ForwardLanes:
    """`workers` lanes over `lane_devices(device, workers)`; `run` uses the calling thread's lane."""

    def __init__(self, module: torch.nn.Module, device: str, workers: int, visible: int | None = None):
        self.devices = [torch.device(d) for d in lane_devices(device, max(1, workers), visible)]
        home = next(iter(module.parameters())).device
        replicas: dict[torch.device, torch.nn.Module] = {home: module}
        self.lanes: list[Lane] = []
        for i, d in enumerate(self.devices):
            if d not in replicas:
                replicas[d] = copy.deepcopy(module).to(d)
            stream = torch.cuda.Stream(device=d) if d.type == "cuda" else None
            self.lanes.append(Lane(i, d, replicas[d], stream))
        self.replicas = len(replicas)
        self._local = threading.local()
        self._next = 0
        self._lock = threading.Lock()

    def lane(self) -> Lane:
        """The calling thread's lane (taken on its first call, round robin)."""
        lane = getattr(self._local, "lane", None)
        if lane is None:
            with self._lock:
                lane = self.lanes[self._next % len(self.lanes)]
                self._next += 1
            self._local.lane = lane
        return lane

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, threads: Callable[[], int] | int = 0):
        n = threads() if callable(threads) else threads
        return self.lane().run(pixel_values, grid_thw, n)
