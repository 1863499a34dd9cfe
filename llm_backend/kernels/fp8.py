"""Block-scaled FP8 weights (the released MiMo format): dequantization, the CPU GEMM and the Triton GEMM.

A weight W [N, K] is stored as `q` (float8_e4m3fn) and `scale_inv` S (float32, [ceil(N / bn), ceil(K / bk)]):

    W[n, k] = q[n, k] * S[n // bn, k // bk]

The release uses bn = bk = 128 ("weight_block_size": [128, 128]); the last block of a dimension that is not a
multiple of 128 is partial. Rows cut out of a fused, pre-split QKV at a non-block boundary keep their exact
scales with bn = 1: one scale row per weight row (`row_scales`), so a slice of rows never shares a scale with
rows of another projection (the straddling-block bug).

Two GEMMs, each next to its twin:
- CPU: `fp8_linear_torch(x, q, s, block)` dequantizes W into x's dtype (per call: the FP8 bytes stay resident) and
  runs F.linear. Exact to the dequantized weight.
- CUDA: `fp8_linear(x, q, s, block)` quantizes the activations per token and per group of bk columns
  (DeepSeek-V3-style dynamic activations: scale = amax / 448, `act_quant`), then `fp8_gemm` multiplies FP8 by FP8
  block by block with fp32 accumulation: out[t, n] = sum_kb (xq[t, kb] . q[n, kb]) * xs[t, kb] * S[n // bn, kb].
  `act_quant_torch` and `fp8_gemm_torch` are its twins (tests run the kernels under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [rows, cols] weight with `block` = (bn, bk)."""
    return (-(-rows // block[0]), -(-cols // block[1]))


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """W = q * S broadcast over its blocks, for a weight [..., N, K] (leading dims: experts) -> `dtype`."""
    bn, bk = block
    n, k = q.shape[-2:]
    gn, gk = scale_shape(n, k, block)
    if tuple(s.shape[-2:]) != (gn, gk):
        raise ValueError(f"scale grid {tuple(s.shape)} does not fit a {n}x{k} weight in {bn}x{bk} blocks")
    lead = q.shape[:-2]
    scale = s.float()
    w = fp8_to_f32(q)
    if n % bn == 0 and k % bk == 0:  # whole blocks: scale a block view in place
        w.view(*lead, gn, bn, gk, bk).mul_(scale.view(*lead, gn, 1, gk, 1))
        return w.to(dtype)
    full = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w * full).to(dtype)


_E4M3_VALUES: dict[torch.device, torch.Tensor] = {}


def fp8_to_f32(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn weights as fp32. On a CPU through a 256-entry table of every code's exact value, indexed by the byte
    (bf16 holds every e4m3 value exactly, and a 2-byte gather is the cheapest): 3.3 ms for a 3072 x 1024 weight
    where torch's own conversion, element by element there, takes 7.8 ms. Exact, subnormals included (e4m3's are
    normal fp32 numbers). Elsewhere torch's conversion."""
    if q.device.type != "cpu":
        return q.float()
    lut = _E4M3_VALUES.get(q.device)
    if lut is None:
        lut = _E4M3_VALUES[q.device] = torch.arange(256, dtype=torch.uint8).view(FP8).to(torch.bfloat16)
    return lut.index_select(0, q.view(torch.uint8).reshape(-1).to(torch.int32)).view(q.shape).float()


def row_scales(s: torch.Tensor, rows: int, bn: int) -> torch.Tensor:
    """A scale grid with bn rows per block as one scale row per weight row (exact: the same values)."""
    return s.repeat_interleave(bn, dim=-2)[..., :rows, :].contiguous()


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] as block FP8: per block, scale_inv = amax / 448 (1 where the block is zero).
    What `make-checkpoint --weights fp8` and `--quantization fp8` write; dequantize(quantize(w)) ~ w."""
    bn, bk = block
    n, k = w.shape[-2:]
    gn, gk = scale_shape(n, k, block)
    pad = F.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    blocks = pad.unflatten(-1, (gk, bk)).unflatten(-3, (gn, bn))  # [..., gn, bn, gk, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., gn, gk]
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s.float()


def fp8_linear_torch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The CPU path: W dequantized into x's dtype for this call, then x @ W^T."""
    return F.linear(x, dequantize(q, s, block, x.dtype))


# ------------------------------------------------------------------------------------- activations


