"""Block-FP8 kernels (llm_backend/kernels/fp8.py): the Triton activation quantizer and FP8 GEMM equal their torch
twins (under TRITON_INTERPRET=1 without CUDA), the twins equal the definition, and the CPU path equals the
dequantized weight exactly. Shapes cross block edges: K not a multiple of 128, N not a multiple of the tile or of
the scale block, one scale row per weight row (the fused-QKV case)."""

import pytest
import torch

triton = pytest.importorskip("triton")
from llm_backend.kernels.fp8 import (  # noqa: E402
    FP8,
    act_quant,
    act_quant_torch,
    dequantize,
    fp8_gemm,
    fp8_gemm_torch,
    fp8_linear_torch,
    quantize,
    row_scales,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))


@pytest.mark.parametrize("n,k,bn", [(200, 300, 128), (96, 128, 1), (130, 257, 128), (70, 64, 1)])
def test_gemm_matches_twin(n, k, bn):
    w = _weight(n, k, n + k)
    q, s = quantize(w)
    if bn == 1:
        s = row_scales(s, n, 128)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    xq, xs = act_quant_torch(x, 128)
    ref = fp8_gemm_torch(xq, xs, q, s, (bn, 128), torch.float32)
    got = fp8_gemm(xq.to(DEVICE), xs.to(DEVICE), q.to(DEVICE), s.to(DEVICE), (bn, 128), torch.float32).cpu()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4)
    # The twin is the definition: quantized activations times the dequantized weight, block by block.
    exact = dequantize(xq, xs, (1, 128)) @ dequantize(q, s, (bn, 128)).T
    assert torch.allclose(ref, exact, rtol=1e-5, atol=1e-4)
    # Against the CPU path (activations unquantized): e4m3 activations cost a few percent, no more.
    cpu = fp8_linear_torch(x, q, s, (bn, 128))
    assert (ref - cpu).norm() / cpu.norm() < 0.05


def test_act_quant_matches_twin():
    """Per token and group of 128: the same FP8 codes (ties to even, including values that round up into the next
    power of two, which Triton's interpreter converts wrongly without the kernel's explicit rounding)."""
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(2)) * 3
    xq, xs = act_quant_torch(x, 128)
    gq, gs = act_quant(x.to(DEVICE), 128)
    assert torch.equal(gs.cpu(), xs)
    assert torch.equal(gq.cpu().float(), xq.float())
    assert xq.dtype == FP8 and xs.shape == (7, 3)


def test_quantize_roundtrip_and_grid():
    w = _weight(300, 200, 5)
    q, s = quantize(w)
    assert q.dtype == FP8 and s.shape == (3, 2)
    back = dequantize(q, s, (128, 128))
    assert (back - w).norm() / w.norm() < 0.035
    assert torch.equal(dequantize(q, row_scales(s, 300, 128), (1, 128)), back)
    with pytest.raises(ValueError, match="scale grid"):
        dequantize(q, s[:2], (128, 128))


@pytest.mark.parametrize("hidden,inter,bn", [(64, 32, 128), (200, 48, 1)])
def test_fused_moe_with_fp8_experts_matches_the_torch_path(hidden, inter, bn):
    """The grouped expert GEMMs over block-FP8 experts (each weight tile dequantized in the kernel) equal the torch
    path that dequantizes each used expert: K crossing a scale block (200 = 128 + 72), one scale row per weight row
    (I = 48 is not a multiple of 128) and whole 128-row blocks."""
    from llm_backend.kernels import fused_moe, fused_moe_torch
    from llm_backend.models.quant import BlockFP8Experts

    e, t, k = 4, 9, 2
    g = torch.Generator().manual_seed(hidden)
    experts = BlockFP8Experts(e, hidden, inter, (128, 128))
    assert experts.gate_up_block[0] == (128 if inter % 128 == 0 else 1)
    for name, (rows, cols) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        block = experts.gate_up_block if name == "gate_up_proj" else experts.down_block
        qs, ss = [], []
        for _ in range(e):
            q, sc = quantize(_weight(rows, cols, int(torch.randint(0, 1000, (1,), generator=g))))
            qs.append(q)
            ss.append(row_scales(sc, rows, 128) if block[0] == 1 else sc)
        getattr(experts, name).data = torch.stack(qs)
        getattr(experts, f"{name}_scale_inv").data = torch.stack(ss)
    x = torch.randn(t, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, k, generator=g)
    ref = fused_moe_torch(x, experts.gate_up_proj, experts.down_proj, weights, ids.long(), quantized=experts)
    experts = experts.to(DEVICE)
    got = fused_moe(
        x.to(DEVICE), experts.gate_up_proj, experts.down_proj, weights.to(DEVICE), ids.to(DEVICE), fp8=experts
    ).cpu()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5  # fp32 sums in another order: rounding only


def test_fp8_table_decodes_every_code_exactly():
    """The CPU decode table gives torch's value for each of the 256 e4m3fn codes (NaN codes as NaN)."""
    from llm_backend.kernels.fp8 import fp8_to_f32

    codes = torch.arange(256, dtype=torch.uint8).view(FP8).view(16, 16)
    got, want = fp8_to_f32(codes), codes.float()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])
