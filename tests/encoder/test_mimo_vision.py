"""MiMo-V2.5's vision tower: its attention rules against a dense masked softmax written here, packing, the
checkpoint's row layout, the refusals, and the loader choosing it by `vision_config.model_type`.
(Parity with vLLM's own `MiMoVisionTransformer` is tests/encoder/test_mimo_vision_parity.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from encoder_server.models import load_vision_model, random_model
from encoder_server.models.mimo_vision import (
    MiMoVisionConfig,
    MiMoVisionConfigError,
    MiMoVisionTower,
    band_attention,
    column_order,
)

TINY = dict(
    depth=4,
    hidden_size=64,
    intermediate_size=96,
    out_hidden_size=128,
    num_heads=4,
    num_key_value_heads=2,
    qk_channels=16,
    kv_channels=16,
    fullatt_block_indexes=[0],
    vit_window_attn_types=[-1, 0, 1, 0],
    visual_token_window_size=8,
    use_sink=True,
)


def dense_band(q, k, v, lengths, window, sinks):
    """The rule written plainly: per segment, logits q.k / sqrt(D) (+ sinks[h] on key 0), band |i-j| <= window."""
    out, a = [], 0
    for n in lengths:
        qs, ks, vs = q[a : a + n], k[a : a + n], v[a : a + n]
        logits = torch.einsum("ihd,jhd->hij", qs, ks) / math.sqrt(q.shape[-1])
        if sinks is not None:
            logits[:, :, 0] += sinks[:, None]
        i = torch.arange(n)
        if window > 0:
            logits = logits.masked_fill((i[:, None] - i[None, :]).abs() > window, float("-inf"))
        out.append(torch.einsum("hij,jhd->ihd", logits.softmax(-1), vs))
        a += n
    return torch.cat(out)


@pytest.mark.parametrize("window", [0, 3, 8, 40])
def test_band_attention_is_the_masked_softmax_with_the_sink_on_key_zero(window):
    g = torch.Generator().manual_seed(window)
    lengths = [1, 7, 300, 64]
    s = sum(lengths)
    q, k, v = (torch.randn(s, 3, 8, generator=g) for _ in range(3))
    sinks = torch.randn(3, generator=g) * 3
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for sk in (None, sinks):
        got = band_attention(q, k, v, cu, window, sk, chunk=32)
        torch.testing.assert_close(got, dense_band(q, k, v, lengths, window, sk), rtol=1e-5, atol=1e-5)
    # the sink changes what a query near key 0 sees, and nothing where key 0 is out of the band
    a, b = band_attention(q, k, v, cu, window, None), band_attention(q, k, v, cu, window, sinks)
    assert not torch.allclose(a[:2], b[:2])
    if window:
        far = 8 + window + 1  # segment 3 starts at 8: its queries past the band do not see key 0
        torch.testing.assert_close(a[far:300], b[far:300])


def test_column_order_transposes_each_frame_and_keeps_items_apart():
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])  # merged grids 2x3 (one frame) and 1x2 (two frames)
    assert column_order(grid, 2).tolist() == [0, 3, 1, 4, 2, 5, 6, 7, 8, 9]


def _tower(**over) -> MiMoVisionTower:
    tower = random_model(MiMoVisionConfig(**{**TINY, **over}), seed=3)
    assert isinstance(tower, MiMoVisionTower)
    return tower


def _pixels(grid, seed=0):
    n = int(torch.tensor(grid).prod(-1).sum())
    return torch.randn(n, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))


def test_packed_batch_equals_items_one_at_a_time():
    tower = _tower()
    grids = [[1, 4, 6], [2, 4, 4], [1, 2, 2], [1, 10, 2]]
    pixels = _pixels(grids)
    packed = tower(pixels, torch.tensor(grids))
    rows, out = 0, []
    for g in grids:
        n = g[0] * g[1] * g[2]
        out.append(tower(pixels[rows : rows + n], torch.tensor([g])))
        rows += n
    assert packed.shape == (rows // 4, 128)
    torch.testing.assert_close(packed, torch.cat(out), rtol=1e-5, atol=1e-5)


def test_window_types_and_sinks_matter():
    """Each of the tower's differences from a plain ViT changes its output (so the parity test tests them)."""
    grid = torch.tensor([[1, 8, 10]])
    pixels = _pixels([[1, 8, 10]], 1)
    base = _tower()(pixels, grid)
    for over in (
        dict(vit_window_attn_types=[-1, 0, 0, 0]),
        dict(use_sink=False),
        dict(visual_token_window_size=0),
        dict(fullatt_block_indexes=[0, 1]),
    ):
        other = _tower(**over)
        other.load_state_dict(_tower().state_dict(), strict=False)
        assert not torch.allclose(other(pixels, grid), base, atol=1e-4), over


