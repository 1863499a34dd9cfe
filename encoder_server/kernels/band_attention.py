"""Band attention with sinks over a packed batch, for MiMo's vision tower on CUDA (one kernel for its window and its
full blocks). Torch twin: `encoder_server.models.mimo_vision.band_attention` (the same rule; tested equal under
TRITON_INTERPRET=1).

Rule: inside each segment [cu[i], cu[i+1]) of the packed sequence, query i attends key j iff |i - j| <= `window`
(every key of the segment when `window` <= 0); `sinks[h]`, when given, is added to the logit of the segment's key 0
wherever key 0 is attended. Query head h reads K/V head h // (H / Hkv), so K and V are never expanded.

One program computes BLOCK_M queries of one segment for one head, streaming over only the keys their band reaches
(BLOCK_M + 2 x window at most) with the online softmax: running max m, running sum l, accumulator rescaled by
exp(m_old - m_new). Masked logits are -1e30, not -inf, so a key block that lies wholly outside a row's band adds
terms that the first real logit then rescales to zero (every valid row attends at least its own key).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = -1.0e30


@triton.jit
def _band_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    sink_ptr,
    cu_ptr,
    blk_seg_ptr,
    blk_start_ptr,
    scale,
    stride_q,
    stride_qh,
    stride_k,
    stride_kh,
    stride_v,
    stride_vh,
    stride_o,
    stride_oh,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINK: tl.constexpr,
    WINDOW: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seg = tl.load(blk_seg_ptr + pid)
    qs = tl.load(blk_start_ptr + pid)
    a = tl.load(cu_ptr + seg)
    n = tl.load(cu_ptr + seg + 1) - a

    offs_m = qs + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    qmask = offs_m < n
    q = tl.load(
        q_ptr + (a + offs_m)[:, None] * stride_q + h * stride_qh + offs_d[None, :],
        mask=qmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)

    lo = 0
    hi = n
    if WINDOW > 0:
        lo = tl.maximum(qs - WINDOW, 0)
        hi = tl.minimum(qs + BLOCK_M + WINDOW, n)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kmask = offs_n < hi
        kt = tl.load(
            k_ptr + (a + offs_n)[None, :] * stride_k + kvh * stride_kh + offs_d[:, None],
            mask=kmask[None, :] & dmask[:, None],
            other=0.0,
        ).to(tl.float32)
        s = tl.dot(q, kt) * scale
        if HAS_SINK:
            s = tl.where(offs_n[None, :] == 0, s + sink, s)
        keep = kmask[None, :] & qmask[:, None]
        if WINDOW > 0:
            d = offs_m[:, None] - offs_n[None, :]
            keep = keep & (d <= WINDOW) & (d >= -WINDOW)
        s = tl.where(keep, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + (a + offs_n)[:, None] * stride_v + kvh * stride_vh + offs_d[None, :],
            mask=kmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (a + offs_m)[:, None] * stride_o + h * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=qmask[:, None] & dmask[None, :],
    )


def band_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window: int,
    sinks: torch.Tensor | None,
    block: int = 32,
) -> torch.Tensor:
    """q [S, H, D]; k, v [S, Hkv, D] (Hkv divides H); cu_seqlens [n + 1] -> [S, H, D] (the rule above)."""
    s, heads, dim = q.shape
    if heads % k.shape[1] or v.shape[-1] != dim:
        raise ValueError(f"band attention: {heads} query heads over {k.shape[1]} K/V heads, v width {v.shape[-1]}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    seg_of, start_of = [], []
    for i, n in enumerate(lengths):
        for qs in range(0, n, block):
            seg_of.append(i)
            start_of.append(qs)
    if not seg_of:
        return out
    dev = q.device
    blk_seg = torch.tensor(seg_of, dtype=torch.int32, device=dev)
    blk_start = torch.tensor(start_of, dtype=torch.int32, device=dev)
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    sink = sinks.contiguous() if sinks is not None else q  # unused without HAS_SINK
    _band_kernel[(len(seg_of), heads)](
        q,
        k,
        v,
        out,
        sink,
        cu,
        blk_seg,
        blk_start,
        dim**-0.5,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=heads // k.shape[1],
        D=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_M=block,
        BLOCK_N=block,
        HAS_SINK=sinks is not None,
        WINDOW=max(0, int(window)),
    )
    return out