def act_quant_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> FP8 [T, K] and scales [T, ceil(K / group)] (fp32): per token and group, amax / 448."""
    t, k = x.shape
    g = -(-k // group)
    pad = F.pad(x.float(), (0, g * group - k)).view(t, g, group)
    amax = pad.abs().amax(-1).clamp_min(1e-10)
    scale = amax / FP8_MAX
    xq = (pad / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(t, g * group)[:, :k]
    return xq.contiguous(), scale


@jit
def _round_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, in exact fp32 arithmetic: the
    FP8 conversion then only re-encodes (Triton's interpreter carries a rounding into the exponent wrongly)."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |y|) for normal fp32 values
    e = tl.maximum(e, -6) - 3  # e4m3: 3 mantissa bits; below 2^-6 the subnormal step 2^-9
    quantum = ((e + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and removing it rounds to an integer, ties to even
    return ((y / quantum + magic) - magic) * quantum


@jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_x, stride_q, GROUP: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = cols < K
    x = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 0), 1e-10)
    scale = amax / 448.0
    y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + t * stride_q + cols, _round_e4m3(y).to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + t * G + g, scale)


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `act_quant_torch` (group a power of two)."""
    t, k = x.shape
    g = -(-k // group)
    xq = torch.empty((t, k), dtype=FP8, device=x.device)
    xs = torch.empty((t, g), dtype=torch.float32, device=x.device)
    if t:
        _act_quant_kernel[(t, g)](x, xq, xs, k, g, x.stride(0), xq.stride(0), GROUP=group)
    return xq, xs


# ------------------------------------------------------------------------------------- the GEMM


def fp8_gemm_torch(
    xq: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype
) -> torch.Tensor:
    """Twin of `fp8_gemm`: out[t, n] = sum over k-blocks of (xq . q) * xs[t, kb] * S[n // bn, kb], in fp32."""
    bn, bk = block
    n, k = q.shape
    out = torch.zeros((xq.shape[0], n), dtype=torch.float32, device=xq.device)
    srow = s.float().repeat_interleave(bn, dim=0)[:n]  # [N, KB]
    for kb in range(-(-k // bk)):
        a = xq[:, kb * bk : (kb + 1) * bk].float()
        b = q[:, kb * bk : (kb + 1) * bk].float()
        out += (a @ b.T) * xs[:, kb : kb + 1] * srow[None, :, kb]
    return out.to(dtype)


@jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    KB,
    stride_am,
    stride_bn,
    stride_cm,
    stride_bsn,
    SCALE_BN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[None, :] * stride_bn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + rm * KB + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + (rn // SCALE_BN) * stride_bsn + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_s[:, None] * b_s[None, :]
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def fp8_gemm(
    xq: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype
) -> torch.Tensor:
    """Triton block-scaled FP8 x FP8 GEMM (fp32 accumulation), the K block = the scale block bk."""
    m, k = xq.shape
    n = q.shape[0]
    bn, bk = block
    out = torch.empty((m, n), dtype=dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        xq,
        xs,
        q,
        s,
        out,
        m,
        n,
        k,
        -(-k // bk),
        xq.stride(0),
        q.stride(0),
        out.stride(0),
        s.stride(0),
        SCALE_BN=bn,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
    )
    return out


def fp8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The CUDA path: per-token-group FP8 activations, then the block-scaled FP8 GEMM; x [..., K] -> [..., N]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    xq, xs = act_quant(x2, block[1])
    return fp8_gemm(xq, xs, q, s, block, x.dtype).view(*shape[:-1], q.shape[0])


# ------------------------------------------------------------------------------------- MXFP4 (MiMo-V2.6 experts)

# e2m1 codes 0-15: sign bit 3, then 2 exponent and 1 mantissa bits (OCP MX spec): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int = 32, dtype=torch.float32) -> torch.Tensor:
    """MXFP4 weights [..., N, K/2] (uint8: two e2m1 codes a byte, the low nibble the even column) with e8m0 scales
    [..., N, K/block] (uint8: 2^(s - 127)) -> [..., N, K]."""
    lead, (n, half) = packed.shape[:-2], packed.shape[-2:]
    k = 2 * half
    if tuple(scales.shape[-2:]) != (n, -(-k // block)):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not fit a {n}x{k} weight in blocks of {block}")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(*lead, n, k).long()
    values = lut[codes]
    exp = scales.to(torch.int32) - 127
    pad = -(-k // block) * block - k
    values = torch.nn.functional.pad(values, (0, pad)).view(*lead, n, -1, block)
    values = torch.ldexp(values, exp[..., None].float())
    return values.view(*lead, n, -1)[..., :k].to(dtype)


def mxfp4_quantize(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] (K even) as MXFP4: per block of `block` columns the power-of-two scale that puts
    the block's largest magnitude at most 6 (e2m1's largest), each value rounded to the nearest e2m1 magnitude (a tie
    to the smaller one). What make-checkpoint writes for V2.6's experts."""
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    g = -(-k // block)
    x = torch.nn.functional.pad(w.float(), (0, g * block - k)).view(*lead, n, g, block)
    amax = x.abs().amax(-1).clamp_min(2.0**-126)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # 6 = 1.5 * 2^2
    exp = torch.where(amax / torch.exp2(exp) > 6.0, exp + 1, exp)
    y = (x / torch.exp2(exp)[..., None]).view(*lead, n, g * block)[..., :k]
    lut = torch.tensor(E2M1[:8], dtype=torch.float32)
    codes = (y.abs()[..., None] - lut).abs().argmin(-1)  # nearest magnitude (the smaller one on a tie)
    codes = codes | ((y < 0).long() << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)
