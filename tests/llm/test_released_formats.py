"""The released MiMo checkpoint formats load exactly (llm_backend/models/{released,loader,quant}.py).

Every checkpoint here is written by `make-checkpoint` in a released layout (original config keys, tensor names,
dtypes, shards and index) and checked against a reference someone else wrote, or against an independent
computation in the test:
- transformers' `mimo_v2_flash` on the same FP8 files (it dequantizes pre-quantized FP8 on a CPU), its config
  converted to transformers' keys here: greedy tokens identical over many prompts, logits equal;
- FP8 kept resident vs dequantized at load vs an fp32 copy dequantized by the test: identical logits;
- fused pre-split QKV vs the same weights split by the test: identical logits;
- one regression test per field bug (a scale block straddling K and V, a 3712-row chunk, a router whose bf16
  rounding changes the top-k, config keys that disagree), and the refusals by name.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_backend.kernels.fp8 import dequantize, quantize, row_scales
from llm_backend.models import LoadError, load_llm
from llm_backend.models.loader import plan_checkpoint
from llm_backend.models.make_checkpoint import write_checkpoint
from llm_backend.models.quant import BlockFP8Experts, BlockFP8Linear
from llm_backend.models.released import ConfigError, read_config
from llm_backend.paged_attention import ContiguousKV

PROMPTS = [torch.randint(9, 4096, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 40, 70)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    out = {}
    for like in ("v2-flash", "v2.5", "v2.5-pro", "v2.6"):
        for weights in ("fp8", "bf16"):
            d = str(root / f"{like}-{weights}")
            write_checkpoint(d, like, weights)
            out[like, weights] = d
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, torch.arange(len(ids)), ContiguousKV(model.config))


def _greedy(model, ids: torch.Tensor, n: int = 8) -> list[int]:
    kv, out = ContiguousKV(model.config), []
    logits = model(ids, torch.arange(len(ids)), kv, logits_for="last")
    for _ in range(n):
        t = int(logits[-1].argmax())
        out.append(t)
        pos = kv.length
        logits = model(torch.tensor([t]), torch.tensor([pos]), kv, logits_for="last")
    return out


def _transformers_view(src: str, dst: str, window_offset: int = 0) -> str:
    """The same files under transformers' converted config (the test's own conversion of the release keys)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    c = json.load(open(os.path.join(src, "config.json")))
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    keep += ("num_key_value_heads", "head_dim", "v_head_dim", "max_position_embeddings", "attention_value_scale")
    keep += ("moe_intermediate_size", "num_experts_per_tok", "n_routed_experts", "n_group", "topk_group")
    keep += ("norm_topk_prob", "tie_word_embeddings", "bos_token_id", "eos_token_id", "quantization_config")
    hf = {k: c[k] for k in keep if k in c}
    rope = {"rope_type": "default", "partial_rotary_factor": c["partial_rotary_factor"]}
    hf.update(
        model_type="mimo_v2_flash",
        architectures=["MiMoV2FlashForCausalLM"],
        rms_norm_eps=c["layernorm_epsilon"],
        routed_scaling_factor=1.0,
        layer_types=["sliding_attention" if x else "full_attention" for x in c["hybrid_layer_pattern"]],
        mlp_layer_types=["sparse" if x else "dense" for x in c["moe_layer_freq"]],
        sliding_window=c["sliding_window_size"] + window_offset,  # W keys, the current one included
        rope_parameters={
            "full_attention": {**rope, "rope_theta": c["rope_theta"]},
            "sliding_attention": {**rope, "rope_theta": c["swa_rope_theta"]},
        },
    )
    json.dump(hf, open(os.path.join(dst, "config.json"), "w"))
    return dst


