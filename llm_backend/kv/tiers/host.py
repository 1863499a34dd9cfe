"""The host KV tier's data: a node's host copy (`HostCopy`), the host tensors (`HostKV`), the bytes a token's KV
takes (`token_bytes`) and the tiers' counters (`TierStats`). The logic that moves KV between the device, the host
and the shared store is the tiered radix cache (cache.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class HostCopy:
    __slots__ = ("pages", "swa", "stamp")

    def __init__(self, pages: list[int] | None = None, swa: dict[int, int] | None = None, stamp: int = 0):
        self.pages = pages  # host full pages covering the node's tokens (None: not on the host)
        self.swa = swa if swa is not None else {}  # node token index -> host SWA slot (window tokens only)
        self.stamp = stamp

    @property
    def empty(self) -> bool:
        return self.pages is None and not self.swa


class HostKV:
    """Host tensors: per full layer [full_slots, Hkv, D] (+ V), per sliding layer [swa_slots, Hkv, D] (+ V). Pinned
    on CUDA so host->device copies are asynchronous."""

    def __init__(self, like, full_slots: int, swa_slots: int):
        dev = next(iter(like.k.values())).device
        pin = dev.type == "cuda"
        self.k, self.v = {}, {}
        for layer, t in like.k.items():
            n = swa_slots if like.sliding[layer] else full_slots
            self.k[layer] = torch.zeros((max(n, 1), *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            self.v[layer] = torch.zeros((max(n, 1), *like.v[layer].shape[1:]), dtype=t.dtype, pin_memory=pin)
        self.sliding = like.sliding


def copy_to_host(pools, host: HostKV, dev_idx: list[int], host_idx: list[int], sliding: bool) -> int:
    """Copies the device rows `dev_idx` of every full (or every sliding) layer of `pools` into the host rows
    `host_idx`; returns the bytes moved. The one device -> host copy: the tiered cache's, and each model-parallel
    rank's on its own heads (llm_backend/parallel/rank.py)."""
    if not dev_idx:
        return 0
    moved = 0
    for layer in pools.k:
        if pools.sliding[layer] != sliding:
            continue
        for src, dst in ((pools.k, host.k), (pools.v, host.v)):
            rows = src[layer][torch.tensor(dev_idx, device=src[layer].device)]
            dst[layer][torch.tensor(host_idx, device=dst[layer].device)] = rows.to(dst[layer].device)
            moved += rows.numel() * rows.element_size()
    return moved


def read_rows(pools, host: HostKV | None, sliding: bool, rows: list[tuple[bool, int]]) -> dict:
    """Every full (or every sliding) layer's KV of `rows` — (on the host, slot) each, from the device pools or the
    host rows — as CPU tensors {layer: (k [n, heads, dim], v)}: a page for the shared store. The tiered cache's and
    each model-parallel rank's on its own heads (llm_backend/parallel/rank.py)."""
    out = {}
    dev = [i for i, (on_host, _) in enumerate(rows) if not on_host]
    hst = [i for i, (on_host, _) in enumerate(rows) if on_host]
    for layer in pools.k:
        if pools.sliding[layer] != sliding:
            continue
        kv = []
        for src_dev, src_host in ((pools.k, host.k if host else None), (pools.v, host.v if host else None)):
            t = torch.empty((len(rows), *src_dev[layer].shape[1:]), dtype=src_dev[layer].dtype)
            if dev:
                t[dev] = src_dev[layer][torch.tensor([rows[i][1] for i in dev], device=src_dev[layer].device)].cpu()
            if hst:
                assert src_host is not None
                t[hst] = src_host[layer][torch.tensor([rows[i][1] for i in hst])].cpu()
            kv.append(t)
        out[layer] = (kv[0], kv[1])
    return out


def token_bytes(pools) -> tuple[int, int]:
    """KV bytes per token of the full layers and of the sliding layers of `pools` (a KVPools)."""
    full = swa = 0
    for layer, k in pools.k.items():
        b = (k[0].numel() + pools.v[layer][0].numel()) * k.element_size()
        if pools.sliding[layer]:
            swa += b
        else:
            full += b
    return full, swa


@dataclass
class TierStats:
    hit_device: int = 0  # matched tokens already on the device
    hit_host: int = 0  # matched tokens loaded from the host
    hit_store: int = 0  # matched tokens loaded from the shared store
    pages_d2h: int = 0  # full pages written back device -> host
    pages_h2d: int = 0  # full pages loaded host -> device
    pages_s2d: int = 0  # full pages loaded store -> device
    pages_to_store: int = 0  # pages handed to the store
    swa_d2h: int = 0  # SWA tokens written to the host (write-back, back-fill)
    swa_h2d: int = 0
    swa_s2d: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    bytes_s2d: int = 0
    host_evictions: int = 0  # host copies dropped or host-only nodes removed
    backfills: int = 0
    fallbacks: int = 0  # matches cut to the device part: the device could not make room for the load


@dataclass
class HostUse:
    """One host pool: units held by tree nodes, free, in total (pages for full KV, slots for SWA)."""

    held: int
    free: int
    total: int


@dataclass
class HostAccounting:
    host_full_pages: HostUse
    host_swa: HostUse
