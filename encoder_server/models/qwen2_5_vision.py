"""The Qwen2.5-VL vision tower (the encoder MiMo-VL uses), written to match transformers'
`Qwen2_5_VisionTransformerPretrainedModel` parameter for parameter and op for op.

Parameter names are the ones transformers saves, so a checkpoint's `state_dict` loads unchanged.

Input is a *packed* batch: the patches of several images (or video clips) concatenated along the
first axis, described by `grid_thw` (one `(t, h, w)` row per item, in patches). Attention is
block-diagonal: per window in the windowed blocks, per item in the full-attention blocks
(`fullatt_block_indexes`), so packing never lets one image see another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from mimo_epd.layers import RMSNorm


@dataclass
class VisionConfig:
    """The fields of transformers' `Qwen2_5_VLVisionConfig` that define the computation."""

    depth: int = 32
    hidden_size: int = 1280
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> "VisionConfig":
        """Builds from a transformers config dict: a vision config, or a full Qwen2.5-VL config
        (whose `vision_config` is used)."""
        if "vision_config" in d:
            d = d["vision_config"]
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        rope = d.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        kwargs["fullatt_block_indexes"] = list(kwargs.get("fullatt_block_indexes", cls().fullatt_block_indexes))
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride: one linear map per (t, p, p) patch."""

    def __init__(self, in_channels: int, hidden_size: int, patch_size: int, temporal_patch_size: int):
        super().__init__()
        self.in_channels = in_channels
        k = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=k, stride=k, bias=False)

    def set_input_normalization(self, mean, std) -> None:
        """Per-channel mean/std (of 0..1 pixels) for raw uint8 patch input: normalisation is folded into the
        projection, (x - 255 m) / (255 s) @ W = x @ (W / 255 s) - (255 m / 255 s) @ W."""
        self._norm = (torch.tensor(mean, dtype=torch.float32) * 255.0, torch.tensor(std, dtype=torch.float32) * 255.0)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # Kernel == stride and one output position per patch, so the Conv3d is exactly a matmul with the
        # flattened kernel (same weights, same layout); a GEMM is several times faster than a 3-D conv on a CPU.
        w = self.proj.weight  # [hidden, C, T, P, P]
        if pixel_values.shape[-1] == w[0, :, 0].numel():
            # Still images given once instead of T identical frames (preprocess fold_time=True): the T
            # temporal slices of the kernel see the same pixels, so they fold into one by summing.
            # Half the preprocessing output and half the GEMM, same result up to float rounding.
            w = w.sum(dim=2)
        w = w.reshape(w.shape[0], self.in_channels, -1)  # [hidden, C, k]
        if pixel_values.dtype == torch.uint8:
            norm = getattr(self, "_norm", None)
            if norm is None:
                raise ValueError("uint8 patches need set_input_normalization(mean, std) first")
            mean, std = (t.to(w.device, torch.float32).view(1, -1, 1) for t in norm)
            w32 = w.float() / std
            bias = -(w32 * mean).sum(dim=(1, 2))
            x = pixel_values.reshape(-1, w[0].numel())
            return uint8_linear(x, w32.reshape(w.shape[0], -1).t(), bias).to(w.dtype)
        x = pixel_values.reshape(-1, w[0].numel()).to(w.dtype)
        return x @ w.reshape(w.shape[0], -1).t()


def uint8_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """uint8 rows [S, K] @ fp32 `weight_t` [K, N] + `bias`, converted to fp32 `rows` rows at a time into one
    reused buffer. The whole batch converted at once is S x K x 4 bytes (a packed batch of seven images is
    57 MB): over the 32-MB mmap threshold (glibc's adaptive ceiling, and what `keep_freed_memory` sets), so
    every forward maps fresh pages and faults each one in, and the conversion cost more than the GEMM (py-spy
    on a loaded server). A 2.4-MB buffer stays in cache: 3x faster on a CPU, the same sums."""
    if x.device.type != "cpu" or x.shape[0] <= rows:
        return torch.addmm(bias, x.to(torch.float32), weight_t)
    out = torch.empty(x.shape[0], weight_t.shape[1], dtype=torch.float32)
    buf = torch.empty(rows, x.shape[1], dtype=torch.float32)
    for a in range(0, x.shape[0], rows):
        n = min(rows, x.shape[0] - a)
        torch.addmm(bias, buf[:n].copy_(x[a : a + n]), weight_t, out=out[a : a + n])
    return out


class VisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with biases (both towers' blocks)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; known: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def apply_rotary(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [S, ..., D] with each rotated pair side by side (x[2i], x[2i+1]); rotation [S, D/2] complex (cos + i sin).

    transformers rotates the pairs (i, i + D/2) of each head: [x1*c - x2*s, x2*c + x1*s], which is the complex
    product (x1 + i x2)(c + i s). `VisionAttention` stores the q and k rows of its weights with the two halves
    interleaved, so each pair is one complex number in memory and the rotation is one complex multiply: one
    pass over q and k instead of six elementwise passes and a concatenation (5x faster on a CPU for the small
    heads of the tiny tower). q.k is a sum over the head dimension, so the same reordering of q and k leaves
    attention unchanged. Computed in fp32 and cast back, as transformers does."""
    dtype = x.dtype
    z = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    r = rotation.view((rotation.shape[0],) + (1,) * (x.dim() - 2) + (rotation.shape[1],))
    return torch.view_as_real(z * r).flatten(-2).to(dtype)


def interleave_halves(head_dim: int) -> torch.Tensor:
    """Index that reorders one head's dimensions [a0..a(h-1), b0..b(h-1)] into pairs [a0, b0, a1, b1, ...]."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).reshape(-1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Non-causal attention within each segment [cu[i], cu[i+1]) of a packed sequence.

    q, k, v: [S, H, D]. Consecutive segments of equal length (the full windows of a row of windows, in
    window order) are one zero-copy view [n, L, H, D] and one batched SDPA call: no gather and no scatter
    of q/k/v, which on a CPU cost more than the attention itself for the small windowed heads.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = cu_seqlens[:-1].tolist()
    s, h, d = q.shape
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    i, n = 0, len(lengths)
    while i < n:
        j = i
        while j + 1 < n and lengths[j + 1] == lengths[i]:
            j += 1
        length, a = lengths[i], starts[i]
        b = a + length * (j - i + 1)
        if length:
            qb, kb, vb = (t[a:b].view(j - i + 1, length, h, -1).transpose(1, 2) for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qb, kb, vb).transpose(1, 2).reshape(b - a, h, -1)
        i = j + 1
    return out


def _rows_from_checkpoint(module, state, prefix, *_):
    for name in ("qkv.weight", "qkv.bias"):
        if prefix + name in state:
            state[prefix + name] = state[prefix + name][module._rows.to(state[prefix + name].device)]


def _rows_to_checkpoint(module, state, prefix, *_):
    inverse = torch.argsort(module._rows)
    for name in ("qkv.weight", "qkv.bias"):
        if prefix + name in state:
            state[prefix + name] = state[prefix + name][inverse.to(state[prefix + name].device)]


def keep_qkv_rows(module: nn.Module, rows: torch.Tensor) -> None:
    """`module.qkv`'s rows kept in the order `rows` (q and k halves interleaved: `apply_rotary`): loading a
    checkpoint reorders its rows so, `state_dict()` puts them back in the checkpoint's order."""
    module.register_buffer("_rows", rows, persistent=False)
    module.register_load_state_dict_pre_hook(_rows_from_checkpoint)
    module.register_state_dict_post_hook(_rows_to_checkpoint)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        # The q and k rows are kept with each head's two halves interleaved (see `apply_rotary`). Checkpoints
        # keep transformers' layout: loading reorders the rows, state_dict() puts them back.
        rows = torch.arange(3 * cfg.hidden_size).view(3, cfg.num_heads, -1)
        rows[:2] = rows[:2][..., interleave_halves(cfg.head_dim)]
        keep_qkv_rows(self, rows.reshape(-1))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        s = x.shape[0]
        qkv = self.qkv(x).reshape(s, 3, self.num_heads, -1)
        qk = apply_rotary(qkv[:, :2], rotation)  # q and k in one pass
        o = varlen_attention(qk[:, 0], qk[:, 1], qkv[:, 2], cu_seqlens)
        return self.proj(o.reshape(s, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x, cu_seqlens, rotation):
        x = x + self.attn(self.norm1(x), cu_seqlens, rotation)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each merge_size x merge_size group of patches -> one LLM token through an MLP."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.in_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.in_dim, self.in_dim), nn.GELU(), nn.Linear(self.in_dim, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.in_dim))


# ---------------------------------------------------------------------------------------------
# Index bookkeeping: positions, windows and attention segments of a packed batch.
# ---------------------------------------------------------------------------------------------


def rotary_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w) position of every patch, in the processor's merge-block-major patch order. [S, 2]"""
    out = []
    for t, h, w in grid_thw.tolist():
        hh = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        ww = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # merge-block-major: (h/m, w/m, m, m)
        hh = hh.permute(0, 2, 1, 3).reshape(-1)
        ww = ww.permute(0, 2, 1, 3).reshape(-1)
        out.append(torch.stack([hh, ww], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_index(
    grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorders merged tokens so that each attention window is contiguous.

    Returns (index over merged tokens [S/merge^2], cu_window_seqlens over patches). Windows are
    `window_size // merge // patch_size` merged tokens on a side; edge windows are smaller.

    Within each frame, windows are ordered by size, largest first (stable), not row by row as in
    transformers: the full windows of a frame then form one run of equal lengths, the right-edge ones
    another, and so on, so `varlen_attention` makes about four batched calls per frame instead of two
    per row of windows. Attention never crosses a window, and a frame stays contiguous (full-attention
    blocks attend per frame), so the output, put back in patch order by the caller, is the same.
    """
    win = window_size // merge // patch_size
    unit = merge * merge
    indices, cu, offset = [], [0], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        # Pad to whole windows (transformers always adds padding, a full window when divisible;
        # empty windows are dropped below, so the result is the same).
        ph, pw = win - gh % win, win - gw % win
        nh, nw = (gh + ph) // win, (gw + pw) // win
        padded = F.pad(idx, (0, pw, 0, ph), value=-1)
        padded = padded.view(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        counts = (padded >= 0).sum(-1)  # [t, windows]
        order = torch.argsort(-counts, dim=1, stable=True)
        padded = torch.gather(padded, 1, order[..., None].expand(-1, -1, win * win))
        counts = torch.gather(counts, 1, order).reshape(-1)
        flat = padded.reshape(-1)
        indices.append(flat[flat >= 0] + offset)
        cu.extend((counts.cumsum(0) * unit + cu[-1]).tolist())
        offset += t * gh * gw
    cu_t = torch.unique_consecutive(torch.tensor(cu, dtype=torch.int32))
    return torch.cat(indices), cu_t


def item_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Segment boundaries for full attention: one segment per frame group (t) of each item."""
    per = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(per.cumsum(0, dtype=torch.int32), (1, 0))


CPU_ACTIVATION_BYTES = 16 << 20


def cpu_groups(grid_thw: torch.Tensor, width: int, limit: int = CPU_ACTIVATION_BYTES) -> list[tuple[int, int]]:
    """Consecutive item ranges [a, b) whose patches x `width` fp32 values stay within `limit` bytes (an item
    over it alone). On a CPU a packed forward pays for its activations' size: glibc maps an allocation over
    32 MB fresh and faults every page in on each forward, and an activation over the caches streams through
    memory. The large benchmark tower (qkv 576 wide) forwarding seven images at once spent 390 ms per image
    with 47,000 page faults per image; one image at a time 303 ms and none. The tiny tower (96 wide) keeps
    its batches whole up to 43,000 patches, where batching still saves per-forward overhead."""
    per_item = (grid_thw.prod(-1) * width * 4).tolist()
    groups, start, size = [], 0, 0
    for i, n in enumerate(per_item):
        if i > start and size + n > limit:
            groups.append((start, i))
            start, size = i, 0
        size += n
    if per_item:
        groups.append((start, len(per_item)))
    return groups


def forward_in_groups(forward_packed, pixel_values: torch.Tensor, grid_thw: torch.Tensor, width: int, device):
    """`forward_packed(pixel_values, grid_thw)` over the whole packed batch, or on a CPU over consecutive groups of
    whole items (`cpu_groups` of activation `width`), concatenated: the rows are the same either way."""
    grid_thw = grid_thw.to("cpu", torch.long)
    groups = cpu_groups(grid_thw, width, CPU_ACTIVATION_BYTES) if torch.device(device).type == "cpu" else []
    if len(groups) <= 1:
        return forward_packed(pixel_values, grid_thw)
    sizes, out, row = grid_thw.prod(-1).tolist(), [], 0
    for a, b in groups:
        n = sum(sizes[a:b])
        out.append(forward_packed(pixel_values[row : row + n], grid_thw[a:b]))
        row += n
    return torch.cat(out)


class Qwen2_5VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg.in_channels, cfg.hidden_size, cfg.patch_size, cfg.temporal_patch_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        half = cfg.head_dim // 2  # each of h and w rotates half of the head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """LLM tokens per item after the spatial merge."""
        return grid_thw.prod(-1) // (self.config.spatial_merge_size**2)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [S, C*T*P*P] (packed), grid_thw [n, 3] -> [S / merge^2, out_hidden_size].

        On a CPU a packed batch whose widest activation would pass `CPU_ACTIVATION_BYTES` runs as consecutive
        groups of whole items (`cpu_groups`): items never interact, so the rows are the same."""
        return forward_in_groups(self._forward_packed, pixel_values, grid_thw, self.activation_width, self.device)

    @property
    def activation_width(self) -> int:
        """Floats per patch row of the widest activation a block allocates (qkv, or the MLP's gate and up)."""
        return max(3 * self.config.hidden_size, self.config.intermediate_size)

    def _forward_packed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        unit = cfg.spatial_merge_size**2
        dev = self.device

        win_idx, cu_windows = window_index(grid_thw, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
        cu_items = item_seqlens(grid_thw)
        win_idx, cu_windows, cu_items = win_idx.to(dev), cu_windows.to(dev), cu_items.to(dev)

        x = self.patch_embed(pixel_values.to(dev))
        s = x.shape[0]

        def to_window_order(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(s // unit, unit, -1)[win_idx].reshape(s, -1)

        x = to_window_order(x)
        freqs = rotary_positions(grid_thw, cfg.spatial_merge_size).to(dev)[..., None].float() * self.inv_freq
        angles = to_window_order(freqs.flatten(1))  # [S, head_dim/2]: h-angles then w-angles
        rotation = torch.complex(angles.cos(), angles.sin())

        full = set(cfg.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_items if i in full else cu_windows, rotation)

        merged = self.merger(x)
        return merged[torch.argsort(win_idx)]
