"""LLM model definitions and their loader: a `mimo_v2_flash` checkpoint directory (the shipped `tiny` is one),
or `tiny-random`, seeded random weights of `TINY_LLM_CONFIG` (tests that need a model without files)."""

from __future__ import annotations

from pathlib import Path

import torch

from mimo_epd.common.model_names import TINY_RANDOM, resolve_model

from ..paged_attention import ContiguousKV
from ..parallel.comm import SINGLE_RANK, Parallel
from .loader import LoadError, load_checkpoint, plan_checkpoint
from .mimo_v2_flash import MiMoV2FlashConfig, MiMoV2FlashForCausalLM
from .quant import fp8_dot_supported

__all__ = [
    "MiMoV2FlashConfig",
    "MiMoV2FlashForCausalLM",
    "ContiguousKV",
    "TINY_LLM_CONFIG",
    "PRO_SHAPE_CONFIG",
    "load_llm",
    "model_config",
    "LoadError",
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


def load_llm(
    name_or_path: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    fp8_weights: str = "keep",
    quantization: str = "",
    progress: bool = False,
    par: Parallel = SINGLE_RANK,
) -> MiMoV2FlashForCausalLM:
    """`tiny-random`, or a checkpoint directory in any released layout (`tiny` is the shipped one; loader.py).
    Weights stored in another dtype (the shipped bf16) are cast to `dtype`; the router stays fp32; FP8 layers stay
    FP8 (`fp8_weights="dequantize"`: into `dtype` at load; `"auto"`: kept on CUDA, dequantized elsewhere;
    `quantization="fp8"`: a bf16 checkpoint quantized at load). MTP layers load when the config declares them.
    `par`: one rank of a model-parallel replica: that rank's part only (llm_backend/parallel/shard.py; for
    `tiny-random` the whole seeded model is made first, then cut)."""
    fp8_weights = _fp8_weights(fp8_weights, device)
    if name_or_path == TINY_RANDOM:
        model = MiMoV2FlashForCausalLM(TINY_LLM_CONFIG)
        init_random_weights(model, TINY_SEED)
        if not par.shard.single:
            model = _cut(model, par)
        model.to(dtype=dtype)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.float()  # the router stays in fp32 (as transformers keeps it)
    else:
        model = load_checkpoint(_directory(name_or_path), dtype, fp8_weights, quantization, progress, par)
    return model.to(device=device).eval()


def _cut(whole: MiMoV2FlashForCausalLM, par: Parallel) -> MiMoV2FlashForCausalLM:
    """This rank's part of a whole model (parallel/shard.py's rules)."""
    cfg = whole.config
    part = MiMoV2FlashForCausalLM(cfg, par)
    state = {k: par.shard.take(k, v, cfg).clone() for k, v in whole.state_dict().items()}
    part.load_state_dict(state)
    return part


def model_config(name_or_path: str, device: str = "cpu", fp8_weights: str = "auto", quantization: str = ""):
    """The config `load_llm` would build the model from (FP8 layers as they would be kept), read without weights."""
    if name_or_path == TINY_RANDOM:
        return TINY_LLM_CONFIG
    return plan_checkpoint(
        _directory(name_or_path), fp8_weights=_fp8_weights(fp8_weights, device), quantization=quantization
    ).cfg


def _fp8_weights(fp8_weights: str, device: str) -> str:
    """`auto` resolved: FP8 resident where its GEMM runs on FP8 tensor cores, dequantized at load elsewhere."""
    if fp8_weights != "auto":
        return fp8_weights
    return "keep" if torch.device(device).type == "cuda" and fp8_dot_supported(device) else "dequantize"


def _directory(name_or_path: str) -> str:
    d = Path(resolve_model(name_or_path))
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"model {name_or_path!r}: not {TINY_RANDOM!r} and not a checkpoint directory with a config.json"
        )
    return str(d)


def check_llm_weights(name_or_path: str) -> None:
    """Raises ValueError (one line naming the file) when the checkpoint cannot be loaded exactly: its config, its
    shards and every weight's name, shape and format, read from config.json and the safetensors headers before any
    process loads it (loader.plan_checkpoint)."""
    if name_or_path != TINY_RANDOM:
        plan_checkpoint(_directory(name_or_path))


def transformers_twin(model: MiMoV2FlashForCausalLM):
    """The same weights in transformers' own `MiMoV2FlashForCausalLM` (baselines and parity checks)."""
    from transformers import MiMoV2FlashConfig as HFConfig
    from transformers import MiMoV2FlashForCausalLM as HFModel

    c = model.config
    if c.full_attention_sink or not c.swa_attention_sink or c.quant is not None:
        raise ValueError("transformers' mimo_v2_flash has sinks in sliding layers only and no FP8 layers here")
    skip = ("model_type", *MiMoV2FlashConfig.OURS)
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
