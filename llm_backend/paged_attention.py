"""The KV pool tensors and one engine step's attention over them.

`KVPools` holds the tensors: per full-attention layer [full_slots, Hkv, D] (+ values [.., Dv]), per
sliding layer [swa_slots, 2*Hkv, D] (the bookkeeping of which slot is free is `kv.SlotPool`).

`PagedBatch` describes one step (every running request's new tokens: a prefill chunk or one decode
token) once, and the model calls `attend(layer, q, k, v)` for each layer: the new keys/values are written
into the pool with one scatter, then attention runs over each sequence's slots:
- full layers see every token of the sequence (the full pool's slot list),
- sliding layers only the last W tokens before the chunk plus the chunk (older SWA slots are released),
so a slot table is built per layer *type*, once per step, and shared by all layers of that type.
Decode tokens (one query per sequence) go through the paged decode kernel, prefill chunks through the
extend kernel: Triton on CUDA, the vectorised torch references on the CPU (`kernels.attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .kernels import triton_enabled
from .kernels.attention import decode_attention, decode_attention_torch, extend_attention, extend_attention_torch


class KVPools:
    def __init__(
        self,
        cfg,
        full_slots: int,
        swa_slots: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.k, self.v = {}, {}
        for i, kind in enumerate(cfg.layer_types):
            n = full_slots if kind == "full_attention" else swa_slots
            self.k[i] = torch.zeros(n, cfg.kv_heads(i), cfg.head_dim, dtype=dtype, device=device)
            self.v[i] = torch.zeros(n, cfg.kv_heads(i), cfg.v_head_dim, dtype=dtype, device=device)
        self.sliding = [k == "sliding_attention" for k in cfg.layer_types]
        self.window = cfg.window

    def add_sliding_layers(self, cfg, swa_slots: int) -> list[int]:
        """Appends `cfg`'s layers (all sliding: the MTP layers) as more sliding layers over the same SWA slots, so
        a token's slot holds their KV too and it lives, moves between tiers and is freed with the rest; returns
        their layer ids here."""
        ids = []
        like = next(iter(self.k.values()))
        for i, kind in enumerate(cfg.layer_types):
            if kind != "sliding_attention":
                raise ValueError("only sliding layers can share the SWA slots")
            j = len(self.sliding)
            shape = (swa_slots, cfg.kv_heads(i))
            self.k[j] = torch.zeros(*shape, cfg.head_dim, dtype=like.dtype, device=like.device)
            self.v[j] = torch.zeros(*shape, cfg.v_head_dim, dtype=like.dtype, device=like.device)
            self.sliding.append(True)
            ids.append(j)
        return ids

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


class SeqSlots(NamedTuple):
    """One sequence of a step: its full-pool and SWA-pool slots for tokens [0, start + n) (SWA entries outside the
    window may be None) and the step's new tokens [start, start + n). `full` is None in a batch that attends
    sliding layers only (the MTP layers)."""

    full: list[int] | None
    swa: list[int | None]
    start: int
    n: int


@dataclass
class _Group:
    """Sequences of one kind (decode or extend) for one layer type."""

    rows: torch.Tensor  # positions of their query rows in the step's token order
    slot_table: torch.Tensor  # [B, max_cols] int32
    kv_lens: torch.Tensor  # [B] int32
    q_starts: torch.Tensor | None  # [B+1] int32 (extend only)


def _table(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for b, r in enumerate(rows):
        table[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table.to(device), torch.tensor([len(r) for r in rows], dtype=torch.int32, device=device)


class PagedBatch:
    """One step: one `SeqSlots` per sequence, in token order."""

    def __init__(
        self,
        pools: KVPools,
        seqs: list[SeqSlots],
        use_triton: bool | None = None,
        wait=None,
    ):
        self.pools = pools
        self.seqs = seqs  # what another rank needs to build the same batch over its own pools (parallel/)
        self.wait = wait  # wait(layer): blocks until that layer's queued KV loads are done (kv.tiers.loader)
        device = next(iter(pools.k.values())).device
        self.use_triton = triton_enabled(device) if use_triton is None else use_triton
        w = pools.window
        new_full, new_swa, offsets = [], [], []
        tables = {False: {"decode": [], "extend": []}, True: {"decode": [], "extend": []}}
        rows = {"decode": [], "extend": []}
        q_lens = []
        t = 0
        for full, swa, start, n in seqs:
            end = start + n
            if full is not None:
                new_full.extend(full[start:end])
            new_swa.extend(swa[start:end])
            kind = "decode" if n == 1 else "extend"
            rows[kind].extend(range(t, t + n))
            if kind == "extend":
                q_lens.append(n)
            lo = max(0, start - w)
            window = swa[lo:end]
            if any(s is None for s in window):
                raise RuntimeError(f"a KV slot the window needs was released (tokens {lo}..{end})")
            if full is not None:
                tables[False][kind].append(full[:end])
            tables[True][kind].append(window)
            offsets.append(t)
            t += n
        self.num_tokens = t
        self.new_slots = {
            False: torch.tensor(new_full, dtype=torch.long, device=device),
            True: torch.tensor(new_swa, dtype=torch.long, device=device),
        }
        self.groups: dict[bool, list[_Group]] = {False: [], True: []}
        q_starts = (
            torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
            if q_lens
            else None
        )
        for sliding in (False, True):
            for kind in ("decode", "extend"):
                if not rows[kind] or not tables[sliding][kind]:
                    continue
                table, lens = _table(tables[sliding][kind], device)
                self.groups[sliding].append(
                    _Group(
                        torch.tensor(rows[kind], dtype=torch.long, device=device),
                        table,
                        lens,
                        q_starts if kind == "extend" else None,
                    )
                )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Writes this step's k/v [T, Hkv, D|Dv] into the layer's pool and returns attention [T, Hq, Dv]."""
        if self.wait is not None:
            self.wait(layer)
        sliding = self.pools.sliding[layer]
        k_cache, v_cache = self.pools.k[layer], self.pools.v[layer]
        slots = self.new_slots[sliding]
        k_cache[slots] = k.to(k_cache.dtype)
        v_cache[slots] = v.to(v_cache.dtype)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        sinks = sinks.float() if sinks is not None else None
        for g in self.groups[sliding]:
            qg = q[g.rows]
            if g.q_starts is None:
                fn = decode_attention if self.use_triton else decode_attention_torch
                og = fn(qg, k_cache, v_cache, g.slot_table, g.kv_lens, scale, sliding_window, sinks)
            else:
                fn = extend_attention if self.use_triton else extend_attention_torch
                og = fn(qg, k_cache, v_cache, g.slot_table, g.kv_lens, g.q_starts, scale, sliding_window, sinks)
            out[g.rows] = og.to(out.dtype)
        return out