def _hf_model(path: str):
    import accelerate  # noqa: F401 - transformers' FP8 loading needs it (the dev extra installs it)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_v2_flash_fp8_matches_transformers(ckpts, tmp_path):
    """Our FP8 path on a V2-Flash-layout FP8 checkpoint equals transformers' dequantized FP8 model: logits to
    fp32 rounding and greedy tokens identical, past the sliding window (32 here); a window off by one (the
    transformers `sliding_window_size + 1` reading) is visibly different, so the comparison can fail."""
    src = ckpts["v2-flash", "fp8"]
    ours = load_llm(src)
    assert isinstance(ours.model.layers[1].self_attn.k_proj, BlockFP8Linear)
    assert isinstance(ours.model.layers[1].mlp.experts, BlockFP8Experts)
    hf = _hf_model(_transformers_view(src, str(tmp_path / "hf")))
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        got = _logits(ours, ids)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    for ids in PROMPTS[1:3]:
        with torch.no_grad():
            ref = hf.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=8, do_sample=False)
        assert _greedy(ours, ids) == ref[0, len(ids) :].tolist()
    off = _hf_model(_transformers_view(src, str(tmp_path / "hf-off"), window_offset=1))
    with torch.no_grad():
        wrong = off(PROMPTS[3][None]).logits[0]
    assert (wrong - _logits(ours, PROMPTS[3])).abs().max() > 1e-3


@pytest.mark.parametrize("like", ["v2-flash", "v2.5", "v2.5-pro", "v2.6"])
def test_fp8_kept_equals_dequantized(ckpts, like):
    """FP8 resident (dequantized per GEMM) and dequantized once at load give the same logits; FP8 resident holds
    about a quarter of the fp32 bytes of the quantized layers."""
    kept = load_llm(ckpts[like, "fp8"])
    deq = load_llm(ckpts[like, "fp8"], fp8_weights="dequantize")
    for ids in PROMPTS[:2]:
        assert torch.equal(_logits(kept, ids), _logits(deq, ids))
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert size(kept) < 0.6 * size(deq)
    assert not any(isinstance(m, BlockFP8Linear) for m in deq.modules())


def _dequantized_copy(src: str, dst: str, dtype=torch.float32) -> None:
    """The test's own dequantization of a V2-Flash FP8 checkpoint: each pre-split chunk of q/k/v with its own
    scale rows, every other weight on the plain grid; written without quantization_config."""
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    n = cfg["num_key_value_heads"]
    for f in os.listdir(dst):
        if not f.endswith(".safetensors"):
            continue
        state = load_file(os.path.join(dst, f))
        out = {}
        for name, t in state.items():
            if name.endswith("_scale_inv"):
                continue
            s = state.get(name + "_scale_inv")
            if s is None:
                out[name] = t
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                out[name] = torch.cat([dequantize(w, sc, (128, 128)) for w, sc in zip(t.chunk(n), s.chunk(n))]).to(
                    dtype
                )
            else:
                out[name] = dequantize(t, s, (128, 128)).to(dtype)
        save_file(out, os.path.join(dst, f))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
    json.dump(index, open(os.path.join(dst, "model.safetensors.index.json"), "w"))


def test_fp8_equals_dequantized_copy(ckpts, tmp_path):
    """The same FP8 weights through our FP8 path and through a copy the test dequantized (per-chunk scale grid of
    q/k/v: a full layer's k_proj has 4 chunks of 48 rows, 4 scale rows where a plain grid has 2): identical logits
    in fp32, identical greedy tokens from a bf16 copy."""
    src = ckpts["v2-flash", "fp8"]
    _dequantized_copy(src, str(tmp_path / "f32"))
    _dequantized_copy(src, str(tmp_path / "bf16"), torch.bfloat16)
    ours, copy, copy16 = load_llm(src), load_llm(str(tmp_path / "f32")), load_llm(str(tmp_path / "bf16"))
    for ids in PROMPTS:
        assert torch.equal(_logits(ours, ids), _logits(copy, ids))
    assert all(_greedy(ours, ids) == _greedy(copy16, ids) for ids in PROMPTS)


