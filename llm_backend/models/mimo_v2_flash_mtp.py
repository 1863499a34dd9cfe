"""MiMo-V2-Flash's multi-token-prediction (MTP) layers, in the layout of MiMo's release (`model.mtp.layers.{i}.*`).

Each MTP layer k (k = 1..n, stored as layer k-1) is one small transformer block that predicts one token further
ahead than the one before it (the wiring of SGLang's `mimo_v2_flash_nextn.py` and the model card):

    x   = eh_proj(concat(enorm(embed(token t+k)), hnorm(h_{k-1}[t])))         2H -> H, no bias
    x   = x + o_proj(attention(input_layernorm(x)))                            sliding window, sinks
    x   = x + mlp(pre_mlp_layernorm(x))                                        dense SwiGLU, `intermediate_size`
    h_k = final_layernorm(x);  logits_k = lm_head(h_k)                          predicts token t+1+k

`h_0` is the main model's final hidden state (after its last norm, what its LM head reads); layer k reads the
output of layer k-1, as in a top-1 draft chain. The token embedding and the LM head are the main model's (shared).
The attention is a sliding-layer attention of the main model's shape (its KV heads, head dims, sinks, sliding
rope theta and window), so an MTP layer's KV is sliding-window KV like any SWA layer's.

The weights' names are the release's: `enorm`, `hnorm`, `eh_proj`, `input_layernorm`,
`self_attn.{q,k,v,o}_proj`, `self_attn.attention_sink_bias` (kept here as `sinks`, renamed on load like the main
layers'), `pre_mlp_layernorm`, `mlp.{gate,up,down}_proj`, `final_layernorm`.

Attention goes through the same paged interface as the main model's (`PagedBatch.attend`), over KV pools built
from `kv_config()`: one sliding layer per MTP layer, layer index k-1. A single sequence uses `ContiguousKV(
mtp.kv_config())`. Training runs the same modules over a whole batch with `models.dense` instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from mimo_epd.layers import RMSNorm

from ..parallel.comm import SINGLE_RANK, Parallel
from .mimo_v2_flash import Attention, DenseMLP, MiMoV2FlashConfig, Rotary
from .quant import make_linear


def mtp_config(cfg: MiMoV2FlashConfig) -> MiMoV2FlashConfig:
    """The config of the MTP layers as a stack of their own: n sliding-window layers with dense MLPs."""
    n = cfg.num_nextn_predict_layers
    return replace(
        cfg,
        num_hidden_layers=n,
        layer_types=["sliding_attention"] * n,
        mlp_layer_types=["dense"] * n,
        num_nextn_predict_layers=0,
    )


class MTPLayer(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig, index: int, par: Parallel = SINGLE_RANK):
        super().__init__()
        h = cfg.hidden_size
        self.index, self.par = index, par
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = make_linear(cfg.quant, 2 * h, h, f"model.mtp.layers.{index}.eh_proj")
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index, f"model.mtp.layers.{index}.self_attn", par)  # mtp_config: sliding
        self.pre_mlp_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = DenseMLP(cfg, cfg.intermediate_size // par.shard.size, f"model.mtp.layers.{index}.mlp")
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input: eh_proj(concat(enorm(token embedding), hnorm(previous hidden state)))."""
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """After attention: the residual, the MLP and the final norm."""
        x = x + self.par.reduce(self.self_attn.o_proj(attn_out))
        x = x + self.par.reduce(self.mlp(self.pre_mlp_layernorm(x)))
        return self.final_layernorm(x)


class MiMoV2FlashMTP(nn.Module):
    """The MTP layers (`layers[k-1]` is MTP layer k) and the sliding rope they share."""

    def __init__(self, cfg: MiMoV2FlashConfig, par: Parallel = SINGLE_RANK):
        super().__init__()
        self.cfg = mtp_config(cfg)
        self.par = par
        self.layers = nn.ModuleList([MTPLayer(self.cfg, i, par) for i in range(self.cfg.num_hidden_layers)])
        self.rotary_emb = Rotary(self.cfg)

    def kv_config(self) -> MiMoV2FlashConfig:
        """What `KVPools` / `ContiguousKV` need to hold the MTP layers' KV here (one sliding layer each, this
        rank's heads)."""
        return self.par.shard.attention_config(self.cfg)

    def step(
        self,
        layer: int,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        paged,
    ) -> torch.Tensor:
        """MTP layer `layer + 1` over T tokens: `embeds` [T, H] the embeddings of the tokens one step ahead of
        `hidden` [T, H] (the previous layer's output, or the main model's final hidden state), at `positions`
        [T] (those of `hidden`); attention through `paged.attend(layer, ...)`. Returns its hidden state [T, H]
        (after final_layernorm; the shared LM head turns it into logits)."""
        mtp = self.layers[layer]
        x = mtp.combine(embeds, hidden)
        attn = mtp.self_attn
        q, k, v = attn.project(mtp.input_layernorm(x), *self.rotary_emb(positions, "sliding_attention", x.dtype))
        o = paged.attend(layer, q, k, v, attn.scale, self.cfg.sliding_window, attn.sinks)
        return mtp.finish(x, o.reshape(o.shape[0], -1))