class LayerOffset:
    """A batch whose layer l is pool layer `base + l`: how the MTP layers (numbered from 0 in their module) attend
    their KV, which the pools hold after the model's layers."""

    def __init__(self, batch: PagedBatch, base: int):
        self.batch, self.base = batch, base

    def attend(self, layer: int, *args):
        return self.batch.attend(self.base + layer, *args)


class ContiguousKV:
    """One sequence's KV in pools of its own, token i in slot i of both pools: how a single sequence runs through
    the model's one attention path (`model(ids, positions, kv)`: references, tests, parity checks). The pools are
    allocated on first use with the activations' dtype and device, and doubled when a sequence outgrows them."""

    def __init__(self, cfg, capacity: int = 1024):
        self.cfg, self.capacity = cfg, capacity
        self.pools: KVPools | None = None
        self.length = 0

    def _ensure(self, need: int, like: torch.Tensor) -> KVPools:
        if self.pools is None:
            self.pools = KVPools(self.cfg, self.capacity, self.capacity, like.dtype, like.device)
        while need > self.capacity:
            old, self.capacity = self.pools, self.capacity * 2
            self.pools = KVPools(self.cfg, self.capacity, self.capacity, like.dtype, like.device)
            for d_new, d_old in ((self.pools.k, old.k), (self.pools.v, old.v)):
                for layer, t in d_old.items():
                    d_new[layer][: t.shape[0]] = t
        return self.pools

    def step(self, start: int, n: int) -> "PagedBatch":
        """The `PagedBatch` of tokens [start, start + n); they must follow the tokens already stored."""
        if start != self.length:
            raise ValueError(f"ContiguousKV holds {self.length} tokens; the next step must start there, not at {start}")
        device = next(iter(self.pools.k.values())).device if self.pools is not None else None
        like = torch.empty(0, device=device) if device is not None else torch.empty(0)
        return _LazyPagedBatch(self, start, n, like)


class _LazyPagedBatch:
    """Builds the `PagedBatch` at the first `attend`, when the activations' dtype and device are known."""

    def __init__(self, kv: ContiguousKV, start: int, n: int, like: torch.Tensor):
        self.kv, self.start, self.n = kv, start, n
        self._batch: PagedBatch | None = None

    def attend(self, layer: int, q, k, v, scale, sliding_window, sinks):
        if self._batch is None:
            end = self.start + self.n
            pools = self.kv._ensure(end, k)
            slots = list(range(end))
            self._batch = PagedBatch(pools, [SeqSlots(slots, list(slots), self.start, self.n)])
            self.kv.length = end
        return self._batch.attend(layer, q, k, v, scale, sliding_window, sinks)
