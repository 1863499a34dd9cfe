"""Random MiMo checkpoints in the exact layouts Xiaomi releases: config keys, tensor names, dtypes, shards, index.

`write_checkpoint(out, like, weights, scale)` writes what `mimo-epd make-checkpoint` promises: a directory that
loads through the same code as the downloaded model, small enough for the machine at hand, so a deployment can be
rehearsed (and the loader tested) before 300 GB are fetched.

What each `like` reproduces (docs/model.md has the table and the sources):
- `v2-flash`: `model_type: mimo_v2_flash`, `MiMoV2FlashForCausalLM`, separate q/k/v whose FP8 scales are tiled per
  pre-split chunk (n = num_key_value_heads; a full layer's k_proj of 4 x 192 rows carries 8 scale rows), full
  attention at layer 0 and every 6th, KV heads 4 (full) / 8 (sliding), 3 MTP layers under `model.mtp.layers.{i}`.
- `v2.5`: `model_type: mimo_v2`, `MiMoV2ForCausalLM`, `attention_projection_layout: fused_qkv`: one `qkv_proj` per
  layer laid out `[Q_0|K_0|V_0|...|Q_n|K_n|V_n]` with each chunk's own block scales; `o_proj` left bf16
  (`ignored_layers`), `store_dtype: fp8`, rope theta 1e7.
- `v2.5-pro`: as v2.5 with 8 KV heads in both layer types (pre-split 8 ways), 70 layers' pattern (full at 0, 7, 15,
  ...; scaled down keeps the first and the seventh), value scale 0.612.
- `v2.6`: as v2.5 with a bf16 router (`moe_router_dtype`), 3 MTP layers, `layernorm_epsilon` 1e-6.
- `v2.5` also carries MiMo's vision tower: a `vision_config` with `model_type: mimovl` in the released spelling
  (`in_chans`, `num_query_groups`, `spatial_patch_size`, no `qk_channels`: 64), window and full blocks, sinks, and
  its bf16 weights under `visual.*` in the last shard (`_vision`); and MiMo's audio path: an `audio_config`, the
  audio encoder's weights (`speech_embeddings.{c}`, `audio_encoder.input_local_transformer.*`,
  `audio_encoder.projection.*`) and the MiMo-Audio tokenizer in its own folder `audio_tokenizer/` (config.json +
  model.safetensors: `encoder.*` in bf16, fp32 codebooks) (`_audio`). Scaled down from the layout public sources
  describe (not checked against Xiaomi's files); every code path kept: sliding and full layers, the skip, the
  pooler, codebooks of several sizes, fewer channels than quantisers, a two-layer projection.

Weights: `bf16` (as a bf16 release would be), `fp8` (float8_e4m3fn, fp32 `weight_scale_inv` per 128 x 128 block;
the router gate, its correction bias, norms, embeddings, LM head and `o_proj` as the release keeps them) or, for
`v2.6`, `mxfp4`: FP8 as above with the routed experts in MXFP4 (uint8 weights holding two e2m1 codes, the low nibble
the even column; uint8 e8m0 `weight_scale` per 32 values; `store_dtype: mxfp4`, `mxfp4_block_size: 32`: the layout
as third-party readers of the V2.6 release describe it, not checked against Xiaomi's files). Each
weight's rows get a random magnitude, so neighbouring blocks have very different scales and a loader that
applies a scale to the wrong rows is wrong by a lot, not by a little.

The tokenizer, chat template and generation config are the shipped `tiny` model's (vocabulary 4096), so `serve DIR`
answers at once. `v2.5` adds MiMo's media tokens to that tokenizer (`OMNI_TOKENS`, ids 4096 on, special), names
their ids in `config.json`'s `processor_config` as the release does, renders media parts in its chat template as
MiMo's placeholders, and pads the vocabulary to 4224 (a release pads its 152k too): its prompts take the omni
layout (mimo_epd/common/omni_prompt.py). The video start / end tokens' spellings are ours; the ids are what count.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from mimo_epd.common.model_names import resolve_model
from mimo_epd.common.omni_prompt import PLACEHOLDER

from ..kernels.fp8 import mxfp4_quantize, quantize

LIKES = ("v2-flash", "v2.5", "v2.5-pro", "v2.6")
WEIGHTS = ("bf16", "fp8", "mxfp4")
SCALES = ("tiny", "small")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_full: int
    kv_swa: int
    head_dim: int
    v_head_dim: int
    experts: int
    top_k: int
    moe_inter: int
    inter: int
    window: int
    mtp: int


def shape_of(like: str, scale: str) -> Shape:
    pro = like == "v2.5-pro"
    mtp = 3 if like in ("v2-flash", "v2.6") else 0
    if scale == "tiny":  # every projection <= 128 rows per chunk or a multiple of 128: transformers' FP8 path agrees
        return Shape(256, 8, 16 if pro else 8, 8 if pro else 4, 8, 48, 32, 8, 2, 128, 512, 32, mtp)
    return Shape(1024, 12, 32 if pro else 16, 8 if pro else 4, 8, 96, 64, 32, 4, 512, 2048, 128, mtp)


def _pattern(like: str, n: int) -> list[int]:
    """1 = sliding window (the release's hybrid_layer_pattern)."""
    if like == "v2.5-pro":
        full = {0, 7, 15, 23, 31, 39, 47, 55, 62, 69}
        return [0 if i in full else 1 for i in range(n)]
    return [0 if (i == 0 or (i + 1) % 6 == 0) else 1 for i in range(n)]


def make_config(like: str, weights: str, s: Shape) -> dict:
    """config.json with the release's keys (and only those)."""
    flash = like == "v2-flash"
    cfg: dict = {
        "architectures": ["MiMoV2FlashForCausalLM" if flash else "MiMoV2ForCausalLM"],
        "model_type": "mimo_v2_flash" if flash else "mimo_v2",
        "vocab_size": OMNI_VOCAB if like == "v2.5" else 4096,
        "hidden_size": s.hidden,
        "intermediate_size": s.inter,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "swa_num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_full,
        "swa_num_key_value_heads": s.kv_swa,
        "head_dim": s.head_dim,
        "swa_head_dim": s.head_dim,
        "v_head_dim": s.v_head_dim,
        "swa_v_head_dim": s.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 262144 if flash else 1048576,
        "partial_rotary_factor": 0.334,
        "rope_theta": 5000000.0 if flash else 10000000.0,
        "swa_rope_theta": 10000.0,
        "rope_scaling": None if flash else {"rope_type": "default", "type": "default"},
        "sliding_window": s.window,
        "sliding_window_size": s.window,
        "attention_chunk_size": s.window,
        "hybrid_layer_pattern": _pattern(like, s.layers),
        "moe_layer_freq": [0] + [1] * (s.layers - 1),
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": 0.612 if like == "v2.5-pro" else 0.707,
        "attention_bias": False,
        "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.moe_inter,
        "n_shared_experts": None,
        "routed_scaling_factor": None,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "layernorm_epsilon": 1e-6 if like == "v2.6" else 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": [2, 0],
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "initializer_range": 0.02,
    }
    if not flash:
        cfg["attention_projection_layout"] = "fused_qkv"
        cfg["hybrid_block_size"] = None
    if like == "v2.6":
        cfg["moe_router_dtype"] = "bfloat16"
    if s.mtp:
        cfg["num_nextn_predict_layers"] = s.mtp
    if weights in ("fp8", "mxfp4"):
        q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
        if not flash:
            q["store_dtype"] = "mxfp4" if weights == "mxfp4" else "fp8"
            q["ignored_layers"] = [f"model.layers.{i}.self_attn.o_proj" for i in range(s.layers)]
            q["ignored_layers"].append("model.decoder.self_attn.o_proj")
        if weights == "mxfp4":
            q["mxfp4_block_size"] = 32
        cfg["quantization_config"] = q
    return cfg


OMNI_VOCAB = 4224  # v2.5: the tiny tokenizer's 4096 tokens, MiMo's media tokens, padding to a multiple of 128
OMNI_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|mimo_audio_start|>",
    "<|mimo_audio_end|>",
    "<|audio_pad|>",
    "<|mimo_video_start|>",
    "<|mimo_video_end|>",
)


