"""The MiMo checkpoints as released: their config keys, their weight formats and their QKV layouts.

Two config layouts name the same model (docs/model.md has the table):
- the **original** one Xiaomi ships and SGLang / vLLM read: `model_type` `mimo_v2_flash` (V2-Flash) or `mimo_v2`
  (V2.5, V2.5-Pro, V2.6), with `hybrid_layer_pattern` (1 = sliding window), `moe_layer_freq` (1 = MoE),
  `swa_*` twins of the attention keys, `sliding_window_size` (the window W), `rope_theta` / `swa_rope_theta`,
  `layernorm_epsilon`, `attention_projection_layout`, `quantization_config`;
- transformers' **converted** one (`layer_types`, `mlp_layer_types`, `rope_parameters`, `sliding_window` = W + 1):
  what the shipped `tiny` and transformers' `save_pretrained` write.

`read_config(d, path)` takes either and returns the model's `MiMoV2FlashConfig`. It is strict: a key it does not
know, a value it does not understand (a scoring function other than sigmoid, an FP8 format other than e4m3 with
dynamic activations), or two keys that disagree (`hybrid_layer_pattern` against `layer_types`, `sliding_window`
against `sliding_window_size`, a pattern whose length is not `num_hidden_layers`) raise `ConfigError` naming the
key: a checkpoint that cannot be read exactly is refused, never served with a guessed default.

Weight formats (`WeightFormat`): `bf16` / `fp32` as stored, or `fp8` (float8_e4m3fn weights with fp32
`*.weight_scale_inv` per `weight_block_size` block, llm_backend/kernels/fp8.py). Which linear layers are FP8 is the
files' to say (an FP8 weight carries its `weight_scale_inv`); the loader refuses an FP8 weight in a layer the
config's `ignored_layers` / `modules_to_not_convert` leaves unquantized, FP8 weights without a
`quantization_config`, and scales of a dtype other than a float. A layer stored bf16 in an FP8 checkpoint loads as
bf16 (exact either way: the release's own lists name MTP layers under other names).
"""

from __future__ import annotations

import re

from mimo_epd.common.omni_prompt import TOKEN_KEYS

from .mimo_v2_flash import MiMoV2FlashConfig
from .quant import Fp8Spec

MODEL_TYPES = ("mimo_v2_flash", "mimo_v2")
LAYOUTS = ("split", "fused_qkv")


class ConfigError(ValueError):
    """A config.json the loader cannot read exactly; the message names the key."""


# Keys that say nothing the LLM needs (bookkeeping, training, the encoders' own sub-configs). Anything else that
# neither layout defines is refused by name.
_IGNORED = {
    "architectures",
    "auto_map",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "initializer_range",
    "use_cache",
    "attention_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "pad_token_id",
    "vision_config",
    "audio_config",
    "processor_config",
    *TOKEN_KEYS,  # the media token ids (mimo_epd/common/omni_prompt.py reads them)
    "_name_or_path",
    "use_sliding_window",
    "swa_sliding_window",  # never seen with another value than sliding_window_size; checked below when present
    "max_window_layers",
    "tokenizer_class",
}
# Keys both layouts share (the model's own fields).
_COMMON = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "v_head_dim",
    "hidden_act",
    "max_position_embeddings",
    "attention_bias",
    "attention_value_scale",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "n_routed_experts",
    "num_local_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "num_nextn_predict_layers",
    "quantization_config",
    "rms_norm_eps",
    "sliding_window",
}
_CONVERTED = {"layer_types", "mlp_layer_types", "rope_parameters", "rope_scaling", "swa_num_key_value_heads"}
_CONVERTED |= {"sliding_window_size"}  # transformers keeps the kwarg it was built from: sliding_window - 1
_ORIGINAL = {
    "hybrid_layer_pattern",
    "moe_layer_freq",
    "swa_num_attention_heads",
    "swa_num_key_value_heads",
    "swa_head_dim",
    "swa_v_head_dim",
    "rope_theta",
    "swa_rope_theta",
    "partial_rotary_factor",
    "sliding_window_size",
    "add_swa_attention_sink_bias",
    "add_full_attention_sink_bias",
    "layernorm_epsilon",
    "scoring_func",
    "topk_method",
    "moe_router_dtype",
    "attention_projection_layout",
    "first_k_dense_replace",
    "rope_scaling",
    "attention_chunk_size",
    "hybrid_block_size",
    "n_shared_experts",
    "swa_qk_head_dim",
}


