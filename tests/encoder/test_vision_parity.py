"""Vision tower parity with transformers' Qwen2_5_VisionTransformerPretrainedModel (fp32, tolerance 1e-4).

Each config is instantiated by transformers with random weights, saved with save_pretrained, and
loaded through our `load_vision_model`; three images of different sizes go through one packed forward.
"""

import json

import numpy as np
import pytest
import torch

from encoder_server.models import TINY_VISION_CONFIG, load_vision_model
from encoder_server.models.qwen2_5_vision import window_index
from encoder_server.preprocess import PreprocessConfig, preprocess_images
from tests.conftest import textured

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel  # noqa: E402

TOL = 1e-4

CONFIGS = {
    # window 56 px / 14 px / merge 2 = windows of 2x2 merged tokens: every image is split into many windows.
    "qwen-p14-small-windows": dict(
        depth=3,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        patch_size=14,
        window_size=56,
        out_hidden_size=48,
        fullatt_block_indexes=[1],
        hidden_act="silu",
    ),
    # MiMo-V2.5 style patch 16; window 128 px = 4x4 merged tokens; gelu MLP; last block full attention.
    "mimo-p16": dict(
        depth=2,
        hidden_size=96,
        intermediate_size=128,
        num_heads=6,
        patch_size=16,
        window_size=128,
        out_hidden_size=32,
        fullatt_block_indexes=[1],
        hidden_act="gelu_pytorch_tanh",
    ),
}
SIZES = [(180, 250), (64, 64), (300, 140)]


