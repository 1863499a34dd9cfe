"""The fused Triton preprocessing kernel equals its torch reference.

On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (set by tests/conftest.py before
Triton is imported); with CUDA it runs on the GPU.
"""

import pytest
import torch

from encoder_server.preprocess import PreprocessConfig, normalize_patchify

triton = pytest.importorskip("triton")
from encoder_server.kernels import patchify_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "preset,n,gh,gw", [("qwen2_5_vl", 1, 2, 2), ("qwen2_5_vl", 2, 4, 2), ("qwen2_vl_patch16", 1, 2, 4)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_reference(preset, n, gh, gw, dtype):
    cfg = PreprocessConfig.preset(preset)
    p = cfg.patch_size
    gen = torch.Generator().manual_seed(gh * 10 + gw)
    img = torch.randint(0, 256, (n, 3, gh * p, gw * p), dtype=torch.uint8, generator=gen).to(DEVICE)
    ref = normalize_patchify(img, cfg, dtype)
    out = patchify_triton(img, cfg, dtype)
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    else:  # one rounding of the same fp32 value: equal up to the last bit
        torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_pixels_of_mimos_resize(dtype):
    """MiMo's resize leaves float pixels (never rounded): the kernel reads them as they are."""
    cfg = PreprocessConfig.preset("mimo_v2_5")
    gen = torch.Generator().manual_seed(5)
    img = (torch.rand(2, 3, 64, 96, generator=gen) * 255).to(DEVICE)
    ref = normalize_patchify(img, cfg, dtype, fold_time=True)
    out = patchify_triton(img, cfg, dtype, fold_time=True)
    assert not torch.equal(img, img.round())
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2**-7)


def test_rejects_bad_shapes():
    cfg = PreprocessConfig()
    with pytest.raises(ValueError, match="uint8"):
        patchify_triton(torch.zeros(1, 3, 28, 28, dtype=torch.float64), cfg)
    with pytest.raises(ValueError, match="multiple"):
        patchify_triton(torch.zeros(1, 3, 30, 28, dtype=torch.uint8), cfg)


def test_fold_time_matches_reference():
    cfg = PreprocessConfig()
    img = torch.randint(0, 256, (1, 3, 56, 56), dtype=torch.uint8).to(DEVICE)
    ref = normalize_patchify(img, cfg, fold_time=True)
    assert ref.shape == (16, 3 * 14 * 14)
    torch.testing.assert_close(patchify_triton(img, cfg, fold_time=True), ref, atol=1e-6, rtol=1e-6)
    # the folded layout is the first temporal copy of the full layout
    full = normalize_patchify(img, cfg).view(16, 3, 2, 14, 14)
    torch.testing.assert_close(full[:, :, 0].reshape(16, -1), ref)
