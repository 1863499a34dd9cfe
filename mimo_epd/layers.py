"""Neural-network building blocks shared by the vision tower (encoder_server) and the LLM (llm_backend)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMS normalisation with a learned scale; statistics in fp32 whatever the activation dtype, then cast
    back before the scale, exactly as transformers' Qwen2/MiMo RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