def build_hf(kw, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2_5_VLVisionConfig(**kw)
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' init leaves some weights at zero/one; make every weight matter
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    kw = CONFIGS[request.param]
    hf = build_hf(kw)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    ours = load_vision_model(str(d))
    preset = "qwen2_vl_patch16" if kw["patch_size"] == 16 else "qwen2_5_vl"
    return hf, ours, PreprocessConfig.preset(preset)


def test_packed_forward_matches_transformers(pair):
    hf, ours, cfg = pair
    imgs = [textured(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    pv, grid = preprocess_images(imgs, cfg, resize_backend="torch")
    win_idx, cu = window_index(grid, 2, ours.config.window_size, ours.config.patch_size)
    assert len(cu) - 1 > len(SIZES), "config must really partition images into windows"
    with torch.no_grad():
        ref = hf(pv, grid_thw=grid).pooler_output
    out = ours(pv, grid)
    assert out.shape == ref.shape == (int(grid.prod(-1).sum()) // 4, hf.config.out_hidden_size)
    assert (out - ref).abs().max().item() <= TOL


def test_packed_equals_each_image_alone(pair):
    _, ours, cfg = pair
    imgs = [textured(h, w, seed=10 + i) for i, (h, w) in enumerate(SIZES)]
    pv, grid = preprocess_images(imgs, cfg, resize_backend="torch")
    packed = ours(pv, grid)
    alone = torch.cat([ours(*preprocess_images([im], cfg, resize_backend="torch")) for im in imgs])
    assert (packed - alone).abs().max().item() <= TOL


def test_video_clip_grid_matches_transformers(pair):
    hf, ours, cfg = pair
    # A 4-frame clip (t=2 temporal patches) packed with an image.
    p = cfg.patch_size
    grid = torch.tensor([[2, 8, 12], [1, 4, 4]])
    pv = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * p * p)
    with torch.no_grad():
        ref = hf(pv, grid_thw=grid).pooler_output
    assert (ours(pv, grid) - ref).abs().max().item() <= TOL


def test_loads_visual_weights_of_a_full_checkpoint(tmp_path):
    """A full Qwen2.5-VL checkpoint: only `visual.*` / `model.visual.*` weights are read."""
    from safetensors.torch import save_file

    hf = build_hf(CONFIGS["qwen-p14-small-windows"], seed=3)
    state = {f"model.visual.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    state["model.language_model.embed_tokens.weight"] = torch.zeros(10, 4)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2_5_vl", "vision_config": hf.config.to_dict()})
    )
    ours = load_vision_model(str(tmp_path))
    grid = torch.tensor([[1, 8, 8]])
    pv = torch.randn(64, 3 * 2 * 14 * 14)
    with torch.no_grad():
        ref = hf(pv, grid_thw=grid).pooler_output
    assert (ours(pv, grid) - ref).abs().max().item() <= TOL


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_vision_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a Qwen2.5-VL"):
        load_vision_model(str(tmp_path))


def test_tiny_model_is_deterministic_and_the_real_architecture():
    a, b = load_vision_model("tiny"), load_vision_model("tiny")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    # The tiny weights load into transformers' own class: same architecture, same parameter names.
    cfg = TINY_VISION_CONFIG
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        Qwen2_5_VLVisionConfig(
            depth=cfg.depth,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            patch_size=cfg.patch_size,
            window_size=cfg.window_size,
            out_hidden_size=cfg.out_hidden_size,
            fullatt_block_indexes=cfg.fullatt_block_indexes,
            hidden_act=cfg.hidden_act,
        ),
        torch_dtype=torch.float32,
    ).eval()
    hf.load_state_dict(a.state_dict(), strict=True)
    pv, grid = preprocess_images([textured(200, 300)], "qwen2_5_vl", resize_backend="torch")
    with torch.no_grad():
        ref = hf(pv, grid_thw=grid).pooler_output
    assert (a(pv, grid) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_close_to_fp32(dtype):
    ref = load_vision_model("tiny")
    low = load_vision_model("tiny", dtype=dtype)
    pv, grid = preprocess_images([textured(150, 200)], "qwen2_5_vl", resize_backend="torch")
    out = low(pv.to(getattr(torch, dtype)), grid).float()
    exp = ref(pv, grid)
    rel = ((out - exp).norm() / exp.norm()).item()
    assert out.dtype == torch.float32 and np.isfinite(rel) and rel < 0.05


def test_save_checkpoint_loads_in_transformers_and_back(tmp_path):
    from encoder_server.models import random_model, save_checkpoint

    ours = random_model(TINY_VISION_CONFIG, seed=5)
    save_checkpoint(ours, tmp_path)
    hf = Qwen2_5_VisionTransformerPretrainedModel.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    back = load_vision_model(str(tmp_path))
    pv, grid = preprocess_images([textured(120, 160)], "qwen2_5_vl", resize_backend="torch")
    with torch.no_grad():
        ref = hf(pv, grid_thw=grid).pooler_output
    assert (ours(pv, grid) - ref).abs().max().item() <= TOL
    assert torch.equal(back(pv, grid), ours(pv, grid))


def test_folded_still_images_equal_the_hf_layout(pair):
    """The server's still-image layout (each image once, temporal kernel folded) matches the HF layout."""
    _, ours, cfg = pair
    imgs = [textured(h, w, seed=20 + i) for i, (h, w) in enumerate(SIZES)]
    pv, grid = preprocess_images(imgs, cfg, resize_backend="torch")
    pv1, grid1 = preprocess_images(imgs, cfg, resize_backend="torch", fold_time=True)
    assert torch.equal(grid, grid1) and pv1.shape[1] * cfg.temporal_patch_size == pv.shape[1]
    assert (ours(pv1, grid1) - ours(pv, grid)).abs().max().item() <= 1e-5


def test_uint8_patches_with_folded_normalization(pair):
    """The CPU deployment path: uint8 patches cut in the decoder, normalisation folded into the patch embed."""
    from encoder_server.preprocess import patchify_uint8, resize_torch, target_size

    _, ours, cfg = pair
    img = textured(230, 310, seed=9)
    th, tw = target_size(230, 310, cfg)
    resized = resize_torch(torch.from_numpy(img).permute(2, 0, 1)[None], (th, tw))[0].permute(1, 2, 0).numpy()
    pv, grid = preprocess_images([resized], cfg, resize_backend="torch", fold_time=True)
    raw = torch.from_numpy(patchify_uint8(resized, cfg))
    assert raw.dtype == torch.uint8 and raw.shape == pv.shape
    with pytest.raises(ValueError, match="set_input_normalization"):
        load_vision_model("tiny")(torch.zeros(16, 588, dtype=torch.uint8), torch.tensor([[1, 4, 4]]))
    ours.patch_embed.set_input_normalization(cfg.mean, cfg.std)
    assert (ours(raw, grid) - ours(pv, grid)).abs().max().item() <= 1e-5


def test_uint8_patch_embedding_in_row_chunks_equals_one_conversion():
    """`uint8_linear` converts a big batch 1024 rows at a time into one buffer (a batch converted whole maps
    and faults in tens of MB per forward): the same sums as converting all rows at once, for a row count
    that is not a multiple of the chunk, and a chunk size of 1 row."""
    from encoder_server.models.qwen2_5_vision import uint8_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2500, 588), dtype=torch.uint8, generator=g)
    w = torch.randn(588, 32, generator=g)
    b = torch.randn(32, generator=g)
    want = torch.addmm(b, x.float(), w)
    for rows in (1024, 7, 1):
        got = uint8_linear(x[:300] if rows == 1 else x, w, b, rows=rows)
        ref = want[:300] if rows == 1 else want
        assert got.shape == ref.shape
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), rows


