"""LLM model definitions and their loader: a `mimo_v2_flash` checkpoint directory (the shipped `tiny` is one),
or `tiny-random`, seeded random weights of `TINY_LLM_CONFIG` (tests that need a model without files)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mimo_epd.common.model_names import TINY_RANDOM, resolve_model

from ..paged_attention import ContiguousKV
from .mimo_v2_flash import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

__all__ = [
    "MiMoV2FlashConfig",
    "MiMoV2FlashForCausalLM",
    "ContiguousKV",
    "TINY_LLM_CONFIG",
    "PRO_SHAPE_CONFIG",
    "load_llm",
    "init_random_weights",
    "transformers_twin",
]

# `tiny-random`: 8 layers (full attention at 0 and 5, the MiMo rule), window 128, 8 experts top-2, hidden 256
# (= the tiny vision tower's output), a byte-level vocabulary (256 bytes + specials), seeded random weights.
TINY_LLM_CONFIG = MiMoV2FlashConfig(
    vocab_size=320,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    v_head_dim=32,
    sliding_window=129,
    moe_intermediate_size=128,
    num_experts_per_tok=2,
    n_routed_experts=8,
    bos_token_id=256,
    eos_token_id=257,
)
TINY_SEED = 0

# MiMo-V2.5-Pro's attention shape, for KV capacity accounting only (never instantiated with
# weights): 70 layers, 10 of them full attention, 8 KV heads in both layer types, head dims 192/128, window 128.
PRO_FULL_LAYERS = (0, 7, 15, 23, 31, 39, 47, 55, 62, 69)
PRO_SHAPE_CONFIG = MiMoV2FlashConfig(
    hidden_size=6144,
    num_hidden_layers=70,
    num_attention_heads=128,
    num_key_value_heads=8,
    swa_num_key_value_heads=8,
    head_dim=192,
    v_head_dim=128,
    sliding_window=129,
    layer_types=["full_attention" if i in PRO_FULL_LAYERS else "sliding_attention" for i in range(70)],
)


def init_random_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic dummy weights (norms at one, correction bias small, everything else N(0, std))."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.01)


def _to_packed_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints store MoE experts one by one (`experts.N.{gate,up,down}_proj.weight`) and sinks as
    `attention_sink_bias` (the MiMo release layout, which transformers also writes); the model keeps them
    packed (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) and as `sinks`."""
    import re

    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in state.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        elif k.endswith(".self_attn.attention_sink_bias"):
            out[k.replace("attention_sink_bias", "sinks")] = v
        else:
            out[k] = v
    for prefix, by_id in experts.items():
        ids = sorted(by_id)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_id[i]["gate_proj"], by_id[i]["up_proj"]]) for i in ids]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_id[i]["down_proj"] for i in ids])
    return out


def load_llm(name_or_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> MiMoV2FlashForCausalLM:
    """`tiny-random`, or a checkpoint directory (`tiny` is the shipped one). Weights stored in another dtype (the
    shipped bf16) are cast to `dtype`; the router stays fp32. MTP layers load when the config declares them."""
    if name_or_path == TINY_RANDOM:
        model = MiMoV2FlashForCausalLM(TINY_LLM_CONFIG)
        init_random_weights(model, TINY_SEED)
    else:
        model = _load_checkpoint(name_or_path)
    # The router stays in fp32 (as transformers keeps it), whatever the model dtype.
    model.to(device=device, dtype=dtype)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.float()
    return model.eval()


def _load_checkpoint(name_or_path: str, shapes_only: bool = False) -> MiMoV2FlashForCausalLM:
    """The checkpoint's model with its weights; `shapes_only`: built on the meta device from the safetensors
    headers alone (no tensor read), which checks every weight's name and shape against config.json."""
    d = Path(resolve_model(name_or_path))
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"model {name_or_path!r}: not {TINY_RANDOM!r} and not a checkpoint directory with a config.json"
        )
    cfg_dict = json.loads((d / "config.json").read_text())
    if cfg_dict.get("model_type") != "mimo_v2_flash":
        raise ValueError(f"model {name_or_path!r}: model_type {cfg_dict.get('model_type')!r} is not mimo_v2_flash")
    with torch.device("meta" if shapes_only else "cpu"):
        model = MiMoV2FlashForCausalLM(MiMoV2FlashConfig.from_hf_dict(cfg_dict))
    state = {}
    for f in sorted(d.glob("*.safetensors")):
        state.update(_header_tensors(f) if shapes_only else _read_tensors(f))
    keep_mtp = model.config.num_nextn_predict_layers > 0
    state = _to_packed_layout(
        {
            k: v.float() if v.is_floating_point() else v
            for k, v in state.items()
            if (keep_mtp or not k.startswith("model.mtp.")) and not k.startswith(_OTHER_TOWERS)
        }
    )
    from mimo_epd.common.checkpoint import load_weights

    missing, unexpected = load_weights(model, state, d)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"model {name_or_path!r}: checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
    return model


def check_llm_weights(name_or_path: str) -> None:
    """Raises ValueError (one line naming the directory) when the checkpoint's weights do not fit its config.json
    (a shape, a missing weight): read from the safetensors headers, before any process loads it."""
    if name_or_path != TINY_RANDOM:
        _load_checkpoint(name_or_path, shapes_only=True)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}  # safetensors dtype names


def _header_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Each tensor of a safetensors file as an empty meta tensor of its shape (floating or not, as stored)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {
        k: torch.empty(t["shape"], dtype=torch.float32 if t["dtype"] in _FLOATS else torch.int64, device="meta")
        for k, t in header.items()
        if k != "__metadata__"
    }


# Weights of a multimodal checkpoint that the encoder's towers read, not the LLM.
_OTHER_TOWERS = ("visual.", "model.visual.", "audio_tower.", "model.audio_tower.")


def transformers_twin(model: MiMoV2FlashForCausalLM):
    """The same weights in transformers' own `MiMoV2FlashForCausalLM` (baselines and parity checks)."""
    from transformers import MiMoV2FlashConfig as HFConfig
    from transformers import MiMoV2FlashForCausalLM as HFModel

    skip = ("model_type", "num_nextn_predict_layers")
    cfg = {k: v for k, v in model.config.to_hf_dict().items() if k not in skip and v is not None}
    p = next(model.parameters())
    hf = HFModel(HFConfig(**cfg)).to(dtype=p.dtype, device=p.device).eval()
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("model.mtp.")}  # transformers has none
    state = {**hf.state_dict(), **ours}
    missing = set(hf.state_dict()) - set(ours)
    if [k for k in missing if not k.endswith("e_score_correction_bias")]:
        raise ValueError(f"transformers expects weights the model lacks: {sorted(missing)[:5]}")
    hf.load_state_dict(state)
    return hf
