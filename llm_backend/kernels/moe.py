"""Mixture-of-experts kernels: fused sigmoid top-k routing and a grouped expert GEMM, each with a torch twin.

Semantics are `TopkRouter.forward` (n_group == 1) and `Experts.forward` in
`llm_backend.models.mimo_v2_flash`:
- routing: scores = sigmoid(logits); experts are the top-k of scores + correction_bias (the bias only
  chooses), weights are the chosen experts' plain scores, optionally divided by (their sum + 1e-20), times
  routed_scaling_factor. The Triton kernel keeps a block of tokens' E scores in registers (BLOCK_E = next
  power of two of E, padding masked to -inf) and takes k rounds of max / lowest-index argmax / mask-out,
  so logits are read once and nothing is sorted.
- experts: each of the T*k (token, slot) pairs is a "row". `align_by_expert` sorts rows by expert and pads
  each expert's run to a multiple of BLOCK_M with a sentinel row (T*k), so every BLOCK_M block of the
  sorted list belongs to one expert. `grouped_gemm` then gives each program one such block and one
  BLOCK_N tile of outputs: it gathers A rows a[row // a_row_div] (a_row_div = k reads token rows of x
  directly, no [T*k, H] copy; 1 reads the intermediate), multiplies by w[e]^T with tl.dot, optionally
  scales each row (the routing weight, folded into the second GEMM) and scatters to c[row]. `fused_moe`
  runs gate_up GEMM -> silu(gate) * up (torch) -> down GEMM -> sum over the k slots (torch).
Everything on the device path is sync-free: the padded length is an upper bound and blocks past the
real end carry expert -1 and exit at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton

if TYPE_CHECKING:
    from ..models.quant import BlockFP8Experts, QuantizedExperts

FP8 = torch.float8_e4m3fn
_MIN_DOT = 16  # tl.dot needs every dimension >= 16 on the GPU


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must stay fp32 (the default tf32 would drift from the reference); 16-bit inputs ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------------- routing


@jit
def _topk_routing_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    T,
    E,
    stride_lt,
    scaling,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logits = tl.load(logits_ptr + t[:, None] * stride_lt + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0)
    scores = tl.sigmoid(logits.to(tl.float32))
    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0)
    choice = tl.where(e_ok[None, :], scores + bias[None, :], float("-inf"))

    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 1)
        # Lowest index among equal maxima, so a tie picks one expert, not several.
        pick = tl.min(tl.where(choice == best[:, None], e[None, :], BLOCK_E), 1)
        picked = e[None, :] == pick[:, None]
        w = tl.sum(tl.where(picked, scores, 0.0), 1)
        weights = tl.where(slot[None, :] == j, w[:, None], weights)
        ids = tl.where(slot[None, :] == j, pick[:, None], ids)
        choice = tl.where(picked, float("-inf"), choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)  # padding slots hold 0, add nothing
    weights = weights * scaling

    out_mask = t_ok[:, None] & (slot[None, :] < TOP_K)
    offs = t[:, None] * TOP_K + slot[None, :]
    tl.store(weights_ptr + offs, weights, mask=out_mask)
    tl.store(ids_ptr + offs, ids.to(tl.int64), mask=out_mask)


def _check_routing(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int) -> None:
    if router_logits.ndim != 2 or router_logits.dtype != torch.float32:
        raise ValueError(f"router_logits must be fp32 [T, E], got {tuple(router_logits.shape)} {router_logits.dtype}")
    n_experts = router_logits.shape[1]
    if correction_bias.shape != (n_experts,) or correction_bias.dtype != torch.float32:
        raise ValueError(
            f"correction_bias must be fp32 [E={n_experts}], got {tuple(correction_bias.shape)} {correction_bias.dtype}"
        )
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in [1, E={n_experts}], got {top_k}")
    if correction_bias.device != router_logits.device:
        raise ValueError(f"correction_bias is on {correction_bias.device}, router_logits on {router_logits.device}")


def topk_routing(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton sigmoid top-k routing. router_logits fp32 [T, E] -> (weights fp32 [T, k], ids int64 [T, k]).
    The k slots come in descending order of score + bias (the model's order is unspecified)."""
    _check_routing(router_logits, correction_bias, top_k)
    n_tokens, n_experts = router_logits.shape
    logits = router_logits.contiguous()
    weights = torch.empty((n_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n_tokens, top_k), dtype=torch.int64, device=logits.device)
    if n_tokens == 0:
        return weights, ids
    block_t = 16
    _topk_routing_kernel[(triton.cdiv(n_tokens, block_t),)](
        logits,
        correction_bias.contiguous(),
        weights,
        ids,
        n_tokens,
        n_experts,
        logits.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(n_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        NORMALIZE=bool(norm_topk_prob),
        num_warps=4,
    )
    return weights, ids


def topk_routing_torch(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `topk_routing` (same slot order: descending score + bias)."""
    _check_routing(router_logits, correction_bias, top_k)
    scores = router_logits.sigmoid()
    ids = torch.topk(scores + correction_bias, k=top_k, dim=-1, sorted=True)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


# ---------------------------------------------------------------------------------------- grouped GEMM


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k rows (row = t*k + j for ids[t, j]) by expert, each expert's run padded to a multiple of
    block_m. Returns (sorted_rows int32 [P], pad = sentinel T*k; block_expert int32 [P // block_m], -1 for
    blocks past the last expert; counts int64 [E]). P is an upper bound computed without a host sync."""
    flat = ids.reshape(-1).long()
    n_rows = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"ids contain an expert >= num_experts={num_experts}")
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = torch.cumsum(padded, 0)
    pad_starts = pad_ends - padded
    raw_starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(n_rows, device=ids.device) - raw_starts[expert_of_sorted]
    dest = pad_starts[expert_of_sorted] + rank
    # At most min(E, T*k) experts are non-empty, each wasting < block_m slots on padding.
    capacity = triton.cdiv(n_rows + min(num_experts, n_rows) * (block_m - 1), block_m) * block_m
    sorted_rows = torch.full((capacity,), n_rows, dtype=torch.int32, device=ids.device)
    sorted_rows[dest] = order.to(torch.int32)
    block_start = torch.arange(capacity // block_m, device=ids.device) * block_m
    block_expert = torch.searchsorted(pad_ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_rows, block_expert, counts


@jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    rows_ptr,
    block_expert_ptr,
    scale_ptr,
    ws_ptr,
    num_rows,
    N,
    K,
    a_row_div,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    stride_wse,
    stride_wsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_W: tl.constexpr,
    WS_BN: tl.constexpr,
    WS_BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # block past the padded end of the last expert
        return
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows  # sentinel padding rows compute garbage-free zeros and store nothing
    a_rows = tl.where(row_ok, rows // a_row_div, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # w[e] is [N, K]; reading it as [BLOCK_K, BLOCK_N] is the transpose the product needs.
        w = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_W:  # block-FP8 weights: dequantized in fp32 by their (row, 128-column) block scale, then a's dtype
            ws = tl.load(
                ws_ptr + expert.to(tl.int64) * stride_wse + (n // WS_BN) * stride_wsn + k0 // WS_BK,
                mask=n_ok,
                other=0.0,
            )
            w = (w.to(tl.float32) * ws[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + rows[:, None].to(tl.int64) * stride_cm + n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_expert: torch.Tensor,
    num_rows: int,
    a_row_div: int,
    row_scale: torch.Tensor | None = None,
    w_scale: tuple[torch.Tensor, tuple[int, int]] | None = None,
) -> torch.Tensor:
    """c[row] = (a[row // a_row_div] @ w[e]^T) * row_scale[row] for every real row of `sorted_rows`, e the
    expert of its block. a [Ra, K], w [E, N, K], row_scale fp32 [num_rows] -> c [num_rows, N] in a.dtype.
    BLOCK_M is sorted_rows.numel() // block_expert.numel() (as built by `align_by_expert`). `w_scale`: w is
    float8_e4m3fn with scales [E, ceil(N / bn), ceil(K / bk)] and its block (bn, bk), bk a multiple of the K tile:
    each tile is dequantized in the kernel (the result equals the torch path's dequantize-then-multiply)."""
    if a.ndim != 2 or w.ndim != 3 or w.shape[2] != a.shape[1]:
        raise ValueError(f"expected a [R, K] and w [E, N, K] with equal K, got {tuple(a.shape)}, {tuple(w.shape)}")
    if a.dtype != w.dtype and w_scale is None:
        raise ValueError(f"a and w dtypes differ: {a.dtype}, {w.dtype}")
    if (
        sorted_rows.dtype != torch.int32
        or block_expert.dtype != torch.int32
        or block_expert.numel() == 0
        or sorted_rows.numel() % block_expert.numel()
    ):
        raise ValueError("sorted_rows/block_expert must be int32 from align_by_expert")
    block_m = sorted_rows.numel() // block_expert.numel()
    if block_m < _MIN_DOT or block_m & (block_m - 1):
        raise ValueError(f"BLOCK_M must be a power of two >= {_MIN_DOT}, got {block_m}")
    if a_row_div < 1 or a.shape[0] * a_row_div < num_rows:
        raise ValueError(f"a has {a.shape[0]} rows, too few for {num_rows} rows with a_row_div={a_row_div}")
    if row_scale is not None and row_scale.shape != (num_rows,):
        raise ValueError(f"row_scale must be [{num_rows}], got {tuple(row_scale.shape)}")
    n_out, k_in = w.shape[1], w.shape[2]
    a = a.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    c = torch.empty((num_rows, n_out), dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return c
    block_n = min(64, max(_MIN_DOT, triton.next_power_of_2(n_out)))
    block_k = min(64, max(_MIN_DOT, triton.next_power_of_2(k_in)))
    scale_arg = row_scale.contiguous() if row_scale is not None else c  # dummy pointer when HAS_SCALE is off
    ws, (ws_bn, ws_bk) = (w_scale[0].contiguous(), w_scale[1]) if w_scale is not None else (c, (1, block_k))
    if w_scale is not None and ws_bk % block_k:
        raise ValueError(f"the scale block's {ws_bk} columns must be a multiple of the K tile {block_k}")
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(n_out, block_n))](
        a,
        w,
        c,
        sorted_rows,
        block_expert,
        scale_arg,
        ws,
        num_rows,
        n_out,
        k_in,
        a_row_div,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        c.stride(0),
        ws.stride(0) if w_scale is not None else 0,
        ws.stride(1) if w_scale is not None else 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_SCALE=row_scale is not None,
        DOT_PRECISION=_dot_precision(a.dtype),
        FP8_W=w_scale is not None,
        WS_BN=ws_bn,
        WS_BK=ws_bk,
        num_warps=4,
    )
    return c


def _check_moe(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    n_tokens, hidden = x.shape
    if w_gate_up.ndim != 3 or w_gate_up.shape[2] != hidden or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H={hidden}], got {tuple(w_gate_up.shape)}")
    n_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if w_down.shape != (n_experts, hidden, inter):
        raise ValueError(f"w_down must be [E={n_experts}, H={hidden}, I={inter}], got {tuple(w_down.shape)}")
    if ids.ndim != 2 or ids.shape[0] != n_tokens or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int [T={n_tokens}, k], got {tuple(ids.shape)} {ids.dtype}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} differ in shape")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype) and not w_gate_up.dtype == w_down.dtype == FP8:
        raise ValueError(f"x/w_gate_up/w_down dtypes differ: {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp8: BlockFP8Experts | None = None,
) -> torch.Tensor:
    """Triton routed experts: out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j].
    x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights [T, k], ids [T, k] -> [T, H] in x.dtype. `fp8`: the
    weights are block-FP8 experts (llm_backend/models/quant.py), dequantized tile by tile inside the GEMMs."""
    _check_moe(x, w_gate_up, w_down, weights, ids)
    n_tokens, hidden = x.shape
    top_k = ids.shape[1]
    n_rows = n_tokens * top_k
    if n_rows == 0:
        return torch.zeros_like(x)
    block_m = 16 if n_rows < 4096 else 64  # few rows per expert at decode: small blocks waste less padding
    sorted_rows, block_expert, _ = align_by_expert(ids, w_gate_up.shape[0], block_m)
    gu_scale = (fp8.gate_up_proj_scale_inv, fp8.gate_up_block) if fp8 is not None else None
    down_scale = (fp8.down_proj_scale_inv, fp8.down_block) if fp8 is not None else None
    gate_up = grouped_gemm(x, w_gate_up, sorted_rows, block_expert, n_rows, a_row_div=top_k, w_scale=gu_scale)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(x.dtype)
    down = grouped_gemm(
        act,
        w_down,
        sorted_rows,
        block_expert,
        n_rows,
        a_row_div=1,
        row_scale=weights.reshape(-1).float(),
        w_scale=down_scale,
    )
    return down.view(n_tokens, top_k, hidden).float().sum(1).to(x.dtype)


def fused_moe_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    quantized: QuantizedExperts | None = None,
) -> torch.Tensor:
    """Torch twin of `fused_moe`: one matmul pair per expert that received rows, like `Experts.forward`. With
    `quantized` (FP8 or MXFP4 experts, llm_backend/models/quant.py) each such expert is dequantized for the call.
    An id equal to E (the experts' count here) names an expert another rank holds (expert parallelism): its rows
    are skipped (they sort last, so the others' offsets are unchanged)."""
    if quantized is None:
        _check_moe(x, w_gate_up, w_down, weights, ids)
    top_k = ids.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()[: w_gate_up.shape[0]]  # id E: held elsewhere
    flat_weights = weights.reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        tokens = rows // top_k
        wg, wd = quantized.expert(expert, x.dtype) if quantized is not None else (w_gate_up[expert], w_down[expert])
        gate, up = F.linear(x[tokens], wg).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, wd)
        out.index_add_(0, tokens, y.float() * flat_weights[rows, None].float())
    return out.to(x.dtype)
