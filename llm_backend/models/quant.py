"""Block-FP8 layers: a linear layer and packed experts whose weights stay FP8 in memory.

`Fp8Spec` is a checkpoint's `quantization_config` (llm_backend/models/released.py reads it): the block size and the
layers it leaves unquantized. `make_linear(cfg, in, out, name)` builds an `nn.Linear`, or a `BlockFP8Linear` when
the config's spec quantizes `name`, so the model says where FP8 goes at construction and the loader only fills it.

Invariant: FP8 bytes and their fp32 scales never change dtype after construction. `Module.to(dtype)` would cast a
float8 weight (it is a floating-point tensor) and round the scales to bf16; these layers move with the model's
device and ignore its dtype (`_apply`), so a bf16 model keeps exact FP8 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import triton_enabled
from ..kernels.fp8 import FP8, dequantize, fp8_linear, fp8_linear_torch, mxfp4_dequantize, scale_shape


@dataclass(frozen=True)
class Fp8Spec:
    """`quantization_config` of a block-FP8 checkpoint: the block (rows, cols) and the linear layers it leaves
    unquantized (`ignored_layers` / `modules_to_not_convert`)."""

    block: tuple[int, int] = (128, 128)
    ignored: tuple[str, ...] = ()
    # The linear layers stored FP8 (or MXFP4), read from the weights' headers by the loader (None: all but
    # `ignored`, what `--quantization fp8` makes of a bf16 checkpoint).
    modules: frozenset[str] | None = None
    # store_dtype mxfp4 (MiMo-V2.6): routed experts in MXFP4 with blocks of this many values, the rest FP8.
    mxfp4_block: int = 0

    def ignores(self, module: str) -> bool:
        """Whether the config leaves `module` unquantized (a name, or a prefix ending at a dot boundary:
        `model.layers.0.mlp` covers its three projections)."""
        return any(module == p or module.startswith(p + ".") for p in self.ignored)

    def quantized(self, module: str) -> bool:
        """Whether the linear layer `module` (`model.layers.3.self_attn.q_proj`, `model.layers.5.mlp.experts`)
        holds FP8 weights. Embeddings, norms, the router gate and the LM head are never built through here."""
        return module in self.modules if self.modules is not None else not self.ignores(module)


class _KeepsFP8(nn.Module):
    """Moves with the model's device, never with its dtype (see the module docstring)."""

    def _apply(self, fn, recurse=True):
        target = fn(torch.empty(0, device=next(iter(self._parameters.values())).device))
        for name, p in self._parameters.items():
            if p is not None and p.device != target.device:
                self._parameters[name] = nn.Parameter(p.data.to(target.device), requires_grad=False)
        return self


class BlockFP8Linear(_KeepsFP8):
    """y = x @ W^T with W = weight (float8_e4m3fn) x weight_scale_inv per (bn, bk) block: the Triton FP8 GEMM on
    CUDA (compute capability 8.9 on: FP8 tensor cores), the weight dequantized per call elsewhere (or once at load
    with --fp8-weights dequantize)."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        grid = scale_shape(out_features, in_features, block)
        self.weight_scale_inv = nn.Parameter(torch.empty(grid, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_enabled(x.device) and fp8_dot_supported(x.device):
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block)
        return fp8_linear_torch(x, self.weight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


class QuantizedExperts(_KeepsFP8):
    """Packed experts whose weights stay quantized; each call dequantizes only the experts that received tokens
    (kernels/moe.py's torch path, on every device)."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from ..kernels.moe import fused_moe_torch

        return fused_moe_torch(x, self.gate_up_proj, self.down_proj, weights, ids, quantized=self)

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) weights dequantized into `dtype`."""
        raise NotImplementedError


class BlockFP8Experts(QuantizedExperts):
    """Packed experts in FP8: gate_up_proj [E, 2I, H] and down_proj [E, H, I] with per-block scales
    (`*_scale_inv`)."""

    def __init__(self, n_experts: int, hidden: int, inter: int, block: tuple[int, int]):
        super().__init__()
        bn, bk = block
        # Gate and up are stacked: their blocks line up only when I is a multiple of the block (else a scale row
        # per weight row keeps them exact); likewise down's H.
        self.gate_up_block = (bn if inter % bn == 0 else 1, bk)
        self.down_block = (bn if hidden % bn == 0 else 1, bk)
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter, hidden, dtype=FP8), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, inter, dtype=FP8), requires_grad=False)
        g = scale_shape(2 * inter, hidden, self.gate_up_block)
        d = scale_shape(hidden, inter, self.down_block)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(n_experts, *g, dtype=torch.float32), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(n_experts, *d, dtype=torch.float32), requires_grad=False)

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize(self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], self.gate_up_block, dtype),
            dequantize(self.down_proj[e], self.down_proj_scale_inv[e], self.down_block, dtype),
        )


class MXFP4Experts(QuantizedExperts):
    """Packed experts in MXFP4 (MiMo-V2.6): gate_up_proj [E, 2I, H/2] and down_proj [E, H, I/2] (uint8, two e2m1
    codes a byte) with e8m0 scales per `block` values (`*_scale`, uint8): a quarter of bf16's bytes, plus 1/32."""

    def __init__(self, n_experts: int, hidden: int, inter: int, block: int = 32):
        super().__init__()
        self.block = block
        u8 = torch.uint8
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter, hidden // 2, dtype=u8), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, inter // 2, dtype=u8), requires_grad=False)
        self.gate_up_proj_scale = nn.Parameter(
            torch.empty(n_experts, 2 * inter, -(-hidden // block), dtype=u8), requires_grad=False
        )
        self.down_proj_scale = nn.Parameter(
            torch.empty(n_experts, hidden, -(-inter // block), dtype=u8), requires_grad=False
        )

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            mxfp4_dequantize(self.gate_up_proj[e], self.gate_up_proj_scale[e], self.block, dtype),
            mxfp4_dequantize(self.down_proj[e], self.down_proj_scale[e], self.block, dtype),
        )


def fp8_dot_supported(device) -> bool:
    """FP8 x FP8 tensor-core products: CUDA compute capability 8.9 or later (Ada, Hopper, Blackwell); the Triton
    interpreter on a CPU (tests) emulates them. An older GPU dequantizes per call instead."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def make_linear(spec: Fp8Spec | None, in_features: int, out_features: int, name: str, bias: bool = False) -> nn.Module:
    """`nn.Linear`, or `BlockFP8Linear` when `spec` quantizes `name` (no FP8 layer has a bias)."""
    if spec is None or bias or not spec.quantized(name):
        return nn.Linear(in_features, out_features, bias=bias)
    return BlockFP8Linear(in_features, out_features, spec.block)