class _Rand:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def weight(self, rows: int, cols: int, std: float = 0.02) -> torch.Tensor:
        """N(0, std) with a log-normal magnitude per row: block scales differ a lot between neighbouring rows."""
        mag = torch.exp(0.7 * torch.randn(rows, 1, generator=self.g))
        return torch.randn(rows, cols, generator=self.g) * std * mag

    def vec(self, n: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(n, generator=self.g) * std


class _Writer:
    """Collects one file's tensors (weights in bf16 or FP8 + scales; experts in MXFP4 when asked) and saves them."""

    def __init__(self, fp8: bool, mxfp4: bool = False):
        self.fp8, self.mxfp4 = fp8, mxfp4
        self.files: dict[str, dict[str, torch.Tensor]] = {}

    def put(self, file: str, name: str, t: torch.Tensor, dtype=torch.bfloat16) -> None:
        self.files.setdefault(file, {})[name] = t.to(dtype).contiguous()

    def linear(self, file: str, name: str, w: torch.Tensor, chunks: int = 1, quantized: bool = True) -> None:
        """A linear weight; FP8 with scales tiled per chunk of rows when `chunks` > 1 (the release's pre-split);
        a routed expert's in MXFP4 (packed uint8 codes, uint8 e8m0 `weight_scale`) when the writer says so."""
        if self.mxfp4 and ".mlp.experts." in name:
            codes, scales = mxfp4_quantize(w)
            self.put(file, f"{name}.weight", codes, torch.uint8)
            self.put(file, f"{name}.weight_scale", scales, torch.uint8)
            return
        if not (self.fp8 and quantized):
            self.put(file, f"{name}.weight", w)
            return
        qs, ss = zip(*(quantize(c) for c in w.chunk(chunks, dim=0)))
        self.put(file, f"{name}.weight", torch.cat(qs), qs[0].dtype)
        self.put(file, f"{name}.weight_scale_inv", torch.cat(ss), torch.float32)


def _attention(w: _Writer, r: _Rand, file: str, p: str, like: str, s: Shape, sliding: bool) -> None:
    hkv = s.kv_swa if sliding else s.kv_full
    n = s.kv_full  # the release pre-splits for num_key_value_heads ranks
    q = r.weight(s.heads * s.head_dim, s.hidden)
    k = r.weight(hkv * s.head_dim, s.hidden)
    v = r.weight(hkv * s.v_head_dim, s.hidden)
    if like == "v2-flash":
        for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            w.linear(file, f"{p}.{name}", t, chunks=n)
    else:
        fused = torch.cat([torch.cat(parts) for parts in zip(q.chunk(n), k.chunk(n), v.chunk(n))])
        w.linear(file, f"{p}.qkv_proj", fused, chunks=n)
    w.linear(file, f"{p}.o_proj", r.weight(s.hidden, s.heads * s.v_head_dim), quantized=like == "v2-flash")
    if sliding:
        w.put(file, f"{p}.attention_sink_bias", r.vec(s.heads))


def _mlp(w: _Writer, r: _Rand, file: str, p: str, s: Shape, inter: int) -> None:
    for name, (rows, cols) in (
        ("gate_proj", (inter, s.hidden)),
        ("up_proj", (inter, s.hidden)),
        ("down_proj", (s.hidden, inter)),
    ):
        w.linear(file, f"{p}.{name}", r.weight(rows, cols))


def vision_config(s: Shape) -> dict:
    """V2.5's `vision_config`, scaled down: its keys and rules, 4 blocks (full at 0; row, column and row windows
    after it), output = the LLM's hidden size."""
    return {
        "model_type": "mimovl",
        "depth": 4,
        "hidden_size": 128,
        "intermediate_size": 192,
        "out_hidden_size": s.hidden,
        "num_heads": 4,
        "num_key_value_heads": 2,
        "num_query_groups": 2,
        "in_chans": 3,
        "patch_size": 16,
        "spatial_patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "hidden_act": "silu",
        "use_sink": True,
        "window_size": 128,
        "visual_token_window_size": 16,
        "fullatt_block_indexes": [0],
        "vit_window_attn_types": [-1, 0, 1, 0],
    }


def _vision(w: _Writer, r: _Rand, file: str, v: dict) -> None:
    """The tower's weights under `visual.*`, bf16 (the release keeps its towers in bf16), fused qkv rows [Q|K|V]."""
    hid, inter, heads, kv, qk = v["hidden_size"], v["intermediate_size"], v["num_heads"], v["num_key_value_heads"], 64
    p, t, merged = v["patch_size"], v["temporal_patch_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    w.put(file, "visual.patch_embed.proj.weight", r.weight(hid, 3 * t * p * p).view(hid, 3, t, p, p))
    for i in range(v["depth"]):
        b = f"visual.blocks.{i}"
        for norm in ("norm1", "norm2"):
            w.put(file, f"{b}.{norm}.weight", 1 + r.vec(hid, 0.1))
        w.put(file, f"{b}.attn.qkv.weight", r.weight((heads + 2 * kv) * qk, hid, 0.1))
        w.put(file, f"{b}.attn.qkv.bias", r.vec((heads + 2 * kv) * qk, 0.02))
        w.put(file, f"{b}.attn.proj.weight", r.weight(hid, heads * qk))
        w.put(file, f"{b}.attn.proj.bias", r.vec(hid, 0.02))
        if v["use_sink"] and i not in v["fullatt_block_indexes"]:
            w.put(file, f"{b}.attn.sinks", r.vec(heads))
        for name, (rows, cols) in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter))):
            w.put(file, f"{b}.mlp.{name}.weight", r.weight(rows, cols))
            w.put(file, f"{b}.mlp.{name}.bias", r.vec(rows, 0.02))
    w.put(file, "visual.merger.ln_q.weight", 1 + r.vec(hid, 0.1))
    w.put(file, "visual.merger.mlp.0.weight", r.weight(merged, merged))
    w.put(file, "visual.merger.mlp.2.weight", r.weight(v["out_hidden_size"], merged))