_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor"}
# The original layout's keys that change outputs but no weight's shape: required, never defaulted.
_REQUIRED = (
    "hybrid_layer_pattern",
    "sliding_window_size",
    "rope_theta",
    "swa_rope_theta",
    "partial_rotary_factor",
    "layernorm_epsilon",
    "add_swa_attention_sink_bias",
)


def _fail(path: str, key: str, reason: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {reason}")


def _pattern(d: dict, key: str, n: int, path: str) -> list[int]:
    v = d[key]
    if not isinstance(v, list) or not all(x in (0, 1) and not isinstance(x, bool) for x in v):
        raise _fail(path, key, f"expected a list of 0 / 1 per layer, got {str(v)[:60]}")
    if len(v) != n:
        raise _fail(path, key, f"{len(v)} entries for num_hidden_layers {n}")
    return v


def _same(d: dict, a: str, b: str, path: str, b_of_a=lambda x: x) -> None:  # noqa: B008 - a pure default
    if a in d and b in d and d[a] is not None and d[b] is not None and b_of_a(d[a]) != d[b]:
        raise _fail(path, b, f"{d[b]!r} disagrees with {a} {d[a]!r}")


def _quantization(q, path: str) -> Fp8Spec | None:
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _fail(path, "quantization_config", "not an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise _fail(path, "quantization_config.quant_method", f"{method!r} is not supported (fp8 block weights are)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise _fail(path, "quantization_config.fmt", f"{q.get('fmt')!r}: only e4m3 FP8 weights are supported")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise _fail(
            path,
            "quantization_config.activation_scheme",
            f"{q.get('activation_scheme')!r}: only dynamic activation scales are supported",
        )
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _fail(path, "quantization_config.weight_block_size", f"expected [rows, cols], got {block!r}")
    store = q.get("store_dtype", "fp8")
    if store not in ("fp8", "mxfp4"):
        raise _fail(path, "quantization_config.store_dtype", f"{store!r} is not fp8 or mxfp4")
    mx = q.get("mxfp4_block_size", 32 if store == "mxfp4" else None)
    if store == "mxfp4" and mx != 32:
        raise _fail(path, "quantization_config.mxfp4_block_size", f"{mx!r}: MXFP4 blocks are 32 values")
    if store == "fp8" and q.get("mxfp4_block_size") is not None:
        raise _fail(path, "quantization_config.mxfp4_block_size", "given, but store_dtype is fp8")
    known = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers"}
    known |= {"modules_to_not_convert", "scale_fmt", "store_dtype", "mxfp4_block_size"}
    for k in q:
        if k not in known:
            raise _fail(path, f"quantization_config.{k}", "not a key this loader understands")
    if q.get("scale_fmt") not in (None, "float"):
        raise _fail(path, "quantization_config.scale_fmt", f"{q['scale_fmt']!r}: only float scales are supported")
    ignored = list(q.get("ignored_layers") or []) + list(q.get("modules_to_not_convert") or [])
    if not all(isinstance(x, str) for x in ignored):
        raise _fail(path, "quantization_config.ignored_layers", "expected a list of module names")
    return Fp8Spec(block=(block[0], block[1]), ignored=tuple(ignored), mxfp4_block=32 if store == "mxfp4" else 0)


def is_original(d: dict) -> bool:
    """Whether `d` is in the original (release) layout rather than transformers' converted one."""
    return d.get("model_type") == "mimo_v2" or any(k in d for k in ("hybrid_layer_pattern", "moe_layer_freq"))


def read_config(d: dict, path: str = "config.json") -> MiMoV2FlashConfig:
    """A checkpoint's config.json (either layout) as the model's config; ConfigError names the key otherwise."""
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _fail(path, "model_type", f"{model_type!r} is not a MiMo LLM ({', '.join(MODEL_TYPES)})")
    original = is_original(d)
    allowed = _IGNORED | _COMMON | (_ORIGINAL if original else _CONVERTED)
    for k in d:
        if k not in allowed:
            other = "transformers' converted" if k in _CONVERTED else "the original" if k in _ORIGINAL else ""
            reason = (
                f"a key of {other} layout in an {'original' if original else 'converted'}-layout config"
                if other
                else "not a key this loader understands"
            )
            raise _fail(path, k, reason)
    if d.get("hidden_act", "silu") != "silu":
        raise _fail(path, "hidden_act", f"{d['hidden_act']!r}: MiMo's MLPs are SwiGLU (silu)")
    rs = d.get("rope_scaling")
    if rs not in (None, {}) and not (
        isinstance(rs, dict) and {rs.get("rope_type"), rs.get("type")} <= {"default", None}
    ):
        raise _fail(path, "rope_scaling", f"{rs!r}: rope scaling other than default is not supported")
    cfg = _read_original(d, path) if original else _read_converted(d, path)
    cfg.quant = _quantization(d.get("quantization_config"), path)
    _check(cfg, path, original)
    return cfg


# Fields whose null has a meaning (passed through: __post_init__ reads it) rather than "use the default".
_NULL_MEANS = (
    "attention_value_scale",
    "routed_scaling_factor",
    "bos_token_id",
    "eos_token_id",
    "max_position_embeddings",
)


def _base_kwargs(d: dict, path: str) -> dict:
    from dataclasses import fields

    known = {f.name for f in fields(MiMoV2FlashConfig)}
    kw = {
        k: v
        for k, v in d.items()
        if k in known and k in _COMMON and (v is not None or k in _NULL_MEANS) and k != "quantization_config"
    }
    if "num_local_experts" in d and "n_routed_experts" not in d:
        kw["n_routed_experts"] = d["num_local_experts"]
    _same(d, "num_local_experts", "n_routed_experts", path)
    return kw


def _read_converted(d: dict, path: str) -> MiMoV2FlashConfig:
    kw = _base_kwargs(d, path)
    rope = d.get("rope_parameters")
    if rope is not None:
        kinds = set(d.get("layer_types") or ["full_attention", "sliding_attention"])
        if not isinstance(rope, dict) or not kinds <= set(rope):
            raise _fail(path, "rope_parameters", f"expected one entry per layer type ({', '.join(sorted(kinds))})")
        for kind, p in rope.items():
            if not isinstance(p, dict) or p.get("rope_type", "default") != "default" or set(p) - _ROPE_KEYS:
                raise _fail(
                    path, f"rope_parameters.{kind}", f"{p!r}: only default rope (rope_theta, partial_rotary_factor)"
                )
            if "rope_theta" not in p or "partial_rotary_factor" not in p:
                raise _fail(path, f"rope_parameters.{kind}", "needs rope_theta and partial_rotary_factor")
    for k in ("layer_types", "mlp_layer_types", "rope_parameters", "swa_num_key_value_heads"):
        if d.get(k) is not None:
            kw[k] = d[k]
    w = d.get("sliding_window_size")
    if w is not None and "sliding_window" not in kw:
        kw["sliding_window"] = w + 1  # transformers' __post_init__ rule
    elif w is not None and kw["sliding_window"] != w + 1:
        raise _fail(
            path, "sliding_window_size", f"{w} disagrees with sliding_window {kw['sliding_window']} (= W + 1 here)"
        )
    n = kw.get("num_hidden_layers", 48)
    for key, values in (
        ("layer_types", ("full_attention", "sliding_attention")),
        ("mlp_layer_types", ("dense", "sparse")),
    ):
        if key in kw and (len(kw[key]) != n or any(x not in values for x in kw[key])):
            raise _fail(path, key, f"expected {n} entries of {' / '.join(values)}")
    return MiMoV2FlashConfig(**kw)


def _read_original(d: dict, path: str) -> MiMoV2FlashConfig:
    kw = _base_kwargs(d, path)
    n = d.get("num_hidden_layers")
    if not isinstance(n, int):
        raise _fail(path, "num_hidden_layers", "missing (the original layout states it)")
    for key in _REQUIRED:  # what changes outputs without changing a weight's shape: never a guessed default
        if d.get(key) is None:
            raise _fail(path, key, "missing (the original layout states it)")
    if "attention_value_scale" not in d:
        raise _fail(path, "attention_value_scale", "missing (the original layout states it; null means 1.0)")
    if d.get("moe_layer_freq") is None and d.get("first_k_dense_replace") is None:
        raise _fail(path, "moe_layer_freq", "missing (the original layout states it)")
    kw["layer_types"] = [
        "sliding_attention" if x else "full_attention" for x in _pattern(d, "hybrid_layer_pattern", n, path)
    ]
    if d.get("moe_layer_freq") is not None:
        kw["mlp_layer_types"] = ["sparse" if x else "dense" for x in _pattern(d, "moe_layer_freq", n, path)]
    elif d.get("first_k_dense_replace") is not None:
        k = d["first_k_dense_replace"]
        kw["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(n)]
    _same(d, "moe_layer_freq", "first_k_dense_replace", path, lambda p: next((i for i, x in enumerate(p) if x), len(p)))
    w = d["sliding_window_size"]
    if not isinstance(w, int) or w <= 0:
        raise _fail(path, "sliding_window_size", f"expected the window in tokens, got {w!r}")
    # The release's window counts the current token: a sliding layer attends to the last W keys, itself included
    # (Xiaomi's modeling code, vLLM's per-layer window, transformers' conversion script, which keeps
    # `sliding_window` = W). The model's `sliding_window` has that meaning (q_pos - k_pos < sliding_window).
    kw["sliding_window"] = w
    for key in ("sliding_window", "attention_chunk_size", "swa_sliding_window"):
        if d.get(key) is not None and d[key] != w:
            raise _fail(path, key, f"{d[key]!r} disagrees with sliding_window_size {w}")
    for a, b in (
        ("num_attention_heads", "swa_num_attention_heads"),
        ("head_dim", "swa_head_dim"),
        ("v_head_dim", "swa_v_head_dim"),
        ("head_dim", "swa_qk_head_dim"),
    ):
        if d.get(b) is not None and d.get(a) is not None and d[a] != d[b]:
            raise _fail(
                path, b, f"{d[b]} != {a} {d[a]}: sliding and full layers with different head shapes are not supported"
            )
    if d.get("swa_num_key_value_heads") is not None:
        kw["swa_num_key_value_heads"] = d["swa_num_key_value_heads"]
    else:
        raise _fail(path, "swa_num_key_value_heads", "missing (the original layout states it)")
    _same(d, "layernorm_epsilon", "rms_norm_eps", path)
    if d.get("layernorm_epsilon") is not None:
        kw["rms_norm_eps"] = d["layernorm_epsilon"]
    rotary = d["partial_rotary_factor"]
    kw["rope_parameters"] = {
        "full_attention": {
            "rope_type": "default",
            "rope_theta": float(d["rope_theta"]),
            "partial_rotary_factor": rotary,
        },
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": float(d["swa_rope_theta"]),
            "partial_rotary_factor": rotary,
        },
    }
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise _fail(path, "scoring_func", f"{d['scoring_func']!r}: only sigmoid router scores are supported")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _fail(path, "topk_method", f"{d['topk_method']!r}: only noaux_tc routing is supported")
    if d.get("moe_router_dtype") not in (None, "fp32", "float32", "bf16", "bfloat16"):
        raise _fail(path, "moe_router_dtype", f"{d['moe_router_dtype']!r} is not fp32 or bf16")
    if d.get("hybrid_block_size") is not None:
        raise _fail(
            path, "hybrid_block_size", f"{d['hybrid_block_size']!r}: only null (per-layer patterns) is supported"
        )
    if d.get("n_shared_experts") not in (None, 0):
        raise _fail(path, "n_shared_experts", f"{d['n_shared_experts']!r}: MiMo has no shared experts")
    layout = d.get("attention_projection_layout", "split")
    if layout not in LAYOUTS:
        raise _fail(path, "attention_projection_layout", f"{layout!r} is not {' or '.join(LAYOUTS)}")
    kw["attention_projection_layout"] = layout
    kw["swa_attention_sink"] = bool(d["add_swa_attention_sink_bias"])
    kw["full_attention_sink"] = bool(d.get("add_full_attention_sink_bias", False))
    return MiMoV2FlashConfig(**kw)


def _check(cfg: MiMoV2FlashConfig, path: str, original: bool) -> None:
    """What the model cannot run, refused by name."""
    for kind in ("full_attention", "sliding_attention"):
        # transformers' layout runs an odd count its own way (ceil to pairs: tiny's 21 rotate as 22); the release's
        # engines cannot, so a released-layout config with one is refused.
        if kind not in cfg.layer_types or not original:
            continue
        rotary = int(cfg.head_dim * cfg.rope_parameters[kind]["partial_rotary_factor"])
        if rotary % 2:
            raise _fail(
                path,
                "partial_rotary_factor",
                f"rotates {rotary} of head_dim {cfg.head_dim} dims: an odd count has no rotary pairs",
            )
    for layer in range(cfg.num_hidden_layers):
        if cfg.num_attention_heads % cfg.kv_heads(layer):
            raise _fail(
                path,
                "num_key_value_heads",
                f"{cfg.kv_heads(layer)} KV heads do not divide num_attention_heads {cfg.num_attention_heads}",
            )
    if cfg.n_routed_experts % max(cfg.n_group, 1) or cfg.topk_group > cfg.n_group:
        raise _fail(path, "n_group", f"{cfg.n_group} groups / top {cfg.topk_group} over {cfg.n_routed_experts} experts")
    if cfg.attention_projection_layout == "fused_qkv":
        n = cfg.num_key_value_heads
        for layer in range(cfg.num_hidden_layers):
            if cfg.kv_heads(layer) % n or cfg.num_attention_heads % n:
                raise _fail(
                    path,
                    "attention_projection_layout",
                    f"fused_qkv pre-split {n} ways (num_key_value_heads) cannot split layer {layer}'s "
                    f"{cfg.kv_heads(layer)} KV / {cfg.num_attention_heads} query heads evenly",
                )


# ------------------------------------------------------------------------------- fused pre-split QKV


def qkv_chunks(cfg: MiMoV2FlashConfig, layer: int) -> tuple[int, int, int, int]:
    """A fused layer's pre-split: (chunks, q rows, k rows, v rows) per chunk. The checkpoint is pre-split for
    `num_key_value_heads` ranks (the full layers' KV heads): chunk i holds query heads i*Hq/n.., KV heads
    i*Hkv/n.. of the layer (a V2.5 sliding layer: 16 query and 2 KV heads, 3072 + 384 + 256 = 3712 rows)."""
    n = cfg.num_key_value_heads
    hq, hkv = cfg.num_attention_heads // n, cfg.kv_heads(layer) // n
    return n, hq * cfg.head_dim, hkv * cfg.head_dim, hkv * cfg.v_head_dim


_QKV = re.compile(r"^(.*\.self_attn)\.qkv_proj\.(weight|weight_scale_inv)$")


def release_config(cfg: MiMoV2FlashConfig) -> dict:
    """`cfg` in the original (release) layout of a `mimo_v2_flash` checkpoint: what `read_config` reads back as
    the same config (the shipped `tiny` is written so). Per-type head shapes are equal here, as in every release."""
    full = cfg.rope_parameters["full_attention"]
    swa = cfg.rope_parameters.get("sliding_attention", full)
    if full.get("partial_rotary_factor") != swa.get("partial_rotary_factor"):
        raise ValueError("the original layout has one partial_rotary_factor for both layer types")
    out = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "swa_num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "swa_num_key_value_heads": cfg.swa_num_key_value_heads or 2 * cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "swa_head_dim": cfg.head_dim,
        "v_head_dim": cfg.v_head_dim,
        "swa_v_head_dim": cfg.v_head_dim,
        "hidden_act": cfg.hidden_act,
        "partial_rotary_factor": full["partial_rotary_factor"],
        "rope_theta": full["rope_theta"],
        "swa_rope_theta": swa["rope_theta"],
        "sliding_window_size": cfg.sliding_window,  # W keys, the current one included
        "hybrid_layer_pattern": [int(t == "sliding_attention") for t in cfg.layer_types],
        "moe_layer_freq": [int(t == "sparse") for t in cfg.mlp_layer_types],
        "add_swa_attention_sink_bias": cfg.swa_attention_sink,
        "add_full_attention_sink_bias": cfg.full_attention_sink,
        "attention_value_scale": cfg.attention_value_scale,
        "attention_bias": cfg.attention_bias,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob,
        "layernorm_epsilon": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
    }
    if cfg.max_position_embeddings is not None:
        out["max_position_embeddings"] = cfg.max_position_embeddings
    return out
