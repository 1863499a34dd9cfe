"""Preprocessing parity with transformers' Qwen2VLImageProcessor (fast, torchvision) and its PIL variant.

Tolerances:
- torch resize path vs the fast processor: max |diff| <= 1e-5 (same torchvision kernel; in practice 0);
- PIL resize path vs the PIL processor: max |diff| <= 1e-5 (same PIL kernel);
- across the two resize kernels (torchvision vs PIL bicubic) pixels may differ by a few levels after
  rounding to uint8; that difference is recorded (record_property), not asserted beyond a sanity bound.
`grid_thw` must be identical in every case.
"""

import numpy as np
import pytest
import torch

from encoder_server.preprocess import (
    ImageSizeError,
    PreprocessConfig,
    normalize_patchify,
    patchify_frames,
    preprocess_images,
    smart_resize,
)
from tests.conftest import textured

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor  # noqa: E402

TOL = 1e-5

# (height, width) per preset: just above one factor, 1:150 aspect, above max_pixels, odd, tiny, large, and
# smaller than one factor (scaled up to min_pixels, as the reference does), down to 1x1.
TINY = {
    "qwen2_5_vl": [(10, 10), (1, 1), (27, 500), (5, 900), (2, 11), (13, 27)],
    "qwen2_vl_patch16": [(29, 29), (10, 10), (1, 1), (31, 6000), (7, 100), (1, 150)],
}
SIZES = {
    "qwen2_5_vl": [
        (29, 29),
        (28, 28),
        (30, 4500),
        (4500, 30),
        (1500, 1500),
        (1200, 1800),
        (333, 517),
        (101, 999),
        (1001, 77),
        (57, 57),
        (480, 640),
        (719, 1279),
        (64, 3000),
        (999, 1001),
        (55, 83),
        (250, 37),
    ],
    "qwen2_vl_patch16": [
        (33, 33),
        (32, 32),
        (33, 4950),
        (4800, 32),
        (3700, 3600),
        (333, 517),
        (101, 999),
        (1001, 77),
        (65, 65),
        (480, 640),
        (719, 1279),
        (2001, 1499),
        (47, 2999),
        (77, 91),
        (250, 37),
    ],
}
CASES = [(preset, hw) for preset, sizes in SIZES.items() for hw in sizes + TINY[preset]]
assert len(CASES) >= 40


def hf_processors(cfg: PreprocessConfig):
    kw = dict(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        image_mean=list(cfg.mean),
        image_std=list(cfg.std),
    )
    return Qwen2VLImageProcessor(**kw), Qwen2VLImageProcessorPil(**kw)


@pytest.mark.parametrize("preset,hw", CASES, ids=[f"{p}-{h}x{w}" for p, (h, w) in CASES])
def test_matches_transformers(preset, hw, record_property):
    cfg = PreprocessConfig.preset(preset)
    fast, slow = hf_processors(cfg)
    img = textured(*hw, seed=hw[0] * 7 + hw[1])
    # channels_last stated: the processor would guess that a 1xW image is channels-first
    ref_fast = fast(images=[img], return_tensors="pt", input_data_format="channels_last")
    ref_slow = slow(images=[img], return_tensors="pt", input_data_format="channels_last")
    pv, grid = preprocess_images([img], cfg, resize_backend="torch")
    assert grid.tolist() == ref_fast["image_grid_thw"].tolist() == ref_slow["image_grid_thw"].tolist()
    assert pv.shape == ref_fast["pixel_values"].shape
    assert (pv - ref_fast["pixel_values"]).abs().max().item() <= TOL
    pv_pil, grid_pil = preprocess_images([img], cfg, resize_backend="pil")
    assert grid_pil.tolist() == grid.tolist()
    assert (pv_pil - ref_slow["pixel_values"]).abs().max().item() <= TOL
    cross = (pv - ref_slow["pixel_values"]).abs().max().item()
    record_property("max_abs_diff_torch_vs_pil_processor", cross)
    assert cross < 1.0  # a few uint8 levels / 0.27 std at most; never a layout mismatch (that would be ~4)