AUDIO_TOKENIZER = {
    "d_model": 32,
    "n_mels": 128,
    "kernel_size": 3,
    "stride_size": 2,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "activation_function": "gelu",
    "encoder_causal": True,
    "encoder_attn_window_size": [4, 0],
    "hybrid_attention": True,
    "swa_per_block": 2,
    "encoder_skip_layer_id": 1,
    "avg_pooler": 2,
    "num_quantizers": 3,
    "codebook_size": [16, 8, 8],
    "rope_theta": 10000,
    "rope_type": "default",
    "ln_type": "LayerNorm",
    "scale_embedding": False,
    "sampling_rate": 24000,
    "hop_length": 240,
    "max_audio_seconds": 300,
}


def audio_config(s: Shape) -> dict:
    return {
        "speech_vocab_size": "17-9",
        "speech_zeroemb_idx": "16-8",
        "group_size": 4,
        "audio_channels": 2,
        "input_local_layers": 1,
        "input_local_dim": 32,
        "input_full_attention": True,
        "input_local_attn_heads": 2,
        "input_local_head_dim": 16,
        "input_local_intermediate_size": 64,
        "out_hidden_size": s.hidden,
        "rope_theta": 640000.0,
        "partial_rotary_factor": 1.0,
        "projection_layers": 2,
        "add_post_norm": True,
        "audio_segment_size": 6000,
    }


