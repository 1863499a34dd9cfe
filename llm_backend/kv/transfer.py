"""KV bytes between workers on Mooncake's transfer engine (`mooncake.engine.TransferEngine`), one per worker.

Each worker starts one engine (`initialize(host, "P2PHANDSHAKE", protocol, device)`: peer-to-peer handshake, no
metadata server; protocol "tcp" here, "rdma" where devices exist) and registers its KV pool tensors with it once
(`register_memory`). Its *session* is `host:rpc_port`: what a peer names as the target of a write. A pool is
described to a peer by its `PoolLayout`: per layer the base addresses of the key and value tensors and the bytes of
one slot's row (a pool tensor is [slots, heads, dim], contiguous, so slot s of layer i lives at base + s * row).

`write` moves the rows of (source slot -> destination slot) pairs of the full layers and of the sliding layers
from this worker's pools into a peer's: pairs are merged into runs contiguous on both sides (`runs`) and
every (layer, key/value, run) becomes one entry of one `batch_transfer_sync_write`, so a prefill chunk is one
call. A failed write (the peer is gone, an address outside what it registered) raises `TransferError`; nothing
here retries: the roles decide (docs/pd.md, failure rules).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from mimo_epd.common.transfer_buffer import engine_class, reachable_host

log = logging.getLogger(__name__)


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, count) runs of pairs contiguous on both sides, in order."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots for {len(dst)} destination slots")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


class TransferError(RuntimeError):
    """A KV write to a peer failed."""


@dataclass(frozen=True)
class LayerAddr:
    k_ptr: int
    v_ptr: int
    k_row: int  # bytes of one slot's keys
    v_row: int
    sliding: bool


@dataclass(frozen=True)
class PoolLayout:
    layers: tuple[LayerAddr, ...]

    @classmethod
    def of(cls, pools) -> "PoolLayout":
        """The layout of a `KVPools` (its tensors must stay allocated while a peer may write to them)."""
        out = []
        for i in sorted(pools.k):
            k, v = pools.k[i], pools.v[i]
            if not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError(f"layer {i}: KV pool tensors must be contiguous to be transferred")
            out.append(
                LayerAddr(
                    k.data_ptr(),
                    v.data_ptr(),
                    k[0].numel() * k.element_size(),
                    v[0].numel() * v.element_size(),
                    bool(pools.sliding[i]),
                )
            )
        return cls(tuple(out))

    def token_bytes(self) -> tuple[int, int]:
        """KV bytes of one token over the full layers and over the sliding layers."""
        full = sum(a.k_row + a.v_row for a in self.layers if not a.sliding)
        swa = sum(a.k_row + a.v_row for a in self.layers if a.sliding)
        return full, swa

    def check_peer(self, peer: "PoolLayout") -> None:
        """Raises ValueError unless `peer` has the same layers, kinds and row sizes (the same model and dtype)."""
        if len(peer.layers) != len(self.layers):
            raise ValueError(f"the peer's pools have {len(peer.layers)} layers, this model has {len(self.layers)}")
        for i, (a, b) in enumerate(zip(self.layers, peer.layers)):
            if (a.k_row, a.v_row, a.sliding) != (b.k_row, b.v_row, b.sliding):
                raise ValueError(
                    f"layer {i}: the peer's rows are {b.k_row}/{b.v_row} bytes (sliding {b.sliding}), "
                    f"this worker's {a.k_row}/{a.v_row} (sliding {a.sliding}): not the same model or dtype"
                )


class KVTransferEngine:
    """One worker's Mooncake engine with its pools registered."""

    def __init__(self, pools, host: str = "127.0.0.1", protocol: str = "tcp", device: str = ""):
        host = reachable_host(host)
        self.engine = engine_class()()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"the Mooncake transfer engine did not start on {host} ({protocol}): code {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.layout = PoolLayout.of(pools)
        self._tensors = [t for d in (pools.k, pools.v) for t in d.values()]  # kept alive while registered
        self._registered: list[int] = []
        for t in self._tensors:
            ptr, n = t.data_ptr(), t.numel() * t.element_size()
            if self.engine.register_memory(ptr, n) != 0:
                raise RuntimeError(f"the Mooncake transfer engine refused to register {n} bytes of KV pool")
            self._registered.append(ptr)
        self.bytes_written = 0
        self.writes = 0
        self._lock = threading.Lock()
        log.info("KV transfer engine %s (%s): %d pool tensors registered", self.session, protocol, len(self._tensors))

    def entries(
        self,
        peer: PoolLayout,
        full: tuple[list[int], list[int]],
        swa: tuple[list[int], list[int]],
    ) -> tuple[list[int], list[int], list[int]]:
        """(source addresses, destination addresses, lengths) that move `full` = (src slots, dst slots) of the full
        layers and `swa` of the sliding layers into `peer`'s pools."""
        srcs, dsts, lens = [], [], []
        full_runs, swa_runs = runs(*full), runs(*swa)
        for mine, theirs in zip(self.layout.layers, peer.layers):
            for s, d, n in swa_runs if mine.sliding else full_runs:
                for sp, dp, row in ((mine.k_ptr, theirs.k_ptr, mine.k_row), (mine.v_ptr, theirs.v_ptr, mine.v_row)):
                    srcs.append(sp + s * row)
                    dsts.append(dp + d * row)
                    lens.append(n * row)
        return srcs, dsts, lens

    def write(
        self,
        session: str,
        peer: PoolLayout,
        full: tuple[list[int], list[int]],
        swa: tuple[list[int], list[int]],
    ) -> int:
        """Writes the rows into the peer's pools (blocking); returns the bytes moved. Raises TransferError."""
        srcs, dsts, lens = self.entries(peer, full, swa)
        if not srcs:
            return 0
        rc = self.engine.batch_transfer_sync_write(session, srcs, dsts, lens)
        if rc != 0:
            raise TransferError(
                f"the KV write to {session} failed (Mooncake code {rc}): the peer is gone or refused it"
            )
        n = sum(lens)
        with self._lock:
            self.bytes_written += n
            self.writes += 1
        return n

    @property
    def ranks(self) -> tuple[tuple[str, PoolLayout], ...]:
        """(session, layout) of each rank's pools: one rank here (parallel/mirror.py `MirroredTransfer` has N)."""
        return ((self.session, self.layout),)

    def write_ranks(
        self,
        targets: tuple[tuple[str, PoolLayout], ...],
        full: tuple[list[int], list[int]],
        swa: tuple[list[int], list[int]],
    ) -> int:
        """`write` into a peer given rank by rank (one rank here: the peer must have one too)."""
        if len(targets) != 1:
            raise TransferError(f"the peer has {len(targets)} ranks, this worker 1")
        session, peer = targets[0]
        return self.write(session, peer, full, swa)

    def close(self) -> None:
        for ptr in self._registered:
            self.engine.unregister_memory(ptr)
        self._registered = []
