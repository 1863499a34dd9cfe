"""Whole-sequence forwards over a batch of fixed-length sequences [B, L], with autograd: how the model trains.

The engine's path (`MiMoV2FlashForCausalLM.forward_batch`, paged KV pools, inference mode) serves; this one runs
the same modules and weights over a batch for training and evaluation (`mimo_epd.train`). Only attention differs:
here it is one explicit masked softmax per layer,

    scores[b, h, i, j] = q_i . k_j * scale,  kept where j <= i (and i - j < sliding_window in sliding layers)
    p = softmax([scores, sink_h]) without the sink column;  out = p @ v

with query head h reading KV head h // (Hq / Hkv), the grouping of the paged kernels. Tests check it against the
paged path for the main layers and the MTP layers (tests/llm/test_mtp.py). Every sequence starts at position 0.

`main_hidden` returns the final hidden states (after the last norm) and, per MoE layer, the experts each token
chose (the trainer balances the router's correction bias with them); `mtp_hidden` runs MTP layer k over the
batch, given the embeddings of the tokens k ahead and the previous layer's hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mimo_v2_flash import MiMoV2FlashForCausalLM, MoE


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, L, Hq, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv] -> [B, L, Hq, Dv] (causal, window, sinks)."""
    b, n, hq, _ = q.shape
    rep = hq // k.shape[2]
    qh = q.transpose(1, 2)  # [B, Hq, L, D]
    kh = k.transpose(1, 2).repeat_interleave(rep, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
    scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) * scale
    i = torch.arange(n, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if sliding_window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < sliding_window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, n, 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1)
    return torch.matmul(p.to(vh.dtype), vh).transpose(1, 2)


def _attend(attn, h: torch.Tensor, cos, sin, sliding_window: int | None) -> torch.Tensor:
    """One attention block over h [B, L, H] -> [B, L, H] (projections, rope, masked attention, o_proj)."""
    b, n, d = h.shape
    q, k, v = attn.project(h.reshape(b * n, d), cos, sin)
    o = causal_attention(
        q.view(b, n, *q.shape[1:]), k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:]), attn.scale,
        sliding_window, attn.sinks,
    )  # fmt: skip
    return attn.o_proj(o.reshape(b, n, -1))


def _moe(mlp: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = mlp.gate(flat)
    return mlp.experts(flat, weights.to(flat.dtype), ids).view(x.shape), ids


def main_hidden(model: MiMoV2FlashForCausalLM, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """input_ids [B, L] -> (final hidden states [B, L, H] after the last norm, chosen expert ids per MoE layer)."""
    cfg, m = model.config, model.model
    b, n = input_ids.shape
    x = m.embed_tokens(input_ids)
    positions = torch.arange(n, device=input_ids.device).repeat(b)
    rope = {kind: m.rotary_emb(positions, kind, x.dtype) for kind in set(cfg.layer_types)}
    expert_ids = []
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        window = cfg.sliding_window if attn.sliding else None
        x = x + _attend(attn, layer.input_layernorm(x), *rope[cfg.layer_types[i]], window)
        h = layer.post_attention_layernorm(x)
        if isinstance(layer.mlp, MoE):
            y, ids = _moe(layer.mlp, h)
            expert_ids.append(ids)
        else:
            y = layer.mlp(h)
        x = x + y
    return m.norm(x), expert_ids


def mtp_hidden(model: MiMoV2FlashForCausalLM, layer: int, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """MTP layer `layer + 1` over a batch: embeds [B, L, H] (tokens one step ahead), hidden [B, L, H] -> [B, L, H]."""
    mtp = model.model.mtp
    block = mtp.layers[layer]
    b, n, _ = hidden.shape
    x = block.combine(embeds, hidden)
    positions = torch.arange(n, device=hidden.device).repeat(b)
    cos, sin = mtp.rotary_emb(positions, "sliding_attention", x.dtype)
    attn = block.self_attn
    q, k, v = attn.project(block.input_layernorm(x).reshape(b * n, -1), cos, sin)
    o = causal_attention(
        q.view(b, n, *q.shape[1:]), k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:]), attn.scale,
        mtp.cfg.sliding_window, attn.sinks,
    )  # fmt: skip
    return block.finish(x, o.reshape(b, n, -1))


def logits(model: MiMoV2FlashForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, model.lm_head.weight)