def _split_copy(src: str, dst: str) -> None:
    """A fused-layout bf16 checkpoint rewritten with separate q/k/v (the test's own de-interleave)."""
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    n, hd, vd = cfg["num_key_value_heads"], cfg["head_dim"], cfg["v_head_dim"]
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    for f in {v for v in index["weight_map"].values()}:
        state = load_file(os.path.join(dst, f))
        for name in [k for k in state if k.endswith("qkv_proj.weight")]:
            layer = int(name.split(".")[2]) if ".mtp." not in name else -1
            sliding = layer < 0 or cfg["hybrid_layer_pattern"][layer]
            hkv = (cfg["swa_num_key_value_heads"] if sliding else cfg["num_key_value_heads"]) // n
            rq, rk, rv = cfg["num_attention_heads"] // n * hd, hkv * hd, hkv * vd
            chunks = state.pop(name).split(rq + rk + rv)
            p = name[: -len("qkv_proj.weight")]
            state[p + "q_proj.weight"] = torch.cat([c[:rq] for c in chunks])
            state[p + "k_proj.weight"] = torch.cat([c[rq : rq + rk] for c in chunks])
            state[p + "v_proj.weight"] = torch.cat([c[rq + rk :] for c in chunks])
            del index["weight_map"][name]
            for k in ("q_proj", "k_proj", "v_proj"):
                index["weight_map"][p + k + ".weight"] = f
        save_file(state, os.path.join(dst, f))
    cfg["attention_projection_layout"] = "split"
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    json.dump(index, open(os.path.join(dst, "model.safetensors.index.json"), "w"))


@pytest.mark.parametrize("like", ["v2.5", "v2.5-pro", "v2.6"])
def test_fused_qkv_equals_split(ckpts, tmp_path, like):
    """The same weights in the fused pre-split layout and split by the test serve identical logits and tokens."""
    _split_copy(ckpts[like, "bf16"], str(tmp_path / "split"))
    fused, split = load_llm(ckpts[like, "bf16"]), load_llm(str(tmp_path / "split"))
    for ids in PROMPTS[:3]:
        assert torch.equal(_logits(fused, ids), _logits(split, ids))


def test_straddling_scale_block_dequantized_whole(ckpts):
    """sglang-jax #969: in a V2.5 full layer's chunk (2 query heads = 96 rows, K 48, V 32), scale block 0 covers Q and
    the first 32 rows of K, block 1 the rest of K and all of V. Each row of the loaded k/v must carry the scale
    of the block it sat in inside its chunk; scaling V by a grid of its own (the bug) is wrong by a lot."""
    d = ckpts["v2.5", "fp8"]
    model = load_llm(d)
    state = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(d, f)))
    w, s = (
        state["model.layers.0.self_attn.qkv_proj.weight"],
        state["model.layers.0.self_attn.qkv_proj.weight_scale_inv"],
    )
    chunk, rq, rk = 176, 96, 48
    ref = torch.cat([dequantize(c, sc, (128, 128)) for c, sc in zip(w.split(chunk), s.split(2))])
    v_rows = torch.cat([torch.arange(i * chunk + rq + rk, (i + 1) * chunk) for i in range(4)])
    attn = model.model.layers[0].self_attn
    got_v = dequantize(attn.v_proj.weight, attn.v_proj.weight_scale_inv, (1, 128))
    assert torch.equal(got_v, ref[v_rows])
    wrong = torch.cat(
        [dequantize(w[i * chunk + rq + rk : (i + 1) * chunk], s[2 * i : 2 * i + 1], (128, 128)) for i in range(4)]
    )
    assert (wrong - ref[v_rows]).abs().max() > 10 * ref[v_rows].abs().max() * 0.01  # the bug is visible here


