"""MiMo-V2.5's own vision tower (`vision_config.model_type: "mimovl"`), computed as vLLM's `MiMoVisionTransformer`
(the reference: `vllm/model_executor/models/mimo_v2_omni.py`; transformers has no MiMo ViT).

It descends from Qwen2.5-VL's tower (the same patch embedding, 2-D rotary, merge-block-major patch order, gated
MLP with biases, RMSNorm) and differs in:

- grouped-query attention: `num_heads` query heads, `num_key_value_heads` K/V heads, each `qk_channels` wide
  (64 when the config omits it, as the released one does); query head h reads K/V head h // (H / Hkv);
- window attention as a band, not as tiles: in a window block, token i of a frame attends token j of the same
  frame iff |i - j| <= `visual_token_window_size` (<= 0: no band), in the block's token order. Blocks with
  `vit_window_attn_types[i] == 1` run in column order (the merged grid of each frame transposed, each merge unit
  kept whole), the others in the processor's row order; the rotary angles travel with their tokens;
- attention sinks: a window block (`use_sink` and not in `fullatt_block_indexes`) adds `sinks[h]` to the logit of
  its frame's first key (key 0, in the block's order), where that key is inside the band;
- full attention only in `fullatt_block_indexes`, per frame group (one temporal patch), as in Qwen2.5-VL;
- a merger of RMSNorm and a two-layer GELU MLP without biases.

Checkpoint names (under `visual.` in the released checkpoint): `patch_embed.proj.weight`,
`blocks.{i}.{norm1,norm2}.weight`, `blocks.{i}.attn.qkv.{weight,bias}` (rows: [Q | K | V]),
`blocks.{i}.attn.proj.{weight,bias}`, `blocks.{i}.attn.sinks` (window blocks), `blocks.{i}.mlp.{gate,up,down}_proj`,
`merger.ln_q.weight`, `merger.mlp.{0,2}.weight`.

A config this file cannot compute exactly as the reference does is refused by field (`MiMoVisionConfig.check`):
`qk_channels != kv_channels` (the reference splits Q/K/V assuming they are equal), a window type outside {-1, 0, 1},
a block index past the depth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from mimo_epd.layers import RMSNorm

from .qwen2_5_vision import (
    _ACTIVATIONS,
    PatchEmbed,
    VisionMLP,
    apply_rotary,
    forward_in_groups,
    interleave_halves,
    item_seqlens,
    keep_qkv_rows,
    rotary_positions,
)

MODEL_TYPE = "mimovl"
# Queries per band-attention call on a CPU: the keys it reads are this plus twice the window.
BAND_CHUNK = 128


class MiMoVisionConfigError(ValueError):
    """A MiMo vision config this tower cannot compute exactly as the reference does (names the field)."""


@dataclass
class MiMoVisionConfig:
    """The fields of a released MiMo-V2.5 `vision_config` that define the computation (its defaults)."""

    depth: int = 28
    hidden_size: int = 1280
    intermediate_size: int = 4608
    out_hidden_size: int = 4096
    num_heads: int = 32
    num_key_value_heads: int = 8
    qk_channels: int = 64
    kv_channels: int = 64
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 2
    hidden_act: str = "silu"
    use_sink: bool = True
    visual_token_window_size: int = 64
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [0, 9, 18, 27])
    vit_window_attn_types: list[int] = field(default_factory=list)  # empty: -1 (row order) for every block
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_hf_dict(cls, d: dict) -> "MiMoVisionConfig":
        """From a checkpoint's config.json (its `vision_config`) or the `vision_config` itself; the released
        spelling `in_chans` is read as `in_channels`."""
        d = dict(d.get("vision_config", d))
        if "in_chans" in d and "in_channels" not in d:
            d["in_channels"] = d["in_chans"]
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in known and v is not None})
        cfg.check()
        # released keys this tower reads nothing from, but which must agree with the ones it does read
        for name, want in (
            ("num_query_groups", cfg.num_heads // cfg.num_key_value_heads),
            ("spatial_patch_size", cfg.patch_size),
        ):
            if d.get(name) is not None and d[name] != want:
                raise MiMoVisionConfigError(f"vision_config.{name}: {d[name]}, expected {want} from the other keys")
        return cfg

    def check(self) -> None:
        def bad(name: str, why: str) -> MiMoVisionConfigError:
            return MiMoVisionConfigError(f"vision_config.{name}: {why}")

        if self.qk_channels != self.kv_channels:
            raise bad(
                "kv_channels",
                f"{self.kv_channels} != qk_channels {self.qk_channels}: the reference tower splits Q, K and V "
                "assuming equal widths; refused rather than computed differently",
            )
        if self.num_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"{self.num_key_value_heads} does not divide num_heads {self.num_heads}")
        if self.qk_channels % 4:
            raise bad("qk_channels", f"{self.qk_channels}: the 2-D rotary needs a multiple of 4")
        if self.vit_window_attn_types and len(self.vit_window_attn_types) != self.depth:
            raise bad("vit_window_attn_types", f"{len(self.vit_window_attn_types)} entries for depth {self.depth}")
        if any(t not in (-1, 0, 1) for t in self.vit_window_attn_types):
            raise bad("vit_window_attn_types", f"{self.vit_window_attn_types}: each must be -1, 0 or 1")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise bad("fullatt_block_indexes", f"{self.fullatt_block_indexes} outside 0..{self.depth - 1}")
        if self.hidden_act not in _ACTIVATIONS:
            raise bad("hidden_act", f"{self.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}")

    @property
    def window_types(self) -> list[int]:
        return list(self.vit_window_attn_types) or [-1] * self.depth

    def has_sinks(self, block: int) -> bool:
        return self.use_sink and block not in self.fullatt_block_indexes

    def to_dict(self) -> dict:
        """The released spelling, as `make-checkpoint` writes it: `in_chans`, `model_type`, the derived
        `num_query_groups` and `spatial_patch_size`, and no `qk_channels` / `kv_channels` when they are the
        default 64 (the released config leaves them out)."""
        d = asdict(self)
        d["in_chans"] = d.pop("in_channels")
        d["num_query_groups"] = self.num_heads // self.num_key_value_heads
        d["spatial_patch_size"] = self.patch_size
        for k in ("qk_channels", "kv_channels"):
            if d[k] == 64:
                del d[k]
        return {"model_type": MODEL_TYPE, **d}


def band_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window: int,
    sinks: torch.Tensor | None,
    chunk: int = BAND_CHUNK,
) -> torch.Tensor:
    """Non-causal band attention inside each segment [cu[i], cu[i+1]) of a packed sequence.

    q [S, H, D]; k, v [S, H, D] (K/V heads already expanded to the query heads). Query i attends key j of its
    segment iff |i - j| <= `window` (every key when `window` <= 0). `sinks` [H], when given, is added to the
    logit of each segment's key 0 wherever key 0 is attended. Queries go `chunk` at a time against the keys
    their band can reach (chunk + 2 x window at most), so the cost is linear in the segment length."""
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    heads = q.shape[1]
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        n = b - a
        step = n if window <= 0 else chunk
        for qa in range(0, n, step):
            qb = min(n, qa + step)
            ka, kb = (0, n) if window <= 0 else (max(0, qa - window), min(n, qb + window))
            qi = torch.arange(qa, qb, device=q.device)[:, None]
            kj = torch.arange(ka, kb, device=q.device)[None, :]
            inside = (qi - kj).abs() <= window if window > 0 else torch.ones_like(qi - kj, dtype=torch.bool)
            bias = torch.zeros(heads, qb - qa, kb - ka, dtype=q.dtype, device=q.device)
            if sinks is not None and ka == 0:
                bias[:, :, 0] = sinks.to(q.dtype)[:, None]
            bias = bias.masked_fill(~inside, float("-inf"))
            qs, ks, vs = (t[a + s : a + e].transpose(0, 1) for t, s, e in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=bias[None])
            out[a + qa : a + qb] = o[0].transpose(0, 1)
    return out


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Non-causal attention inside each segment: one SDPA call per segment (frames differ in size rarely)."""
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
    return out


