"""Plain reference code the kernels and the model's fast paths are checked against (not used when serving):
attention over explicit positions, and a per-token mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]; positions per token. Causal (+ window) mask,
    GQA, optional per-head sink logit. Returns [Tq, Hq, Dv]."""
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if sliding_window is not None:
        allowed &= diff < sliding_window
    logits = logits.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, logits.shape[1], 1).to(logits.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs.to(v.dtype), v)


def moe_reference(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Each token through each of its experts, one at a time (transformers' loop, without grouping)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = F.linear(x[t], w_gate_up[e]).chunk(2, dim=-1)
            out[t] += F.linear(F.silu(gate) * up, w_down[e]) * weights[t, slot]
    return out
