"""MiMo-V2-Flash, written to match transformers' `mimo_v2_flash` parameter for parameter (so a checkpoint
saved by transformers loads unchanged) and op for op (parity tests in tests/llm/).

Architecture (transformers `mimo_v2_flash`; docs/llm.md):
- per-layer `full_attention` / `sliding_attention`; sliding layers have twice the KV heads, a learnable
  per-head attention sink (one extra softmax column, then dropped) and their own rope theta;
- q/k head_dim != v_head_dim; partial rotary (the first `partial_rotary_factor * head_dim` dims);
- values scaled by `attention_value_scale`;
- layer 0 a dense SwiGLU MLP, the others MoE: sigmoid scores, `e_score_correction_bias` only for the
  choice of experts, normalised top-k weights times `routed_scaling_factor`.

Attention has one path: the paged KV pools (llm_backend/paged_attention.py), with a causal mask and, in sliding
layers, `q_pos - k_pos < sliding_window` (transformers stores window + 1). The engine gives a step's `PagedBatch`;
a single sequence (references, tests) uses a `ContiguousKV`. MoE experts run the fused Triton kernels on CUDA and
their torch twin on the CPU (kernels/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mimo_epd.layers import RMSNorm

from ..kernels import triton_enabled
from ..kernels.moe import fused_moe, fused_moe_torch, topk_routing
from ..parallel.comm import SINGLE_RANK, Parallel
from .quant import BlockFP8Experts, Fp8Spec, MXFP4Experts, QuantizedExperts, make_linear


@dataclass
class MiMoV2FlashConfig:
    vocab_size: int = 152576
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 192
    v_head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    sliding_window: int = 129  # transformers' convention: the window (128) + 1
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    rope_parameters: dict = field(default_factory=dict)
    attention_value_scale: float = 0.707
    attention_bias: bool = False
    moe_intermediate_size: int = 2048
    num_experts_per_tok: int = 8
    n_routed_experts: int = 256
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None  # the context it was trained for (None: not given)
    # Not in transformers' config (its port always gives sliding layers twice the KV heads): set it for shapes
    # whose sliding layers have their own KV head count, e.g. MiMo-V2.5-Pro (8 and 8), used for capacity accounting.
    swa_num_key_value_heads: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = None
    # Multi-token-prediction layers stored under `model.mtp.layers.{i}.*` (the key MiMo-7B and DeepSeek-V3 use;
    # transformers ignores it). 0 = the checkpoint's MTP weights, if any, are not loaded.
    num_nextn_predict_layers: int = 0
    # Not in transformers' config either: the release's keys (llm_backend/models/released.py reads them).
    swa_attention_sink: bool = True  # add_swa_attention_sink_bias: a per-head sink logit in sliding layers
    full_attention_sink: bool = False  # add_full_attention_sink_bias: the same in full layers
    attention_projection_layout: str = "split"  # or "fused_qkv" (V2.5 on): the loader de-interleaves it
    quant: Fp8Spec | None = None  # block-FP8 linear layers (quantization_config), or None

    # Fields transformers' MiMoV2FlashConfig does not have (transformers_twin leaves them out; to_hf_dict drops quant).
    OURS = ("num_nextn_predict_layers", "swa_num_key_value_heads", "swa_attention_sink", "full_attention_sink")
    OURS += ("attention_projection_layout", "quant")

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = [
                "full_attention" if (i == 0 or (i + 1) % 6 == 0) else "sliding_attention" for i in range(n)
            ]
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["dense"] + ["sparse"] * (n - 1)
        if not self.rope_parameters:
            self.rope_parameters = {
                "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
            }
        if self.attention_value_scale is None:
            self.attention_value_scale = 1.0
        if self.routed_scaling_factor is None:
            self.routed_scaling_factor = 1.0

    @property
    def window(self) -> int:
        """Tokens a sliding layer sees before the current one (the model's W)."""
        return self.sliding_window - 1

    def has_sinks(self, layer: int) -> bool:
        return self.swa_attention_sink if self.layer_types[layer] == "sliding_attention" else self.full_attention_sink

    def kv_heads(self, layer: int) -> int:
        if self.layer_types[layer] != "sliding_attention":
            return self.num_key_value_heads
        return self.swa_num_key_value_heads or 2 * self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> "MiMoV2FlashConfig":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known and v is not None}
        if "num_local_experts" in d and "n_routed_experts" not in d:
            kw["n_routed_experts"] = d["num_local_experts"]
        if d.get("sliding_window_size") is not None:
            kw["sliding_window"] = d["sliding_window_size"] + 1
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        """The config as transformers' MiMoV2FlashConfig reads it; a field that is not given (None) is left out, so
        transformers applies its own default (it refuses None for `max_position_embeddings`)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("quant",)}
        return {"model_type": "mimo_v2_flash", **{k: v for k, v in values.items() if v is not None}}


class SeqInput(NamedTuple):
    """One sequence's new tokens in a batched forward: their ids (or None when `inputs_embeds` gives every row),
    their positions [T], embeddings [T, hidden] that replace the ids' or None, and `media`: (rows [M], embeddings
    [M, hidden]) that replace the rows' token embeddings (an image's or a clip's rows spliced in), or None."""

    input_ids: torch.Tensor | None
    positions: torch.Tensor
    inputs_embeds: torch.Tensor | None = None
    media: tuple[torch.Tensor, torch.Tensor] | None = None