def _kernel_usable() -> bool:
    try:
        from ..kernels.band_attention import band_attention_triton  # noqa: F401
    except Exception:  # pragma: no cover - Triton missing on this build
        return False
    return True


class MiMoVisionAttention(nn.Module):
    """`kernel`: the Triton band kernel (K/V never expanded) instead of the torch twin; None = on CUDA only."""

    def __init__(self, cfg: MiMoVisionConfig, sinks: bool, kernel: bool | None = None):
        super().__init__()
        self.kernel = kernel
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_key_value_heads, cfg.qk_channels
        self.window = cfg.visual_token_window_size
        width = (cfg.num_heads + 2 * cfg.num_key_value_heads) * cfg.qk_channels
        self.qkv = nn.Linear(cfg.hidden_size, width, bias=True)
        self.proj = nn.Linear(cfg.num_heads * cfg.kv_channels, cfg.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if sinks else None
        # As in the Qwen tower (`apply_rotary`): the q and k rows are kept with each head's halves interleaved, so
        # the rotation is one complex multiply; loading reorders the checkpoint's rows, state_dict() restores them.
        rows = torch.arange(width).view(-1, cfg.qk_channels)
        rows[: cfg.num_heads + cfg.num_key_value_heads] = rows[: cfg.num_heads + cfg.num_key_value_heads][
            :, interleave_halves(cfg.qk_channels)
        ]
        keep_qkv_rows(self, rows.reshape(-1))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rotation: torch.Tensor, full: bool) -> torch.Tensor:
        s, h, g = x.shape[0], self.heads, self.kv_heads
        qkv = self.qkv(x).view(s, h + 2 * g, self.dim)
        qk = apply_rotary(qkv[:, : h + g], rotation)  # q and k in one pass
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + g :]
        if self.kernel or (self.kernel is None and x.is_cuda and _kernel_usable()):
            from ..kernels.band_attention import band_attention_triton

            window, sinks = (0, None) if full else (self.window, self.sinks)
            return self.proj(band_attention_triton(q, k, v, cu_seqlens, window, sinks).reshape(s, -1))
        if g != h:  # query head i reads K/V head i // (h / g)
            k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
        if full:
            o = full_attention(q, k, v, cu_seqlens)
        else:
            o = band_attention(q, k, v, cu_seqlens, self.window, self.sinks)
        return self.proj(o.reshape(s, -1))


