"""Fused rescale + normalize + patchify (+ dtype cast) in one pass over a resized uint8 image.

Reference: `encoder_server.preprocess.normalize_patchify` (same layout, same fp32 arithmetic).
One program writes one output row (one patch): it reads the patch's C*P*P bytes once, normalises
them in fp32 as (x - 255*mean[c]) / (255*std[c]), and writes them T times (a still image is T
identical frames), already in the output dtype. The unfused torch path materialises a float copy of
the whole image, a permuted copy and a T-times expanded copy; this reads 1 byte and writes
T*sizeof(dtype) bytes per pixel, nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _patchify_kernel(
    img_ptr,
    out_ptr,
    scale_ptr,
    shift_ptr,
    H,
    W,
    GH,
    GW,
    C: tl.constexpr,
    P: tl.constexpr,
    M: tl.constexpr,
    T: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    per_image = GH * GW
    n = row // per_image
    r = row % per_image
    # Merge-block-major order: (gh/M, gw/M, M, M).
    mm = r % (M * M)
    blk = r // (M * M)
    bw = blk % (GW // M)
    bh = blk // (GW // M)
    y0 = (bh * M + mm // M) * P
    x0 = (bw * M + mm % M) * P

    j = tl.arange(0, BLOCK)
    mask = j < C * P * P
    c = j // (P * P)
    py = (j // P) % P
    px = j % P
    src = img_ptr + ((n * C + c) * H + (y0 + py)) * W + (x0 + px)
    x = tl.load(src, mask=mask, other=0).to(tl.float32)
    shift = tl.load(shift_ptr + c, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + c, mask=mask, other=1.0)
    y = ((x - shift) / scale).to(out_ptr.dtype.element_ty)
    base = out_ptr + row * (C * T * P * P) + (c * T) * (P * P) + py * P + px
    for t in tl.static_range(T):
        tl.store(base + t * (P * P), y, mask=mask)


def patchify_triton(
    resized: torch.Tensor, config, out_dtype: torch.dtype = torch.float32, fold_time: bool = False
) -> torch.Tensor:
    """[N, C, H, W] uint8, or float32 pixels in 0..255 (MiMo's unrounded resize), H and W multiples of patch*merge
    -> [N*gh*gw, C*T*P*P] in out_dtype (T = 1 with fold_time, see `normalize_patchify`)."""
    if resized.dtype not in (torch.uint8, torch.float32) or resized.ndim != 4:
        raise ValueError(f"expected [N, C, H, W] uint8 or float32, got {tuple(resized.shape)} {resized.dtype}")
    n, c, h, w = resized.shape
    p, m, t = config.patch_size, config.merge_size, 1 if fold_time else config.temporal_patch_size
    if h % (p * m) or w % (p * m):
        raise ValueError(f"image {h}x{w} is not a multiple of patch*merge = {p * m}")
    resized = resized.contiguous()
    gh, gw = h // p, w // p
    out = torch.empty((n * gh * gw, c * t * p * p), dtype=out_dtype, device=resized.device)
    shift = torch.tensor(config.mean, dtype=torch.float32, device=resized.device) * 255.0
    scale = torch.tensor(config.std, dtype=torch.float32, device=resized.device) * 255.0
    block = triton.next_power_of_2(c * p * p)
    _patchify_kernel[(n * gh * gw,)](
        resized, out, scale, shift, h, w, gh, gw, C=c, P=p, M=m, T=t, BLOCK=block, num_warps=4
    )
    return out