def processor_config() -> dict:
    """The v2.5 config's `processor_config`: the media token ids (the tiny tokenizer's 4096 tokens, then
    `OMNI_TOKENS` in order) and the video sampling of MiMo's processor (2 fps, 8 to 256 frames); pixel bounds left
    to the processor's defaults."""
    ids = {name: 4096 + i for i, name in enumerate(OMNI_TOKENS)}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_token_id": ids["<|audio_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "audio_start_token_id": ids["<|mimo_audio_start|>"],
        "audio_end_token_id": ids["<|mimo_audio_end|>"],
        "video_start_token_id": ids["<|mimo_video_start|>"],
        "video_end_token_id": ids["<|mimo_video_end|>"],
        "fps": 2.0,
        "max_frames": 256,
        "min_frames": 8,
    }


def _omni_tokenizer(out: str) -> None:
    """The tiny tokenizer with MiMo's media tokens added (special, ids 4096 on) and a chat template that renders
    each media part as MiMo's placeholder string (mimo_epd/common/omni_prompt.py)."""
    path = os.path.join(out, "tokenizer.json")
    with open(path, encoding="utf-8") as fh:
        tok = json.load(fh)
    for i, content in enumerate(OMNI_TOKENS):
        tok["added_tokens"].append(
            {
                "id": 4096 + i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(tok, fh, ensure_ascii=False)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    text_only = "{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    if text_only not in cfg["chat_template"]:
        raise ValueError("the tiny chat template changed: update make_checkpoint's media parts")
    media = "".join(f"{{%- elif part.type == '{kind}' -%}}{PLACEHOLDER[kind]}" for kind in ("image", "video", "audio"))
    cfg["chat_template"] = cfg["chat_template"].replace(
        text_only, "{%- if part.type == 'text' -%}{{ part.text }}" + media + "{%- endif -%}"
    )
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2, ensure_ascii=False)


def _audio(w: _Writer, r: _Rand, file: str, a: dict, out: str) -> None:
    """The encoder's weights into `file` (bf16); the tokenizer into `out/audio_tokenizer/`."""
    from safetensors.torch import save_file

    d, inter, g = a["input_local_dim"], a["input_local_intermediate_size"], a["group_size"]
    for c, vocab in enumerate(int(v) for v in a["speech_vocab_size"].split("-")):
        w.put(file, f"speech_embeddings.{c}.weight", r.weight(vocab, d, 0.5))
    for i in range(a["input_local_layers"]):
        p = f"audio_encoder.input_local_transformer.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w.put(file, f"{p}.{norm}.weight", 1 + r.vec(d, 0.1))
        for name in ("q_proj", "k_proj", "v_proj"):
            w.put(file, f"{p}.self_attn.{name}.weight", r.weight(d, d, 0.1))
            w.put(file, f"{p}.self_attn.{name}.bias", r.vec(d, 0.02))
        w.put(file, f"{p}.self_attn.o_proj.weight", r.weight(d, d, 0.1))
        w.put(file, f"{p}.mlp.gate_proj.weight", r.weight(inter, d, 0.1))
        w.put(file, f"{p}.mlp.up_proj.weight", r.weight(inter, d, 0.1))
        w.put(file, f"{p}.mlp.down_proj.weight", r.weight(d, inter, 0.1))
    w.put(file, "audio_encoder.input_local_transformer.norm.weight", 1 + r.vec(d, 0.1))
    w.put(file, "audio_encoder.projection.mlp.0.weight", r.weight(4 * d * g, d * g, 0.05))
    w.put(file, "audio_encoder.projection.mlp.2.weight", r.weight(a["out_hidden_size"], 4 * d * g, 0.05))
    t, tok = AUDIO_TOKENIZER, {}
    td, ffn, k = t["d_model"], t["encoder_ffn_dim"], t["kernel_size"]

    def put(name: str, x: torch.Tensor, dtype=torch.bfloat16) -> None:
        tok[f"encoder.{name}"] = x.to(dtype).contiguous()

    put("conv1.weight", r.weight(td, t["n_mels"] * k, 0.1).view(td, t["n_mels"], k))
    put("conv1.bias", r.vec(td, 0.02))
    put("conv2.weight", r.weight(td, td * k, 0.1).view(td, td, k))
    put("conv2.bias", r.vec(td, 0.02))
    for i in range(t["encoder_layers"]):
        p = f"layers.{i}"
        for name, bias in (("q_proj", True), ("k_proj", False), ("v_proj", True), ("out_proj", True)):
            put(f"{p}.self_attn.{name}.weight", r.weight(td, td, 0.2))
            if bias:
                put(f"{p}.self_attn.{name}.bias", r.vec(td, 0.02))
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            put(f"{p}.{norm}.weight", 1 + r.vec(td, 0.1))
            put(f"{p}.{norm}.bias", r.vec(td, 0.02))
        put(f"{p}.fc1.weight", r.weight(ffn, td, 0.1))
        put(f"{p}.fc1.bias", r.vec(ffn, 0.02))
        put(f"{p}.fc2.weight", r.weight(td, ffn, 0.1))
        put(f"{p}.fc2.bias", r.vec(td, 0.02))
    for norm in ("layer_norm", "down_sample_norm"):
        put(f"{norm}.weight", 1 + r.vec(td, 0.1))
        put(f"{norm}.bias", r.vec(td, 0.02))
    put("down_sample_layer.0.weight", r.weight(td, td * 2, 0.1).view(td, td, 2))
    for q, size in enumerate(t["codebook_size"]):
        p = f"quantizer.vq.layers.{q}._codebook"
        embed = r.vec(size * td).view(size, td)
        put(f"{p}.embed", embed, torch.float32)
        put(f"{p}.embed_avg", embed.clone(), torch.float32)
        put(f"{p}.cluster_size", torch.ones(size), torch.float32)
        put(f"{p}.inited", torch.ones(1), torch.float32)
    folder = os.path.join(out, "audio_tokenizer")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(t, fh, indent=2)
    save_file(tok, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def write_checkpoint(
    out: str, like: str = "v2-flash", weights: str = "fp8", scale: str = "tiny", seed: int = 0, shards: int = 4
) -> dict:
    """Writes the checkpoint into `out` (created; must be empty or absent); returns a summary."""
    if like not in LIKES or weights not in WEIGHTS or scale not in SCALES:
        raise ValueError(f"like in {LIKES}, weights in {WEIGHTS}, scale in {SCALES}")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{out}: not empty")
    os.makedirs(out, exist_ok=True)
    s = shape_of(like, scale)
    cfg = make_config(like, weights, s)
    if weights == "mxfp4" and like != "v2.6":
        raise ValueError("--weights mxfp4 is V2.6's format (--like v2.6)")
    r, w = _Rand(seed), _Writer(weights in ("fp8", "mxfp4"), weights == "mxfp4")
    shards = max(1, min(shards, s.layers))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    w.put(names[0], "model.embed_tokens.weight", r.weight(cfg["vocab_size"], s.hidden))
    pattern = cfg["hybrid_layer_pattern"]
    router_dtype = torch.bfloat16 if like == "v2.6" else torch.float32
    for i in range(s.layers):
        f, p = names[i * shards // s.layers], f"model.layers.{i}"
        w.put(f, f"{p}.input_layernorm.weight", 1 + r.vec(s.hidden, 0.1))
        w.put(f, f"{p}.post_attention_layernorm.weight", 1 + r.vec(s.hidden, 0.1))
        _attention(w, r, f, f"{p}.self_attn", like, s, bool(pattern[i]))
        if i == 0:
            _mlp(w, r, f, f"{p}.mlp", s, s.inter)
            continue
        w.put(f, f"{p}.mlp.gate.weight", r.weight(s.experts, s.hidden, 0.2), router_dtype)
        w.put(f, f"{p}.mlp.gate.e_score_correction_bias", r.vec(s.experts, 0.01), torch.float32)
        for e in range(s.experts):
            _mlp(w, r, f, f"{p}.mlp.experts.{e}", s, s.moe_inter)
    if like == "v2.5":
        cfg["vision_config"] = vision_config(s)
        _vision(w, r, names[-1], cfg["vision_config"])
        cfg["audio_config"] = audio_config(s)
        _audio(w, r, names[-1], cfg["audio_config"], out)
        cfg["processor_config"] = processor_config()
    w.put(names[-1], "model.norm.weight", 1 + r.vec(s.hidden, 0.1))
    w.put(names[-1], "lm_head.weight", r.weight(cfg["vocab_size"], s.hidden))
    for k in range(s.mtp):
        f, p = "model_mtp.safetensors", f"model.mtp.layers.{k}"
        for norm in ("enorm", "hnorm", "input_layernorm", "pre_mlp_layernorm", "final_layernorm"):
            w.put(f, f"{p}.{norm}.weight", 1 + r.vec(s.hidden, 0.1))
        w.put(f, f"{p}.eh_proj.weight", r.weight(s.hidden, 2 * s.hidden))
        _attention(w, r, f, f"{p}.self_attn", like, s, True)
        _mlp(w, r, f, f"{p}.mlp", s, s.inter)
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    for f, tensors in w.files.items():
        save_file(tensors, os.path.join(out, f), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = f
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    tiny = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny, name), os.path.join(out, name))
    if like == "v2.5":
        _omni_tokenizer(out)
    return {
        "out": out,
        "like": like,
        "weights": weights,
        "scale": scale,
        "files": len(w.files),
        "tensors": len(weight_map),
        "bytes": total,
        "model_type": cfg["model_type"],
    }