class MiMoVisionBlock(nn.Module):
    def __init__(self, cfg: MiMoVisionConfig, index: int, kernel: bool | None = None):
        super().__init__()
        self.full = index in cfg.fullatt_block_indexes
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MiMoVisionAttention(cfg, sinks=cfg.has_sinks(index), kernel=kernel)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rotation, self.full)
        return x + self.mlp(self.norm2(x))


class MiMoPatchMerger(nn.Module):
    """RMSNorm, then each merge x merge group of patches -> one LLM token: Linear, GELU, Linear, no biases."""

    def __init__(self, cfg: MiMoVisionConfig):
        super().__init__()
        self.in_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(self.in_dim, self.in_dim, bias=False),
            nn.GELU(),
            nn.Linear(self.in_dim, cfg.out_hidden_size, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.in_dim))


def column_order(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """Index over merged tokens that puts each frame's merged grid in column-major order (items and frames
    stay where they are): the token order of the column window blocks."""
    out, offset = [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        out.append(torch.arange(t * gh * gw).view(t, gh, gw).transpose(1, 2).reshape(-1) + offset)
        offset += t * gh * gw
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


class MiMoVisionTower(nn.Module):
    """pixel_values [S, C*T*P*P] (packed, the processor's patch order), grid_thw [n, 3] -> [S / merge^2, out].
    `kernel`: attention through the Triton band kernel (encoder_server/kernels/band_attention.py); None = on CUDA."""

    def __init__(self, cfg: MiMoVisionConfig, kernel: bool | None = None):
        super().__init__()
        cfg.check()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg.in_channels, cfg.hidden_size, cfg.patch_size, cfg.temporal_patch_size)
        self.blocks = nn.ModuleList([MiMoVisionBlock(cfg, i, kernel) for i in range(cfg.depth)])
        self.merger = MiMoPatchMerger(cfg)
        half = cfg.qk_channels // 2  # each of h and w rotates half of the rotated dimensions
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def activation_width(self) -> int:
        """Floats per patch row of the widest activation a block allocates (qkv, or the MLP's gate and up)."""
        c = self.config
        return max((c.num_heads + 2 * c.num_key_value_heads) * c.qk_channels, c.intermediate_size)

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return grid_thw.prod(-1) // (self.config.spatial_merge_size**2)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """On a CPU, a packed batch whose widest activation would pass the CPU bound runs as groups of whole
        items (`cpu_groups`); items never attend each other, so the rows are the same."""
        return forward_in_groups(self._forward_packed, pixel_values, grid_thw, self.activation_width, self.device)

    def _forward_packed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg, dev = self.config, self.device
        unit = cfg.spatial_merge_size**2
        x = self.patch_embed(pixel_values.to(dev))
        s = x.shape[0]
        cu = item_seqlens(grid_thw).to(dev)
        col = column_order(grid_thw, cfg.spatial_merge_size).to(dev)
        back = torch.argsort(col)

        def reorder(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # whole merge units move together
            return t.reshape(s // unit, unit, -1)[index].reshape(s, -1)

        freqs = rotary_positions(grid_thw, cfg.spatial_merge_size).to(dev)[..., None].float() * self.inv_freq
        angles = freqs.flatten(1)  # [S, qk/2]: h-angles then w-angles
        by_row = torch.complex(angles.cos(), angles.sin())
        by_col = reorder(by_row, col)
        in_col = False
        for block, kind in zip(self.blocks, cfg.window_types):
            if (kind == 1) != in_col:
                x, in_col = reorder(x, back if in_col else col), not in_col
            x = block(x, cu, by_col if in_col else by_row)
        if in_col:
            x = reorder(x, back)
        return self.merger(x)