class DenseMLP(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig, intermediate: int, prefix: str = ""):
        """`prefix`: the module's name in the checkpoint (`model.layers.0.mlp`), which says whether it is FP8."""
        super().__init__()
        h, q = cfg.hidden_size, cfg.quant
        self.gate_proj = make_linear(q, h, intermediate, f"{prefix}.gate_proj")
        self.up_proj = make_linear(q, h, intermediate, f"{prefix}.up_proj")
        self.down_proj = make_linear(q, intermediate, h, f"{prefix}.down_proj")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k])."""
        c = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias  # the bias picks experts; it never weighs them
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(
                1, group_scores.topk(c.topk_group, dim=-1, sorted=False)[1], 1
            )
            mask = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, c.n_routed_experts)
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


class Experts(nn.Module):
    def __init__(self, e: int, h: int, i: int):
        """`e` experts of hidden size `h` and intermediate size `i` (this rank's: parallel/shard.py)."""
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The CPU path: tokens sorted by expert, one matmul pair per expert that has tokens (kernels/moe.py)."""
        return fused_moe_torch(x, self.gate_up_proj, self.down_proj, weights, ids)


class MoE(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig, prefix: str = "", par: Parallel = SINGLE_RANK, layer: int = -1):
        """`par`: this rank's experts (expert parallelism) or slice of every expert (tensor parallelism); the
        router is whole on every rank. The forward returns this rank's partial sum (the caller reduces it over the
        tensor-parallel ranks); with data-parallel attention (`par.data`) its tokens' sum over every DP rank's
        experts, or its tensor-parallel part of it (a round of parallel/data.py, named by decoder layer `layer`)."""
        super().__init__()
        self.layer, self.data = layer, par.data
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        q = cfg.quant
        sh = par.shard
        held = sh.experts(cfg.n_routed_experts)
        self.held = (held.start, held.stop) if sh.expert_parallel and not sh.single else None
        # Expert parallelism: tokens routed to each expert, all ranks' experts (every rank routes every token): the
        # load per rank a balancer needs (stats()["ep_expert_tokens"]).
        n = cfg.n_routed_experts if self.held is not None else 0
        counts = torch.zeros(n, dtype=torch.long, device="cpu")  # on the CPU even under the loader's meta device
        self.register_buffer("expert_tokens", counts, persistent=False)
        e, h, i = held.stop - held.start, cfg.hidden_size, sh.moe_intermediate(cfg.moe_intermediate_size)
        if q is not None and q.quantized(f"{prefix}.experts") and q.mxfp4_block:
            self.experts: nn.Module = MXFP4Experts(e, h, i, q.mxfp4_block)
        elif q is not None and q.quantized(f"{prefix}.experts"):
            self.experts = BlockFP8Experts(e, h, i, q.block)
        else:
            self.experts = Experts(e, h, i)
        self.gate = TopkRouter(cfg)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: (weights, expert ids) of tokens x [T, hidden] this rank routes for its forward,
        counted in `expert_tokens` (the load a balancer needs)."""
        weights, ids = self.gate(x)
        self.expert_tokens += torch.bincount(ids.reshape(-1), minlength=self.expert_tokens.numel())
        return weights, ids

    def share(
        self, x: torch.Tensor, weights: torch.Tensor | None = None, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Expert parallelism: this rank's experts' share of tokens x [T, hidden], routed as given (weights, ids
        [T, k]) or here."""
        if weights is None or ids is None:
            weights, ids = self.gate(x)
        assert self.held is not None
        lo, hi = self.held
        mine = (ids >= lo) & (ids < hi)
        local = (ids - lo).masked_fill(~mine, hi - lo)  # id hi - lo: held elsewhere, skipped
        quantized = self.experts if isinstance(self.experts, QuantizedExperts) else None  # FP8 / MXFP4 kept
        gu, down = self.experts.gate_up_proj, self.experts.down_proj
        return fused_moe_torch(x, gu, down, weights * mine, local, quantized=quantized)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        c = self.gate.cfg
        if self.data is not None:  # data-parallel attention: every DP rank's tokens meet here
            return self.data.moe(self.layer, self, x).view(shape)
        if self.held is not None:  # expert parallelism: this rank's experts' share of every token
            return self.share(x, *self.route(x)).view(shape)
        if (
            c.n_group == 1 and triton_enabled(x.device) and isinstance(self.experts, (Experts, BlockFP8Experts))
        ):  # fused routing + grouped expert GEMMs (kernels/moe.py); FP8 experts dequantized tile by tile in them
            logits = F.linear(x.float(), self.gate.weight.float())
            weights, ids = topk_routing(
                logits,
                self.gate.e_score_correction_bias.float(),
                c.num_experts_per_tok,
                c.norm_topk_prob,
                c.routed_scaling_factor,
            )
            fp8 = self.experts if isinstance(self.experts, BlockFP8Experts) else None
            return fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, fp8=fp8).view(shape)
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids).view(shape)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary on the first cos.shape[-1] dims. x [T, H, D]; cos/sin [T, R]."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat(((xr * c) + (rotated * s), xp), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig, layer: int, prefix: str = "", par: Parallel = SINGLE_RANK):
        """`prefix`: the module's name in the checkpoint (default `model.layers.{layer}.self_attn`). `par`: this
        rank's heads (parallel/shard.py); o_proj's output is then a partial sum the caller reduces."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.sliding = cfg.layer_types[layer] == "sliding_attention"
        local = par.shard.attention_config(cfg)
        hq, hkv, h, b = local.num_attention_heads, local.kv_heads(layer), cfg.hidden_size, cfg.attention_bias
        p, q = prefix or f"model.layers.{layer}.self_attn", cfg.quant
        if q is not None:
            # The release tiles q/k/v scales per pre-split chunk, and rows de-interleaved from a fused QKV need not
            # start on a block: one scale row per weight row keeps any of them exact (llm_backend/kernels/fp8.py).
            q = replace(q, block=(1, q.block[1]))
        self.q_proj = make_linear(q, h, hq * cfg.head_dim, f"{p}.q_proj", b)
        self.k_proj = make_linear(q, h, hkv * cfg.head_dim, f"{p}.k_proj", b)
        self.v_proj = make_linear(q, h, hkv * cfg.v_head_dim, f"{p}.v_proj", b)
        self.o_proj = make_linear(cfg.quant, hq * cfg.v_head_dim, h, f"{p}.o_proj")
        self.sinks = nn.Parameter(torch.empty(hq)) if cfg.has_sinks(layer) else None
        self.scale = cfg.head_dim**-0.5

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> rotated q [T, Hq, D], rotated k [T, Hkv, D], scaled v [T, Hkv, Dv]."""
        c = self.cfg
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, c.head_dim)
        k = self.k_proj(x).view(t, -1, c.head_dim)
        v = self.v_proj(x).view(t, -1, c.v_head_dim) * c.attention_value_scale
        return rotate(q, cos, sin), rotate(k, cos, sin), v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig, layer: int, par: Parallel = SINGLE_RANK):
        super().__init__()
        self.self_attn = Attention(cfg, layer, par=par)
        p = f"model.layers.{layer}.mlp"
        sparse = cfg.mlp_layer_types[layer] == "sparse"
        self.mlp = MoE(cfg, p, par, layer) if sparse else DenseMLP(cfg, cfg.intermediate_size // par.shard.size, p)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Rotary(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig):
        super().__init__()
        for kind in sorted(set(cfg.layer_types)):
            p = cfg.rope_parameters[kind]
            dim = int(cfg.head_dim * p.get("partial_rotary_factor", 0.334))
            # On the CPU even while the model is built on the meta device (the loader's): computed, never loaded.
            inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
            self.register_buffer(f"{kind}_inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, kind: str, dtype: torch.dtype):
        freqs = positions[:, None].float() * getattr(self, f"{kind}_inv_freq")
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Model(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig, par: Parallel = SINGLE_RANK):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size // par.shard.size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, par) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg)


class MiMoV2FlashForCausalLM(nn.Module):
    def __init__(self, cfg: MiMoV2FlashConfig, par: Parallel = SINGLE_RANK):
        """`par`: one rank of a tensor- / expert-parallel replica (llm_backend/parallel): the modules hold this
        rank's part (`par.shard`'s rules) and the forward makes the collectives; `config` stays the whole model's."""
        super().__init__()
        par.shard.check(cfg)
        self.config = cfg
        self.par = par
        self.model = Model(cfg, par)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // par.shard.size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.num_nextn_predict_layers:
            from .mimo_v2_flash_mtp import MiMoV2FlashMTP

            self.model.mtp = MiMoV2FlashMTP(cfg, par)  # state-dict keys model.mtp.layers.{i}.*, as in MiMo's release

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv,
        inputs_embeds: torch.Tensor | None = None,
        logits_for: str = "all",
    ) -> torch.Tensor:
        """One sequence's new tokens [T] at consecutive `positions` [T], over its own `ContiguousKV`
        (llm_backend.paged_attention; references and tests); returns logits [T, vocab] ("all") or [1, vocab]."""
        start, n = int(positions[0]), int(positions.shape[0])
        return self.forward_batch([SeqInput(input_ids, positions, inputs_embeds)], [logits_for], kv.step(start, n))[0]

    @torch.inference_mode()
    def forward_batch(self, segments: list[SeqInput], logits_for: list[str], paged) -> list[torch.Tensor]:
        """Several sequences' new tokens in one pass, one `SeqInput` each. Projections, MLPs and experts run once
        over all tokens (one GEMM each); attention runs over the paged KV pools for all sequences at once
        (`paged`: a `PagedBatch` describing the step). Returns each segment's logits ("all" tokens or the "last"
        one)."""
        x, bounds = self.hidden_states(segments, paged)
        rows = []
        for j, mode in enumerate(logits_for):
            a, b = bounds[j], bounds[j + 1]
            rows.append(x[a:b] if mode == "all" else x[b - 1 : b])
        if self.par.single:
            return [self.logits(h) for h in rows]
        # Split: one gather for the step, not one per segment (the LM head's rows concatenated, then cut again).
        return list(self.logits(torch.cat(rows)).split([h.shape[0] for h in rows]))

    def mtp_step(self, layer: int, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, paged):
        """MTP layer `layer + 1` over T tokens (`MiMoV2FlashMTP.step`): what a drafter calls."""
        return self.model.mtp.step(layer, embeds, hidden, positions, paged)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of ids [T] (summed over the ranks that hold their rows)."""
        return self.par.embed(ids, self.model.embed_tokens.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of final hidden states [T, hidden] (the vocabulary parts gathered)."""
        return self.par.gather_vocab(self.lm_head(hidden).float())

    def hidden_states(self, segments: list[SeqInput], paged) -> tuple[torch.Tensor, list[int]]:
        """The final hidden states (after the last norm: what the LM head and the first MTP layer read) of all the
        segments' tokens [T, hidden], and the segments' bounds in that order."""
        m, par = self.model, self.par
        xs = self._embed_all(segments)
        x = torch.cat(xs) if len(xs) > 1 else xs[0]
        positions = torch.cat([seg.positions for seg in segments]) if len(segments) > 1 else segments[0].positions
        bounds = [0]
        for seg_x in xs:
            bounds.append(bounds[-1] + seg_x.shape[0])
        rope = {kind: m.rotary_emb(positions, kind, x.dtype) for kind in set(self.config.layer_types)}
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.project(h, *rope[self.config.layer_types[i]])
            o = paged.attend(i, q, k, v, attn.scale, self.config.sliding_window if attn.sliding else None, attn.sinks)
            x = x + par.reduce(attn.o_proj(o.reshape(o.shape[0], -1)))
            x = x + par.reduce(layer.mlp(layer.post_attention_layernorm(x)))
        return m.norm(x), bounds

    def _embed_all(self, segments: list[SeqInput]) -> list[torch.Tensor]:
        """Every segment's input embeddings; split over ranks, one lookup (one all-reduce) for the whole step."""
        if self.par.single or any(seg.inputs_embeds is not None or seg.input_ids is None for seg in segments):
            return [self._embeds(seg) for seg in segments]
        last = self.config.vocab_size - 1
        ids = [seg.input_ids if seg.media is None else seg.input_ids.clamp(max=last) for seg in segments]
        xs = list(self.embed(torch.cat(ids)).split([len(t) for t in ids]))
        for seg, x in zip(segments, xs):
            if seg.media is not None:
                rows, values = seg.media
                x[rows] = values.to(x.dtype)
        return xs

    def _embeds(self, seg: SeqInput) -> torch.Tensor:
        if seg.inputs_embeds is not None:
            return seg.inputs_embeds
        assert seg.input_ids is not None
        if seg.media is None:
            return self.embed(seg.input_ids)
        x = self.embed(seg.input_ids.clamp(max=self.config.vocab_size - 1))  # a media row's placeholder id: replaced
        rows, values = seg.media
        x[rows] = values.to(x.dtype)
        return x
