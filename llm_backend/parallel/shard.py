"""What one rank of a model-parallel replica holds: the slicing rules of tensor and expert parallelism, written once.

A `Shard` is (rank, size, expert_parallel, dp_rank, dp_size): `rank` of `size` tensor-parallel ranks, in data-parallel
rank `dp_rank` of `dp_size` (data-parallel attention, parallel/data.py: each DP rank holds the whole attention and
its own requests, the experts are split over all dp_size x size ranks). Its rules, by parameter (vLLM's and SGLang's meaning of the flags):

- attention: query heads split evenly (`num_attention_heads % size == 0`), rank r holding heads
  [r * Hq/N, (r+1) * Hq/N); KV heads split the same way when there are at least N of them, else replicated:
  rank r holds KV head r // (N / Hkv) (vLLM's rule; N must then be a multiple of Hkv). Full and sliding layers
  each by their own KV head count. q/k/v are column-parallel (rows of the weight, and the bias), o_proj
  row-parallel (columns), the per-head sink logits split with the query heads;
- the dense MLP: gate/up column-parallel, down row-parallel (`intermediate_size % size == 0`);
- the routed experts: with tensor parallelism every rank holds every expert's slice of the intermediate
  dimension (gate and up rows, down columns); with expert parallelism rank r holds whole experts
  [r * E/N, (r+1) * E/N) (`n_routed_experts % size == 0`), r and N counted over every rank of every DP rank
  (data-parallel attention needs expert parallelism);
- the token embedding and the LM head: split by vocabulary (`vocab_size % size == 0`), rank r holding ids
  [r * V/N, (r+1) * V/N); the embedding is summed over ranks, the logits gathered;
- everything else is replicated: the norms, the router (fp32, so every rank picks the same experts), the MTP
  layers' `eh_proj`.

The same rules serve the loader (each tensor read and sliced to this rank's part before it is kept: a rank never
holds another rank's part of more than the one tensor being read; an FP8 weight's block scales are cut with it,
block for block), the model's constructors (local shapes) and the KV pools (this rank's KV heads). A shape a rule
cannot split is refused by `check`, naming the field; an FP8 cut off a block edge by the loader, naming the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

_ATTN = re.compile(r"(?:^|\.)self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
_MLP = re.compile(r"(?:^|\.)mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERTS = re.compile(r"(?:^|\.)mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.(?:mtp\.)?layers\.(\d+)\.")


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def single(self) -> bool:
        """Nothing of the model is split here (no tensor and no data parallelism)."""
        return self.size == 1 and self.dp_size == 1

    @property
    def world_rank(self) -> int:
        return self.dp_rank * self.size + self.rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.size

    # --- shapes -------------------------------------------------------------------------------------------
    def part(self, n: int) -> slice:
        """This rank's even part of n things."""
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def kv_part(self, kv_heads: int) -> slice:
        """This rank's KV heads: an even part, or the one replicated head r // (N / Hkv)."""
        if kv_heads >= self.size:
            return self.part(kv_heads)
        h = self.rank // (self.size // kv_heads)
        return slice(h, h + 1)

    def experts(self, n: int) -> slice:
        """The experts this rank holds whole (all of them without expert parallelism): an even part over every
        rank of every DP rank."""
        if not self.expert_parallel:
            return slice(0, n)
        k = n // self.world_size
        return slice(self.world_rank * k, (self.world_rank + 1) * k)

    def moe_intermediate(self, inter: int) -> int:
        """This rank's part of each expert's intermediate dimension (whole with expert parallelism)."""
        return inter if self.expert_parallel else inter // self.size

    def attention_config(self, cfg):
        """`cfg` with this rank's head counts: what the KV pools (and the attention modules) hold here."""
        if self.size == 1:
            return cfg
        full = [i for i, t in enumerate(cfg.layer_types) if t != "sliding_attention"]
        swa = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
        kv_full = cfg.kv_heads(full[0]) if full else cfg.num_key_value_heads
        kv_swa = cfg.kv_heads(swa[0]) if swa else cfg.kv_heads(0)
        return replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // self.size,
            num_key_value_heads=_len(self.kv_part(kv_full)),
            swa_num_key_value_heads=_len(self.kv_part(kv_swa)),
        )

    def check(self, cfg) -> None:
        """Raises ValueError naming the config field this shard cannot split (one line)."""
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a tensor-parallel size {self.size}")
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"data-parallel rank {self.dp_rank} of a data-parallel size {self.dp_size}")
        if self.single:
            return
        if self.dp_size > 1 and not self.expert_parallel:
            raise ValueError(
                f"--data-parallel-size {self.dp_size} needs --enable-expert-parallel (the experts split whole over the "
                "DP ranks; a slice of every expert on every DP rank is not built)"
            )
        n = self.size
        why = f"--tensor-parallel-size {n}"
        need = [("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size)]
        need.append(("intermediate_size", cfg.intermediate_size))
        if not self.expert_parallel and "sparse" in cfg.mlp_layer_types:
            need.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        for name, value in need:
            if value % n:
                raise ValueError(f"{why}: the model's {name} ({value}) is not a multiple of {n}")
        w = self.world_size
        if self.expert_parallel and cfg.n_routed_experts % w:
            where = f"{why} x --data-parallel-size {self.dp_size}" if self.dp_size > 1 else why
            raise ValueError(f"{where}: the model's n_routed_experts ({cfg.n_routed_experts}) is not a multiple of {w}")
        if cfg.quant is not None and cfg.quant.mxfp4_block:
            raise ValueError(f"{why}: MXFP4 experts kept packed are not split yet; use --fp8-weights dequantize")
        for kind in sorted(set(cfg.layer_types)):
            i = cfg.layer_types.index(kind)
            kv = cfg.kv_heads(i)
            if (kv >= n and kv % n) or (kv < n and n % kv):
                raise ValueError(f"{why}: {kind} layers have {kv} KV heads, neither a multiple nor a divisor of {n}")

    # --- the loader's rule ------------------------------------------------------------------------------
    def cuts(self, name: str, shape: tuple[int, ...], cfg) -> dict[int, list[slice]]:
        """The index ranges this rank keeps of parameter `name` (our name; `shape` the whole model's), per
        dimension: dimensions not named are kept whole; several ranges are joined in order."""
        if self.single:
            return {}
        m = _ATTN.search(name)
        if m:
            proj = m.group(1)
            if proj == "o_proj":
                return {1: [self._rows(self.part(cfg.num_attention_heads), cfg.v_head_dim)]}
            if proj == "q_proj":
                return {0: [self._rows(self.part(cfg.num_attention_heads), cfg.head_dim)]}
            dim = cfg.head_dim if proj == "k_proj" else cfg.v_head_dim
            return {0: [self._rows(self.kv_part(self._kv_heads(name, cfg)), dim)]}
        if name.endswith("self_attn.sinks"):
            return {0: [self.part(cfg.num_attention_heads)]}
        m = _MLP.search(name)
        if m:
            return {1: [self.part(shape[1])]} if m.group(1) == "down_proj" else {0: [self.part(shape[0])]}
        m = _EXPERTS.search(name)
        if m:
            out = {0: [self.experts(shape[0])]}
            if self.expert_parallel:
                return out
            if m.group(1) == "down_proj":
                return {**out, 2: [self.part(shape[2])]}
            inter, local = shape[1] // 2, self.part(shape[1] // 2)
            return {**out, 1: [local, slice(inter + local.start, inter + local.stop)]}
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return {0: [self.part(shape[0])]}
        return {}

    def take(self, name: str, full: torch.Tensor, cfg) -> torch.Tensor:
        """This rank's part of parameter `name` (our name, the model's full shape `full`)."""
        return _apply(full, self.cuts(name, tuple(full.shape), cfg))

    def take_scale(self, name: str, weight_shape: tuple[int, ...], scale: torch.Tensor, cfg) -> torch.Tensor:
        """This rank's part of the block scales of FP8 weight `name` (the whole weight's shape `weight_shape`): the
        weight's cuts in blocks. A cut that does not fall on a block edge is refused (ValueError naming it): an FP8
        weight is never re-scaled to fit a split."""
        cuts = {}
        for dim, ranges in self.cuts(name, weight_shape, cfg).items():
            block = -(-weight_shape[dim] // scale.shape[dim])
            mapped = []
            for r in ranges:
                if r.start % block or (r.stop % block and r.stop != weight_shape[dim]):
                    raise ValueError(
                        f"{name}: this rank's rows / columns {r.start}..{r.stop} of {weight_shape[dim]} do not fall on "
                        f"the FP8 block of {block}; use --fp8-weights dequantize at this --tensor-parallel-size"
                    )
                mapped.append(slice(r.start // block, -(-r.stop // block)))
            cuts[dim] = mapped
        return _apply(scale, cuts)

    def local_shape(self, name: str, full_shape: tuple[int, ...], cfg) -> tuple[int, ...]:
        return tuple(self.take(name, torch.empty(full_shape, device="meta"), cfg).shape)

    def _rows(self, heads: slice, dim: int) -> slice:
        return slice(heads.start * dim, heads.stop * dim)

    def _heads_cols(self, heads: int, dim: int) -> slice:
        return self._rows(self.part(heads), dim)

    @staticmethod
    def _kv_heads(name: str, cfg) -> int:
        """The KV head count of the layer `name` belongs to (an MTP layer is a sliding layer of the model's shape)."""
        if ".mtp." in name:
            return cfg.swa_num_key_value_heads or 2 * cfg.num_key_value_heads
        m = _LAYER.match(name)
        return cfg.kv_heads(int(m.group(1)) if m else 0)


def whole_kv_heads(cfg, layers) -> dict[int, int]:
    """The unsplit model's KV heads of each KV pool layer id in `layers` (the MTP layers' ids follow the main
    layers': engine/speculative.py `reserve_layers`)."""
    n = cfg.num_hidden_layers
    return {i: cfg.kv_heads(i) if i < n else Shard._kv_heads("model.mtp.", cfg) for i in layers}


def _apply(t: torch.Tensor, cuts: dict[int, list[slice]]) -> torch.Tensor:
    for dim, ranges in cuts.items():
        parts = [t.narrow(dim, r.start, r.stop - r.start) for r in ranges]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return t


def _len(s: slice) -> int:
    return s.stop - s.start


SINGLE = Shard()