def test_grayscale_input_equals_rgb_replicated():
    g = textured(200, 300)[..., 0]
    fast, _ = hf_processors(PreprocessConfig())
    ref = fast(images=[np.repeat(g[..., None], 3, -1)], return_tensors="pt")
    for arr in (g, g[..., None], torch.from_numpy(g)):
        pv, grid = preprocess_images([arr], "qwen2_5_vl", resize_backend="torch")
        assert grid.tolist() == ref["image_grid_thw"].tolist()
        assert (pv - ref["pixel_values"]).abs().max().item() <= TOL


def test_batch_of_mixed_sizes_keeps_order_and_equals_one_by_one():
    imgs = [textured(300, 400, 1), textured(64, 900, 2), textured(300, 400, 3), textured(500, 120, 4)]
    fast, _ = hf_processors(PreprocessConfig())
    ref = fast(images=imgs, return_tensors="pt")
    pv, grid = preprocess_images(imgs, "qwen2_5_vl", resize_backend="torch")
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert (pv - ref["pixel_values"]).abs().max().item() <= TOL
    parts = [preprocess_images([im], "qwen2_5_vl", resize_backend="torch")[0] for im in imgs]
    assert torch.equal(torch.cat(parts), pv)


def test_smart_resize_rules():
    assert smart_resize(480, 640, 28, 3136, 1003520) == (476, 644)
    h, w = smart_resize(4000, 4000, 28, 3136, 1003520)
    assert h * w <= 1003520 and h % 28 == 0 and w % 28 == 0
    h, w = smart_resize(28, 40, 28, 56 * 56, 1003520)
    assert h * w >= 56 * 56
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        smart_resize(28, 5601, 28, 3136, 1003520)
    with pytest.raises(ImageSizeError, match="empty size"):
        smart_resize(0, 10, 28, 3136, 1003520)


@pytest.mark.parametrize(
    "factor,min_pixels,max_pixels",
    [(28, 56 * 56, 28 * 28 * 1280), (32, 3136, 12845056), (28, 128 * 28 * 28, 768 * 28 * 28), (28, 1, 10**7)],
)
def test_smart_resize_equals_the_reference_on_every_small_size(factor, min_pixels, max_pixels):
    """Every (h, w) up to 70 x 70 and every aspect ratio around the 200 limit: the same target, and the same
    refusals (only aspect ratio > 200), as transformers' smart_resize."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference

    sizes = [(h, w) for h in range(1, 71) for w in range(1, 71)]
    sizes += [(h, h * 200 + d) for h in (1, 2, 3, 7) for d in (-1, 0, 1)] + [(h * 200 + 1, h) for h in (1, 5)]
    for h, w in sizes:
        try:
            expected = reference(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError:
            with pytest.raises(ImageSizeError, match="aspect ratio"):
                smart_resize(h, w, factor, min_pixels, max_pixels)
            continue
        assert smart_resize(h, w, factor, min_pixels, max_pixels) == expected, (h, w)


def test_video_style_patchify_pads_time_with_last_frame():
    cfg = PreprocessConfig()
    frames = torch.randn(3, 3, 56, 84)
    out = patchify_frames(frames, cfg)
    assert out.shape == (2 * 4 * 6, cfg.patch_dim)
    padded = patchify_frames(torch.cat([frames, frames[-1:]]), cfg)
    assert torch.equal(out, padded)
    # One still image = two identical frames.
    img = torch.randint(0, 256, (1, 3, 56, 84), dtype=torch.uint8)
    norm = (img.float() - torch.tensor(cfg.mean).view(1, 3, 1, 1) * 255) / (
        torch.tensor(cfg.std).view(1, 3, 1, 1) * 255
    )
    torch.testing.assert_close(normalize_patchify(img, cfg), patchify_frames(norm, cfg))


def test_bad_inputs_name_the_image():
    with pytest.raises(ValueError, match="image 1: expected uint8"):
        preprocess_images([textured(50, 50), np.zeros((50, 50, 3), np.float32)])
    with pytest.raises(ImageSizeError, match="image 0: image is 500x2; aspect ratio"):
        preprocess_images([textured(2, 500)])
    with pytest.raises(ValueError, match="unknown preprocessing preset"):
        PreprocessConfig.preset("nope")