def test_cpu_groups_keep_each_groups_activations_within_the_limit():
    from encoder_server.models.qwen2_5_vision import cpu_groups

    grid = torch.tensor([[1, 10, 10], [1, 10, 10], [1, 20, 20], [1, 4, 4], [1, 4, 4], [2, 8, 8]])
    # width 1: an item costs 4 bytes per patch (100, 100, 400, 16, 16, 128 patches)
    assert cpu_groups(grid, 1, limit=4 * 10_000) == [(0, 6)]
    assert cpu_groups(grid, 1, limit=4 * 200) == [(0, 2), (2, 3), (3, 6)]  # the 400-patch item alone, over it
    assert cpu_groups(grid, 1, limit=4 * 160) == [(0, 1), (1, 2), (2, 3), (3, 6)]
    assert cpu_groups(grid, 1, limit=4 * 159) == [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6)]
    assert cpu_groups(grid[:0], 1) == []


def test_a_batch_forwarded_in_groups_equals_the_packed_forward(pair, monkeypatch):
    """On a CPU a batch whose widest activation passes CPU_ACTIVATION_BYTES runs as groups of whole items;
    with the limit lowered so that every image and the clip form groups of their own, the rows are those of
    one packed forward and of transformers."""
    import encoder_server.models.qwen2_5_vision as vision

    hf, ours, cfg = pair
    imgs = [textured(h, w, seed=20 + i) for i, (h, w) in enumerate(SIZES)]
    pv, grid = preprocess_images(imgs, cfg, resize_backend="torch")
    clip = torch.tensor([[2, 8, 12]])
    pv = torch.cat([pv, torch.randn(int(clip.prod()), pv.shape[1])])
    grid = torch.cat([grid, clip])
    packed = ours(pv, grid)
    smallest = int(grid.prod(-1).min()) * ours.activation_width * 4
    monkeypatch.setattr(vision, "CPU_ACTIVATION_BYTES", smallest)
    assert len(vision.cpu_groups(grid, ours.activation_width, vision.CPU_ACTIVATION_BYTES)) == len(grid)
    calls = []
    forward_packed = ours._forward_packed
    monkeypatch.setattr(ours, "_forward_packed", lambda p, g: calls.append(len(g)) or forward_packed(p, g))
    grouped = ours(pv, grid)
    assert calls == [1] * len(grid)
    assert grouped.shape == packed.shape
    assert (grouped - packed).abs().max().item() <= 1e-5
    with torch.no_grad():
        ref = hf(pv, grid_thw=grid).pooler_output
    assert (grouped - ref).abs().max().item() <= TOL
