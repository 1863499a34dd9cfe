"""Model shapes for the cost model: the parameter, FLOP and KV-byte facts of one forward, per token.

A shape is derived from a `MiMoV2FlashConfig` (layer types, heads, head dims, window, MoE sizes), so the three
named shapes follow the code that defines them:

- `tiny`: TINY_LLM_CONFIG (the embedded test model; `cpu-measured` is fitted on it);
- `flash`: the MiMoV2FlashConfig defaults = MiMo-V2-Flash (48 layers, 256 experts top-8, ~309B total / ~15B
  active parameters);
- `pro`: PRO_SHAPE_CONFIG (MiMo-V2.5-Pro's attention: 70 layers, 10 full, 8 KV heads, window 128) plus MoE facts
  that are *assumed* here (see PRO_MOE): the public figures are ~1T total and ~42B active parameters; 384 routed
  experts, top-8, expert FFN width 2048 and a dense first layer (FFN 16384) reproduce them with this attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..models import PRO_SHAPE_CONFIG, TINY_LLM_CONFIG, MiMoV2FlashConfig

# MiMo-V2.5-Pro's MoE (assumptions, chosen to match the published ~1T total / ~42B active parameter counts).
PRO_MOE = {"n_routed_experts": 384, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "intermediate_size": 16384}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    v_head_dim: int
    window: int
    full_layers: int
    swa_layers: int
    kv_heads_full: int
    kv_heads_swa: int
    dense_layers: int
    dense_intermediate: int
    moe_layers: int
    moe_intermediate: int
    experts: int
    experts_per_tok: int
    weight_bytes: int = 2  # bf16 weights
    kv_bytes: int = 2  # bf16 KV

    @classmethod
    def from_config(cls, name: str, cfg: MiMoV2FlashConfig, **kw) -> "ModelShape":
        types = cfg.layer_types
        full = [i for i, t in enumerate(types) if t != "sliding_attention"]
        swa = [i for i, t in enumerate(types) if t == "sliding_attention"]
        dense = sum(t == "dense" for t in cfg.mlp_layer_types)
        return cls(
            name=name,
            hidden=cfg.hidden_size,
            vocab=cfg.vocab_size,
            heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim,
            window=cfg.window,
            full_layers=len(full),
            swa_layers=len(swa),
            kv_heads_full=cfg.kv_heads(full[0]) if full else 0,
            kv_heads_swa=cfg.kv_heads(swa[0]) if swa else 0,
            dense_layers=dense,
            dense_intermediate=cfg.intermediate_size,
            moe_layers=len(types) - dense,
            moe_intermediate=cfg.moe_intermediate_size,
            experts=cfg.n_routed_experts,
            experts_per_tok=cfg.num_experts_per_tok,
            **kw,
        )

    # ------------------------------------------------------------------------------- parameters
    def attn_params(self, kv_heads: int) -> int:
        h = self.hidden
        return (
            h * self.heads * self.head_dim
            + h * kv_heads * (self.head_dim + self.v_head_dim)
            + self.heads * self.v_head_dim * h
        )

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate  # gate, up, down

    @property
    def dense_params(self) -> int:
        """Weights every token uses: attention, dense MLPs, routers (not the experts, not embeddings / head)."""
        return (
            self.full_layers * self.attn_params(self.kv_heads_full)
            + self.swa_layers * self.attn_params(self.kv_heads_swa)
            + self.dense_layers * 3 * self.hidden * self.dense_intermediate
            + self.moe_layers * self.hidden * self.experts
        )

    @property
    def active_params(self) -> int:
        """Per token, without embeddings and LM head."""
        return self.dense_params + self.moe_layers * self.experts_per_tok * self.expert_params

    @property
    def total_params(self) -> int:
        return self.dense_params + self.moe_layers * self.experts * self.expert_params + 2 * self.vocab * self.hidden

    # ------------------------------------------------------------------------------- KV
    @property
    def kv_bytes_full(self) -> int:
        """KV bytes of one token in all full-attention layers."""
        return self.full_layers * self.kv_heads_full * (self.head_dim + self.v_head_dim) * self.kv_bytes

    @property
    def kv_bytes_swa(self) -> int:
        return self.swa_layers * self.kv_heads_swa * (self.head_dim + self.v_head_dim) * self.kv_bytes

    def pool_tokens(self, budget_bytes: int, swa_share: float) -> tuple[int, int]:
        """(full pool tokens, SWA pool tokens) of a KV byte budget, `swa_share` of it for the SWA pool."""
        swa = int(budget_bytes * swa_share) // max(1, self.kv_bytes_swa)
        full = (budget_bytes - swa * self.kv_bytes_swa) // max(1, self.kv_bytes_full)
        return int(full), int(swa)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "layers": {"full": self.full_layers, "sliding": self.swa_layers},
            "window": self.window,
            "experts": f"{self.experts_per_tok} of {self.experts}",
            "total_params_b": round(self.total_params / 1e9, 2),
            "active_params_b": round(self.active_params / 1e9, 3),
            "kv_bytes_per_token": {"full_layers": self.kv_bytes_full, "sliding_layers": self.kv_bytes_swa},
        }


SHAPES = {
    "tiny": ModelShape.from_config("tiny", TINY_LLM_CONFIG, weight_bytes=4, kv_bytes=4),  # fp32 on the CPU
    "flash": ModelShape.from_config("MiMo-V2-Flash", MiMoV2FlashConfig()),
    "pro": replace(ModelShape.from_config("MiMo-V2.5-Pro", replace(PRO_SHAPE_CONFIG, **PRO_MOE)), name="MiMo-V2.5-Pro"),
}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}") from None
