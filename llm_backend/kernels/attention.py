"""Paged attention over the engine's slot-indexed KV pool: decode (one query per sequence) and extend
(a ragged block of new queries per sequence), each as a Triton kernel plus a torch twin.

Layout. Per layer the pool is `k_cache [S, Hkv, D]`, `v_cache [S, Hkv, Dv]` (D != Dv, and D = 192 is not
a power of two, so every head-dim axis is a power-of-two BLOCK with a mask). A batch of B sequences is
`slot_table int32 [B, max_cols]` + `kv_lens int32 [B]`: column c < kv_lens[b] of row b is the pool slot
of sequence b's c-th visible key; columns are consecutive positions, slots are arbitrary, and entries
past kv_lens are garbage that must never be read. The new tokens' K/V are already in the pool, so a query
at column cq sees key columns c with c <= cq and, on sliding layers, cq - c < sliding_window (the model's
convention: sliding_window = window + 1 counts the current token). GQA: query head h reads kv head
h // rep. An optional fp32 sink logit per query head joins the softmax denominator and contributes no
value, as in `llm_backend.models.mimo_v2_flash.attention_reference`.

Kernels. Both stream the visible key blocks with an online softmax in fp32. Starting the running max at
the sink and the running sum at 1 (exp(sink - sink)) folds the sink in with no extra pass. Keys are
gathered through the slot table a BLOCK_N at a time, and the loops only visit columns that can be
visible: the window's lower bound and the causal upper bound, so a sliding layer costs O(window) per
query however long the sequence is.
- decode: one program per (sequence, kv head) computes all rep query heads of that kv head at once (they
  share every key load), padded to >= 16 rows so `tl.dot` is legal on the GPU.
- extend: one program per (query block of one sequence, query head). The ragged (sequence, block) list is
  built on the device with no host sync; its length is an upper bound and spare programs exit at once.

The torch twins (`*_torch`) have the same signatures; they are the tests' oracle and the CPU serving path.
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton

_MIN_DOT_ROWS = 16  # tl.dot needs every dimension >= 16 on the GPU
_TILE_BYTES = 48 * 1024  # one K + V key block; two pipeline stages of it stay well inside shared memory


def _blocks(d: int, dv: int, dtype: torch.dtype) -> dict:
    """Head-dim blocks (powers of two, masked) and the key block: as many keys as fit `_TILE_BYTES` (at the
    real shape, D=192 -> 256 and Dv=128, that is 64 keys in bf16 and 32 in fp32), two stages."""
    block_d = max(_MIN_DOT_ROWS, triton.next_power_of_2(d))
    block_dv = max(_MIN_DOT_ROWS, triton.next_power_of_2(dv))
    per_key = (block_d + block_dv) * torch.tensor([], dtype=dtype).element_size()
    block_n = 64
    while block_n > _MIN_DOT_ROWS and block_n * per_key > _TILE_BYTES:
        block_n //= 2
    return {"BLOCK_D": block_d, "BLOCK_DV": block_dv, "BLOCK_N": block_n, "num_stages": 2}


def _check_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    kv_lens: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> None:
    """Shape/dtype checks shared by both attention entry points (q is [rows, Hq, D] in both)."""
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
        raise ValueError(
            f"expected q [*, Hq, D], k_cache [S, Hkv, D], v_cache [S, Hkv, Dv]; got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    s, hkv = k_cache.shape[0], k_cache.shape[1]
    if v_cache.shape[0] != s or v_cache.shape[1] != hkv:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} disagree on slots/heads")
    if k_cache.shape[2] != d:
        raise ValueError(f"q head dim {d} != k_cache head dim {k_cache.shape[2]}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head-dim) axis")
    if slot_table.ndim != 2 or slot_table.dtype != torch.int32:
        raise ValueError(f"slot_table must be int32 [B, max_cols], got {tuple(slot_table.shape)} {slot_table.dtype}")
    if kv_lens.ndim != 1 or kv_lens.dtype != torch.int32 or kv_lens.shape[0] != slot_table.shape[0]:
        raise ValueError(f"kv_lens must be int32 [B={slot_table.shape[0]}], got {tuple(kv_lens.shape)} {kv_lens.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if sinks is not None and (sinks.ndim != 1 or sinks.shape[0] != hq):
        raise ValueError(f"sinks must be [Hq={hq}], got {tuple(sinks.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, slot_table, kv_lens) + ((sinks,) if sinks is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must stay fp32 (the default tf32 would drift from the reference); 16-bit inputs ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _softmax_with_sinks(
    logits: torch.Tensor, sinks: torch.Tensor | None, head_axis_shape: tuple[int, ...]
) -> torch.Tensor:
    """fp32 softmax over the last axis with an optional extra per-head logit that is dropped afterwards.
    `head_axis_shape` views sinks [Hq] so it broadcasts against logits[..., :1]."""
    if sinks is not None:
        sink = sinks.float().view(head_axis_shape).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return probs[..., :-1] if sinks is not None else probs


# ---------------------------------------------------------------------------------------------- decode


@jit
def _key_block(table_row, start, end, k_base, stride_ks, d, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [start, start + BLOCK_N) of one sequence, clipped at `end`: (cols, valid, pool slots, keys
    transposed [BLOCK_D, BLOCK_N]) — keys are gathered through the slot table, so pages need not be contiguous."""
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols < end
    slots = tl.load(table_row + cols, mask=col_ok, other=0).to(tl.int64)
    k = tl.load(k_base + slots[None, :] * stride_ks + d[:, None], mask=col_ok[None, :] & (d[:, None] < D), other=0.0)
    return cols, col_ok, slots, k


@jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    sinks_ptr,
    out_ptr,
    scale,
    window,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    REP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    kv_len = tl.load(lens_ptr + b)

    # The rep query heads of this kv head, padded to BLOCK_H rows (padding rows read q = 0, never stored).
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < REP
    heads = kvh * REP + rows
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

    # The single query sits at column kv_len - 1: every column in [lo, kv_len) is visible, nothing else is.
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - window, 0)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for start in range(lo, kv_len, BLOCK_N):
        cols, col_ok, slots, k = _key_block(table_ptr + b * stride_tb, start, kv_len, k_base, stride_ks, d, D, BLOCK_N)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        # Every block has >= 1 valid column, so m_new is finite and no -inf - -inf can appear.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slots[:, None] * stride_vs + dv[None, :], mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0
        )  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged decode attention. q [B, Hq, D] (query b at column kv_lens[b] - 1) -> [B, Hq, Dv].
    kv_lens must be >= 1 (the query's own key is in the pool)."""
    _check_paged(q, k_cache, v_cache, slot_table, kv_lens, sliding_window, sinks)
    if q.shape[0] != slot_table.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences but slot_table has {slot_table.shape[0]} rows")
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    rep = hq // hkv
    q = q.contiguous()
    slot_table = slot_table.contiguous()
    out = torch.empty((bsz, hq, dv), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    sinks_arg = sinks.float().contiguous() if sinks is not None else q  # dummy pointer when HAS_SINKS is off
    _decode_kernel[(bsz, hkv)](
        q,
        k_cache,
        v_cache,
        slot_table,
        kv_lens,
        sinks_arg,
        out,
        float(scale),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        slot_table.stride(0),
        out.stride(0),
        out.stride(1),
        REP=rep,
        D=d,
        DV=dv,
        BLOCK_H=max(_MIN_DOT_ROWS, triton.next_power_of_2(rep)),
        **_blocks(d, dv, q.dtype),
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4,
    )
    return out


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of `decode_attention`, vectorised over the batch: gather each sequence's last L columns
    (L = longest visible span; on sliding layers at most sliding_window) into a padded [B, L, Hkv, *]."""
    _check_paged(q, k_cache, v_cache, slot_table, kv_lens, sliding_window, sinks)
    if q.shape[0] != slot_table.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences but slot_table has {slot_table.shape[0]} rows")
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    if bsz == 0:
        return q.new_empty((0, hq, v_cache.shape[2]))
    span = int(kv_lens.max().item())
    if sliding_window is not None:
        span = min(span, sliding_window)
    # Right-align every sequence: position j of the span is column kv_len - span + j; negative columns are
    # padding (clamped for the gather, masked out of the softmax). Within the span every column is visible.
    lens = kv_lens.long()
    cols = lens[:, None] - span + torch.arange(span, device=q.device)[None, :]
    valid = cols >= 0
    slots = slot_table.gather(1, cols.clamp(min=0)).long()  # [B, L]
    k = k_cache[slots].float()  # [B, L, Hkv, D]
    v = v_cache[slots].float()  # [B, L, Hkv, Dv]
    qf = q.float().view(bsz, hkv, rep, d)
    logits = torch.einsum("bgrd,blgd->bgrl", qf, k) * scale
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = _softmax_with_sinks(logits, sinks, (1, hkv, rep, 1))
    out = torch.einsum("bgrl,blge->bgre", probs, v)
    return out.reshape(bsz, hq, -1).to(q.dtype)


# ---------------------------------------------------------------------------------------------- extend


@jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    qstarts_ptr,
    block_seq_ptr,
    block_idx_ptr,
    sinks_ptr,
    out_ptr,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ot,
    stride_oh,
    REP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(block_seq_ptr + g)
    if b < 0:  # spare program past the last real query block
        return
    j = tl.load(block_idx_ptr + g)
    q0 = tl.load(qstarts_ptr + b)
    n_q = tl.load(qstarts_ptr + b + 1) - q0
    kv_len = tl.load(lens_ptr + b)
    kvh = h // REP

    # Query i of this sequence sits at column kv_len - n_q + i (the new tokens are the last n_q columns).
    i = j * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < n_q
    q_col = kv_len - n_q + i
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + (q0 + i)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )

    if HAS_SINKS:
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + h).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Key columns any row of this block can see: up to the last row's column (causal), from the first
    # row's window start (sliding). Rows see subsets of that range; the per-element mask does the rest.
    first_col = kv_len - n_q + j * BLOCK_M
    hi = tl.minimum(first_col + BLOCK_M, kv_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_col - window + 1, 0)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for start in range(lo, hi, BLOCK_N):
        cols, col_ok, slots, k = _key_block(table_ptr + b * stride_tb, start, hi, k_base, stride_ks, d, D, BLOCK_N)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        visible = row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= q_col[:, None])
        if HAS_WINDOW:
            visible = visible & (q_col[:, None] - cols[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        # A row may see nothing in this block (window start past it, or a padding row): keep its max at a
        # finite stand-in so exp() gives 0 instead of exp(-inf - -inf) = nan.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slots[:, None] * stride_vs + dv[None, :], mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only on padding rows (not stored)
    tl.store(
        out_ptr + (q0 + i)[:, None] * stride_ot + h * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def _check_q_starts(q: torch.Tensor, slot_table: torch.Tensor, q_starts: torch.Tensor) -> None:
    bsz = slot_table.shape[0]
    if q_starts.ndim != 1 or q_starts.dtype != torch.int32 or q_starts.shape[0] != bsz + 1:
        raise ValueError(
            f"q_starts must be int32 [B+1={bsz + 1}] (cumulative query counts), got "
            f"{tuple(q_starts.shape)} {q_starts.dtype}"
        )
    if q_starts.device != q.device:
        raise ValueError(f"q_starts is on {q_starts.device}, q on {q.device}")


def _query_blocks(q_starts: torch.Tensor, n_tokens: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, block-within-sequence) of every BLOCK_M query block, on the device without a host sync.
    Length cdiv(Tq, BLOCK_M) + B bounds sum_b cdiv(n_b, BLOCK_M); the spare tail has sequence -1."""
    bsz = q_starts.shape[0] - 1
    n_q = (q_starts[1:] - q_starts[:-1]).long()
    blocks = (n_q + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    grid = triton.cdiv(n_tokens, block_m) + bsz
    g = torch.arange(grid, device=q_starts.device)
    seq = torch.searchsorted(ends, g, right=True)  # first sequence whose blocks end after g
    real = seq < bsz
    seq_c = seq.clamp(max=bsz - 1)
    local = g - (ends - blocks)[seq_c]
    return torch.where(real, seq_c, -1).to(torch.int32), local.to(torch.int32)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_starts: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged extend (prefill) attention over a ragged batch. q [Tq, Hq, D]; sequence b's queries
    q[q_starts[b]:q_starts[b+1]] are the last n_b columns of its kv_lens[b] keys. Returns [Tq, Hq, Dv]."""
    _check_paged(q, k_cache, v_cache, slot_table, kv_lens, sliding_window, sinks)
    _check_q_starts(q, slot_table, q_starts)
    n_tokens, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    q = q.contiguous()
    slot_table = slot_table.contiguous()
    out = torch.empty((n_tokens, hq, dv), dtype=q.dtype, device=q.device)
    if n_tokens == 0 or slot_table.shape[0] == 0:
        return out
    block_m = 32
    block_seq, block_idx = _query_blocks(q_starts, n_tokens, block_m)
    sinks_arg = sinks.float().contiguous() if sinks is not None else q  # dummy pointer when HAS_SINKS is off
    _extend_kernel[(block_seq.shape[0], hq)](
        q,
        k_cache,
        v_cache,
        slot_table,
        kv_lens,
        q_starts,
        block_seq,
        block_idx,
        sinks_arg,
        out,
        float(scale),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        slot_table.stride(0),
        out.stride(0),
        out.stride(1),
        REP=hq // hkv,
        D=d,
        DV=dv,
        BLOCK_M=block_m,
        **_blocks(d, dv, q.dtype),
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4,
    )
    return out


def extend_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_starts: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of `extend_attention`: one masked fp32 softmax per sequence over the columns its
    queries can see (from the first query's window start to its last key)."""
    _check_paged(q, k_cache, v_cache, slot_table, kv_lens, sliding_window, sinks)
    _check_q_starts(q, slot_table, q_starts)
    n_tokens, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    rep = hq // hkv
    out = q.new_zeros((n_tokens, hq, dv))
    starts, lens = q_starts.tolist(), kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        first = kv_len - n  # column of the first new query
        lo = 0 if sliding_window is None else max(0, first - sliding_window + 1)
        key_cols = torch.arange(lo, kv_len, device=q.device)
        q_cols = first + torch.arange(n, device=q.device)
        slots = slot_table[b, lo:kv_len].long()
        k = k_cache[slots].float()  # [Lk, Hkv, D]
        v = v_cache[slots].float()
        qf = q[q0:q1].float().view(n, hkv, rep, d)
        logits = torch.einsum("ngrd,kgd->grnk", qf, k) * scale
        diff = q_cols[:, None] - key_cols[None, :]
        visible = diff >= 0
        if sliding_window is not None:
            visible &= diff < sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = _softmax_with_sinks(logits, sinks, (hkv, rep, 1, 1))
        out[q0:q1] = torch.einsum("grnk,kge->ngre", probs, v).reshape(n, hq, dv).to(q.dtype)
    return out
