"""Triton kernels for the LLM backend, each next to the torch reference it must equal.

`attention` holds paged decode / extend attention over the engine's slot-indexed KV pool; `moe` holds
fused top-k routing and the grouped expert GEMM. Every Triton entry point has a `*_torch` twin with the
same signature: the twin is both the test oracle and the CPU serving path. Nothing here picks between
them on its own; the engine asks `triton_enabled(device)` once and calls one or the other.
"""

from __future__ import annotations

import os

import torch

from ._triton import triton
from .attention import decode_attention, decode_attention_torch, extend_attention, extend_attention_torch
from .moe import align_by_expert, fused_moe, fused_moe_torch, grouped_gemm, topk_routing, topk_routing_torch

# "triton" forces the Triton kernels (tests run them on the CPU under TRITON_INTERPRET=1); "torch" forces
# the references (e.g. to bisect a GPU numerics problem). Anything else: decide by device.
KERNELS_ENV = "MIMO_EPD_LLM_KERNELS"


def triton_enabled(device) -> bool:
    """Whether the engine should call the Triton kernels for tensors on `device`."""
    forced = os.environ.get(KERNELS_ENV, "").strip().lower()
    if triton is None:
        if forced == "triton":
            raise RuntimeError(f"{KERNELS_ENV}=triton, but this torch build has no Triton")
        return False
    if forced == "triton":
        return True
    if forced == "torch":
        return False
    return torch.device(device).type == "cuda"


__all__ = [
    "KERNELS_ENV",
    "triton_enabled",
    "decode_attention",
    "decode_attention_torch",
    "extend_attention",
    "extend_attention_torch",
    "topk_routing",
    "topk_routing_torch",
    "align_by_expert",
    "grouped_gemm",
    "fused_moe",
    "fused_moe_torch",
]