def test_real_v25_sliding_chunk_3712_rows(tmp_path):
    """sglang-jax #1164: a V2.5 sliding layer's fused qkv is 4 chunks of 3712 rows (16 query, 2 KV heads of
    192 / 128), 29 scale rows each. Rows divisible by 128 must not read as one chunk: q is the four chunks' first
    3072 rows, k their next 384, v their last 256 (the config decides, never the row count)."""
    cfg = {
        "model_type": "mimo_v2",
        "architectures": ["MiMoV2ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 4096,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "swa_num_attention_heads": 64,
        "num_key_value_heads": 4,
        "swa_num_key_value_heads": 8,
        "head_dim": 192,
        "swa_head_dim": 192,
        "v_head_dim": 128,
        "swa_v_head_dim": 128,
        "partial_rotary_factor": 0.334,
        "rope_theta": 10000000.0,
        "swa_rope_theta": 10000.0,
        "sliding_window_size": 128,
        "hybrid_layer_pattern": [1],
        "moe_layer_freq": [0],
        "attention_projection_layout": "fused_qkv",
        "layernorm_epsilon": 1e-5,
        "add_swa_attention_sink_bias": True,
        "attention_value_scale": 0.707,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    }
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(4 * 3712, 4096, generator=g) * torch.exp(torch.randn(4 * 3712, 1, generator=g))
    q, s = quantize(fused)
    assert s.shape == (116, 32)
    p = "model.layers.0"
    state = {
        f"{p}.self_attn.qkv_proj.weight": q,
        f"{p}.self_attn.qkv_proj.weight_scale_inv": s,
        f"{p}.self_attn.o_proj.weight": torch.zeros(4096, 64 * 128, dtype=torch.bfloat16),
        f"{p}.self_attn.attention_sink_bias": torch.zeros(64, dtype=torch.bfloat16),
        f"{p}.input_layernorm.weight": torch.ones(4096, dtype=torch.bfloat16),
        f"{p}.post_attention_layernorm.weight": torch.ones(4096, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(256, 4096, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(4096, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(256, 4096, dtype=torch.bfloat16),
    }
    for k, t in (("gate_proj", (128, 4096)), ("up_proj", (128, 4096)), ("down_proj", (4096, 128))):
        wq, ws = quantize(torch.randn(*t, generator=g))
        state[f"{p}.mlp.{k}.weight"], state[f"{p}.mlp.{k}.weight_scale_inv"] = wq, ws
    os.makedirs(tmp_path / "ck")
    save_file(state, str(tmp_path / "ck" / "model.safetensors"))
    json.dump(cfg, open(tmp_path / "ck" / "config.json", "w"))
    model = load_llm(str(tmp_path / "ck"))
    attn = model.model.layers[0].self_attn
    rows = {"q": (0, 3072), "k": (3072, 3456), "v": (3456, 3712)}
    for name, proj in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)):
        a, b = rows[name]
        sel = torch.cat([torch.arange(i * 3712 + a, i * 3712 + b) for i in range(4)])
        assert torch.equal(proj.weight.view(torch.uint8), q[sel].view(torch.uint8)), name
        assert torch.equal(proj.weight_scale_inv, row_scales(s, 4 * 3712, 128)[sel]), name


def test_router_stays_fp32(ckpts, tmp_path):
    """The router gate and its correction bias load in fp32 whatever the serving dtype (bf16 rounding of the
    gate changes which experts win when scores are close; here it does for some token), and V2.6's bf16 gate
    is upcast exactly."""
    model = load_llm(ckpts["v2-flash", "fp8"], dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    x = torch.randn(512, gate.weight.shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    _, ids32 = gate(x)
    scores16 = torch.nn.functional.linear(x, gate.weight.bfloat16()).float().sigmoid()
    ids16 = torch.topk(scores16 + gate.e_score_correction_bias, k=ids32.shape[1], dim=-1)[1]
    assert (ids32.sort(-1)[0] != ids16.sort(-1)[0]).any()  # bf16 routing would pick other experts
    v26 = load_llm(ckpts["v2.6", "fp8"])
    stored = load_file(os.path.join(ckpts["v2.6", "fp8"], "model-00001-of-00004.safetensors"))
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert torch.equal(v26.model.layers[1].mlp.gate.weight, stored["model.layers.1.mlp.gate.weight"].float())


def _config(ckpts) -> dict:
    return json.load(open(os.path.join(ckpts["v2-flash", "fp8"], "config.json")))


@pytest.mark.parametrize(
    "change,key",
    [
        ({"sliding_window": 64}, "sliding_window"),
        ({"attention_chunk_size": 16}, "attention_chunk_size"),
        ({"hybrid_layer_pattern": [0, 1]}, "hybrid_layer_pattern"),
        ({"layernorm_epsilon": 1e-5, "rms_norm_eps": 1e-6}, "rms_norm_eps"),
        ({"swa_head_dim": 64}, "swa_head_dim"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"some_new_key": 1}, "some_new_key"),
        ({"rope_theta": None}, "rope_theta"),
        ({"add_swa_attention_sink_bias": None}, "add_swa_attention_sink_bias"),
        ({"layer_types": ["full_attention"] * 8}, "layer_types"),
        ({"partial_rotary_factor": 0.45}, "partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}}, "fmt"),
        (
            {"quantization_config": {"quant_method": "fp8", "store_dtype": "int4", "weight_block_size": [128, 128]}},
            "store_dtype",
        ),
        (
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "store_dtype": "mxfp4",
                    "mxfp4_block_size": 16,
                    "weight_block_size": [128, 128],
                }
            },
            "mxfp4_block_size",
        ),
    ],
)
def test_config_refused_by_key(ckpts, change, key):
    """A key the loader does not understand, or two keys that disagree: one line naming the key."""
    d = {**_config(ckpts), **change}
    with pytest.raises(ConfigError) as e:
        read_config(d, "x/config.json")
    msg = str(e.value)
    assert "\n" not in msg and key in msg and msg.startswith("x/config.json: ")


def test_original_and_converted_configs_agree(ckpts):
    """The release's keys read as the model's config: the pattern, the window (W keys, the current one included),
    per-type KV heads, rope thetas, sinks, fused layout, FP8 block."""
    c = read_config(json.load(open(os.path.join(ckpts["v2.5", "fp8"], "config.json"))))
    assert c.layer_types[0] == "full_attention" and c.layer_types[5] == "full_attention"
    assert c.layer_types[1] == "sliding_attention" and c.kv_heads(0) == 4 and c.kv_heads(1) == 8
    assert c.sliding_window == 32 and c.rms_norm_eps == 1e-5 and c.attention_projection_layout == "fused_qkv"
    assert (
        c.rope_parameters["full_attention"]["rope_theta"] == 1e7 and c.swa_attention_sink and not c.full_attention_sink
    )
    assert c.quant is not None and c.quant.block == (128, 128) and c.quant.ignores("model.layers.3.self_attn.o_proj")
    tiny = read_config(
        json.load(open(os.path.join(os.path.dirname(__file__), "../../mimo_epd/data/models/tiny/config.json")))
    )
    assert tiny.sliding_window == 129 and tiny.quant is None


def test_shards_checked_by_name(ckpts, tmp_path):
    """A missing shard, a shard whose tensors disagree with the index, a truncated file, an FP8 weight without
    its scales: one line naming the file and the tensor, before any weight is read."""
    src = ckpts["v2-flash", "fp8"]

    def broken(name):
        d = str(tmp_path / name)
        shutil.copytree(src, d)
        return d

    d = broken("missing")
    os.remove(os.path.join(d, "model-00002-of-00004.safetensors"))
    with pytest.raises(LoadError, match="model-00002-of-00004.safetensors: missing"):
        plan_checkpoint(d)
    d = broken("truncated")
    f = os.path.join(d, "model-00003-of-00004.safetensors")
    os.truncate(f, os.path.getsize(f) - 100)
    with pytest.raises(LoadError, match="model-00003-of-00004.safetensors: truncated: tensor"):
        plan_checkpoint(d)
    d = broken("index")
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors"
    json.dump(index, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    with pytest.raises(LoadError, match="lacks tensor model.norm.weight"):
        plan_checkpoint(d)
    d = broken("noscale")
    f = os.path.join(d, "model-00001-of-00004.safetensors")
    state = load_file(f)
    del state["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(state, f)
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    del index["weight_map"]["model.layers.0.mlp.up_proj.weight_scale_inv"]
    json.dump(index, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    with pytest.raises(LoadError, match="up_proj.weight: FP8 without its weight_scale_inv"):
        plan_checkpoint(d)
    d = broken("noquant")
    cfg = json.load(open(os.path.join(d, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(LoadError, match="is FP8, but config.json has no quantization_config"):
        plan_checkpoint(d)


def test_quantize_at_load(ckpts):
    """--quantization fp8 turns a bf16 checkpoint's linear layers (fused qkv de-interleaved first, experts one by
    one) into block FP8 at load: every FP8 layer dequantizes to its bf16 weight within e4m3's ~3 % relative error,
    and the logits stay close (cosine > 0.98 through 8 random layers)."""
    bf = load_llm(ckpts["v2.5", "bf16"])
    q = load_llm(ckpts["v2.5", "bf16"], quantization="fp8")
    mods = dict(bf.named_modules())
    n = 0
    for name, m in q.named_modules():
        if isinstance(m, BlockFP8Linear):
            ref = mods[name].weight
            w = dequantize(m.weight, m.weight_scale_inv, m.block)
        elif isinstance(m, BlockFP8Experts):
            ref = mods[name].gate_up_proj[3]
            w = m.expert(3, torch.float32)[0]
        else:
            continue
        n += 1
        assert (w - ref).norm() / ref.norm() < 0.035, name
    assert n > 20
    a, b = _logits(bf, PROMPTS[2]), _logits(q, PROMPTS[2])
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mxfp4_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The OCP MX definition, written out: byte j of a row holds columns 2j (low nibble) and 2j+1; a code is
    sign (bit 3) and magnitude E2M1[code & 7]; a block of 32 columns is scaled by 2^(e8m0 - 127)."""
    rows, half = codes.shape
    out = torch.empty(rows, 2 * half)
    for col in range(2 * half):
        byte = codes[:, col // 2].long()
        code = byte & 0xF if col % 2 == 0 else byte >> 4
        mag = torch.tensor(E2M1)[code & 7]
        out[:, col] = torch.where(code & 8 > 0, -mag, mag) * 2.0 ** (scales[:, col // 32].double() - 127)
    return out


def test_v26_mxfp4_experts(tmp_path):
    """V2.6's MXFP4 experts load packed (a quarter of bf16's bytes plus the scales), each expert equal to the MX
    definition computed here, and serve the same logits as the same files dequantized at load; MXFP4 weights under
    a config that says store_dtype fp8 are refused by name."""
    d = str(tmp_path / "v26")
    write_checkpoint(d, "v2.6", "mxfp4")
    kept = load_llm(d, fp8_weights="keep")
    deq = load_llm(d, fp8_weights="dequantize")
    experts = kept.model.layers[2].mlp.experts
    assert type(experts).__name__ == "MXFP4Experts" and experts.gate_up_proj.dtype == torch.uint8
    stored = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(d, f)))
    p = "model.layers.2.mlp.experts.5"
    ref_up = _mxfp4_reference(stored[f"{p}.up_proj.weight"], stored[f"{p}.up_proj.weight_scale"])
    gate_up, down = experts.expert(5, torch.float32)
    i = kept.config.moe_intermediate_size
    assert torch.equal(gate_up[i:], ref_up)
    assert torch.equal(down, _mxfp4_reference(stored[f"{p}.down_proj.weight"], stored[f"{p}.down_proj.weight_scale"]))
    assert torch.equal(deq.model.layers[2].mlp.experts.gate_up_proj[5, i:], ref_up)
    for ids in PROMPTS[:2]:
        assert torch.equal(_logits(kept, ids), _logits(deq, ids))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"]["store_dtype"] = "fp8"
    del cfg["quantization_config"]["mxfp4_block_size"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(LoadError, match="packed MXFP4, but .*config.json says store_dtype fp8"):
        plan_checkpoint(d)


def test_release_config_round_trip():
    """`release_config` (what the shipped tiny is written with) reads back as the same config."""
    from dataclasses import replace

    from llm_backend.models import TINY_LLM_CONFIG
    from llm_backend.models.released import release_config

    rope = {"rope_type": "default", "partial_rotary_factor": 0.34375}
    cfg = replace(
        TINY_LLM_CONFIG,
        rope_parameters={
            "full_attention": {**rope, "rope_theta": 5e6},
            "sliding_attention": {**rope, "rope_theta": 1e4},
        },
        num_nextn_predict_layers=3,
        max_position_embeddings=4096,
        swa_num_key_value_heads=2,
    )
    back = read_config(json.loads(json.dumps(release_config(cfg))))
    assert back.to_hf_dict() == cfg.to_hf_dict()
    assert back.kv_heads(1) == cfg.kv_heads(1) and back.window == cfg.window


def test_v25_with_its_own_towers_plans_both(ckpts, tmp_path):
    """A V2.5 checkpoint declares MiMo's own ViT (`vision_config.model_type: mimovl`) and MiMo's audio config (no
    model_type, MiMo-Audio's keys): `serve`'s plan starts its LLM and both towers, and refuses, naming both files,
    an audio projection whose width is not the LLM's."""
    from mimo_epd.common.checkpoint import CheckpointError, plan_node

    d = tmp_path / "v25-omni"
    shutil.copytree(ckpts["v2.5", "fp8"], d)
    cfg = json.load(open(d / "config.json"))
    cfg["vision_config"] = {"model_type": "mimovl", "hidden_size": 1280, "out_hidden_size": 256, "patch_size": 16}
    cfg["audio_config"] = {"audio_channels": 20, "speech_vocab_size": "1280", "out_hidden_size": 256}
    json.dump(cfg, open(d / "config.json", "w"))
    plan = plan_node(str(d))
    assert plan.llm is not None and plan.llm.model_type == "mimo_v2" and plan.vision is not None
    assert plan.vision.vision_width == 256 and plan.vision.audio_width == 256 and not plan.notices
    cfg["audio_config"]["out_hidden_size"] = 4096
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(CheckpointError, match="audio tower's output width 4096"):
        plan_node(str(d))


def test_converted_rope_and_nulls_are_read_exactly():
    """transformers' layout: rope other than default, or a layer type without its entry, is refused by key; a null
    attention_value_scale means 1.0 (as transformers reads it), never the 0.707 default."""
    tiny = json.load(open(os.path.join(os.path.dirname(__file__), "../../mimo_epd/data/models/tiny/config.json")))
    base = {k: v for k, v in read_config(tiny).to_hf_dict().items() if k not in ("quant",)}
    base = {
        k: v
        for k, v in base.items()
        if k not in ("swa_attention_sink", "full_attention_sink", "attention_projection_layout")
    }
    yarn = json.loads(json.dumps(base))
    yarn["rope_parameters"]["full_attention"]["rope_type"] = "yarn"
    with pytest.raises(ConfigError, match="rope_parameters.full_attention"):
        read_config(yarn)
    partial = json.loads(json.dumps(base))
    del partial["rope_parameters"]["sliding_attention"]
    with pytest.raises(ConfigError, match="rope_parameters: expected one entry per layer type"):
        read_config(partial)
    assert read_config({**base, "attention_value_scale": None}).attention_value_scale == 1.0
    assert read_config(base).attention_value_scale == 0.707