def test_checkpoint_rows_survive_a_round_trip():
    tower = _tower()
    state = tower.state_dict()
    again = MiMoVisionTower(MiMoVisionConfig(**TINY))
    again.load_state_dict(state)
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v, state[k])
    grid = torch.tensor([[1, 4, 4]])
    torch.testing.assert_close(again(_pixels([[1, 4, 4]]), grid), tower(_pixels([[1, 4, 4]]), grid))
    assert {"blocks.1.attn.sinks", "blocks.3.attn.sinks"} <= set(state) and "blocks.0.attn.sinks" not in state
    assert "merger.mlp.0.bias" not in state and "blocks.0.attn.qkv.bias" in state
    assert state["blocks.0.attn.qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)


@pytest.mark.parametrize(
    "over, field",
    [
        (dict(kv_channels=32), "kv_channels"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(vit_window_attn_types=[0, 0]), "vit_window_attn_types"),
        (dict(vit_window_attn_types=[0, 2, 0, 0]), "vit_window_attn_types"),
        (dict(fullatt_block_indexes=[4]), "fullatt_block_indexes"),
        (dict(hidden_act="swish9"), "hidden_act"),
    ],
)
def test_configs_it_cannot_compute_exactly_are_refused_by_field(over, field):
    with pytest.raises(MiMoVisionConfigError, match=f"vision_config.{field}"):
        MiMoVisionConfig.from_hf_dict({**TINY, **over})


def test_released_config_spelling_is_read():
    d = {k: v for k, v in TINY.items() if k not in ("qk_channels", "kv_channels")}
    cfg = MiMoVisionConfig.from_hf_dict({"model_type": "mimo_v2", "vision_config": {**d, "in_chans": 3}})
    assert (cfg.qk_channels, cfg.kv_channels, cfg.in_channels) == (64, 64, 3)


def test_loader_chooses_the_tower_by_model_type_and_keys_the_cache_by_it(tmp_path):
    from safetensors.torch import save_file

    tower = _tower()
    vision = MiMoVisionConfig(**TINY).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mimo_v2", "vision_config": vision}))
    save_file(
        {f"visual.{k}": v.to(torch.bfloat16).contiguous() for k, v in tower.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    info = load_vision_model(str(tmp_path), return_info=True)
    assert isinstance(info.module, MiMoVisionTower) and info.model_id.startswith("mimovl:")
    grid = torch.tensor([[1, 4, 4]])
    ref = tower.to(torch.bfloat16).float()  # the same bf16-rounded weights
    torch.testing.assert_close(info.module(_pixels([[1, 4, 4]]), grid), ref(_pixels([[1, 4, 4]]), grid))
    vision["kv_channels"] = 32
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mimo_v2", "vision_config": vision}))
    with pytest.raises(MiMoVisionConfigError, match="kv_channels"):
        load_vision_model(str(tmp_path))


def test_mimo_preprocessing_rules():
    """MiMo's processor: small images scaled to the factor first, bilinear floats (no uint8 rounding), ImageNet
    mean/std, and the decode processes / JPEG draft never used for it."""
    import numpy as np
    import torch.nn.functional as F

    from encoder_server.preprocess import (
        ImageSizeError,
        PreprocessConfig,
        mimo_smart_resize,
        normalize_patchify,
        preprocess_images,
        smart_resize,
    )

    cfg = PreprocessConfig.preset("mimo_v2_5")
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels, cfg.exact_floats) == (16, 4 * 32 * 32, 4096 * 32 * 32, True)
    # a 10 x 100 image: the short side goes to 32 first (the long to int(100 * 32 / 10) = 320), then the bounds
    assert mimo_smart_resize(10, 100, 32, 4096, 4096 * 1024) == (32, 320)
    assert smart_resize(10, 100, 32, 4096, 4096 * 1024) != (32, 320)  # Qwen's rule differs here
    assert mimo_smart_resize(1, 1, 32, 4096, 1 << 22) == (64, 64)
    with pytest.raises(ImageSizeError):
        mimo_smart_resize(40, 9000, 32, 4096, 1 << 22)
    img = np.random.default_rng(0).integers(0, 256, (45, 70, 3), dtype=np.uint8)
    pv, grid = preprocess_images([img], cfg)
    th, tw = mimo_smart_resize(45, 70, 32, cfg.min_pixels, cfg.max_pixels)
    assert grid.tolist() == [[1, th // 16, tw // 16]]
    floats = F.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None].float(), [th, tw], mode="bilinear")
    assert not torch.equal(floats, floats.round())  # the reference's pixels are not whole levels...
    torch.testing.assert_close(pv, normalize_patchify(floats, cfg), rtol=0, atol=0)  # ...and neither are ours
    mean = torch.tensor([123.675, 116.28, 103.53])
    std = torch.tensor([58.395, 57.12, 57.375])
    first = ((floats[0, :, :16, :16] - mean[:, None, None]) / std[:, None, None]).reshape(-1)
    torch.testing.assert_close(pv[0].view(3, 2, 256)[:, 0].reshape(-1), first, rtol=1e-6, atol=1e-6)


def test_mimo_checkpoint_preprocessing_comes_from_its_config(tmp_path):
    from encoder_server.models import mimo_preprocessor_config
    from encoder_server.preprocess import PreprocessConfig

    d = mimo_preprocessor_config(
        {"vision_config": {**TINY, "model_type": "mimovl"}, "processor_config": {"image_max_pixels": 65536}}
    )
    cfg = PreprocessConfig.from_hf_dict(d)
    assert (cfg.processor, cfg.max_pixels, cfg.min_pixels, cfg.patch_size) == ("mimo", 65536, 4096, 16)
