"""The LLM Triton kernels equal their torch twins, and the twins equal the model's own reference code.

Three-way checks anchor everything to `llm_backend.models.mimo_v2_flash` (parity-tested against the real
model): attention against `tests/llm/reference.attention_reference` on the gathered keys, routing against
`TopkRouter`, the expert GEMMs against a per-token reference (`moe_reference`). Without CUDA the kernels run under TRITON_INTERPRET=1 (set by
tests/conftest.py before Triton is imported), so shapes stay small; D != Dv and neither a power of two
exercises the masked head-dim blocks, and kv lengths cross key blocks and window edges.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
from llm_backend.kernels import (  # noqa: E402
    align_by_expert,
    decode_attention,
    decode_attention_torch,
    extend_attention,
    extend_attention_torch,
    fused_moe,
    fused_moe_torch,
    topk_routing,
    topk_routing_torch,
    triton_enabled,
)
from llm_backend.models.mimo_v2_flash import Experts, MiMoV2FlashConfig, TopkRouter  # noqa: E402
from tests.llm.reference import attention_reference, moe_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HKV, REP, D, DV = 2, 3, 24, 16
HQ = HKV * REP
WINDOW = 8  # sliding_window in the model's convention (window + 1)


def _paged_batch(kv_lens: list[int], seed: int, pool_slots: int = 400):
    """Random pool + a slot table that scatters each sequence over a random permutation of the pool.
    Table entries past kv_len point at other sequences' slots, so reading them would change the result."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool_slots, HKV, D, generator=gen)
    v_cache = torch.randn(pool_slots, HKV, DV, generator=gen)
    perm = torch.randperm(pool_slots, generator=gen)
    max_cols = max(kv_lens) + 5
    table = perm[torch.randint(0, pool_slots, (len(kv_lens), max_cols), generator=gen)]
    used = 0
    for b, n in enumerate(kv_lens):
        table[b, :n] = perm[used : used + n]
        used += n
    assert used <= pool_slots
    sinks = torch.randn(HQ, generator=gen)
    to = dict(device=DEVICE)
    return (
        k_cache.to(**to),
        v_cache.to(**to),
        table.to(torch.int32).to(**to),
        torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        sinks.to(**to),
        gen,
    )


@pytest.mark.parametrize("sliding_window", [None, WINDOW])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_decode_attention(sliding_window, use_sinks):
    # 1 key; exactly the window; window + 1; several windows and > one 64-key block; short.
    kv_lens = [1, WINDOW, WINDOW + 1, 150, 37]
    k_cache, v_cache, table, lens, sinks, gen = _paged_batch(kv_lens, seed=1)
    sinks = sinks if use_sinks else None
    q = torch.randn(len(kv_lens), HQ, D, generator=gen).to(DEVICE)
    scale = D**-0.5

    out = decode_attention(q, k_cache, v_cache, table, lens, scale, sliding_window, sinks)
    ref = decode_attention_torch(q, k_cache, v_cache, table, lens, scale, sliding_window, sinks)
    assert out.shape == (len(kv_lens), HQ, DV) and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    for b, n in enumerate(kv_lens):
        slots = table[b, :n].long()
        model = attention_reference(
            q[b : b + 1],
            k_cache[slots],
            v_cache[slots],
            torch.tensor([n - 1], device=DEVICE),
            torch.arange(n, device=DEVICE),
            scale,
            sliding_window,
            sinks,
        )
        torch.testing.assert_close(ref[b : b + 1], model, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, WINDOW + 9])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_extend_attention(sliding_window, use_sinks):
    # (cached prefix, new queries): no prefix, long prefill crossing a 32-query block, prefix + a few,
    # prefix + a block and a bit (window edges land inside query blocks), a single query, no new queries.
    plan = [(0, 1), (0, 40), (25, 7), (70, 33), (3, 1), (10, 0)]
    kv_lens = [p + n for p, n in plan]
    k_cache, v_cache, table, lens, sinks, gen = _paged_batch(kv_lens, seed=2)
    sinks = sinks if use_sinks else None
    counts = torch.tensor([0] + [n for _, n in plan])
    q_starts = torch.cumsum(counts, 0).to(torch.int32).to(DEVICE)
    n_tokens = int(counts.sum())
    q = torch.randn(n_tokens, HQ, D, generator=gen).to(DEVICE)
    scale = 0.3

    out = extend_attention(q, k_cache, v_cache, table, lens, q_starts, scale, sliding_window, sinks)
    ref = extend_attention_torch(q, k_cache, v_cache, table, lens, q_starts, scale, sliding_window, sinks)
    assert out.shape == (n_tokens, HQ, DV)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    start = 0
    for b, (prefix, n) in enumerate(plan):
        if n == 0:
            continue
        slots = table[b, : prefix + n].long()
        model = attention_reference(
            q[start : start + n],
            k_cache[slots],
            v_cache[slots],
            torch.arange(prefix, prefix + n, device=DEVICE),
            torch.arange(prefix + n, device=DEVICE),
            scale,
            sliding_window,
            sinks,
        )
        torch.testing.assert_close(ref[start : start + n], model, atol=1e-5, rtol=1e-5)
        start += n


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot order is unspecified: compare ids sorted per row, weights permuted alongside."""
    ids_sorted, perm = ids.sort(dim=1)
    return weights.gather(1, perm), ids_sorted


@pytest.mark.parametrize("n_experts,top_k,norm", [(8, 2, True), (12, 3, False), (12, 3, True)])
def test_topk_routing(n_experts, top_k, norm):
    cfg = MiMoV2FlashConfig(
        hidden_size=16,
        n_routed_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
        num_hidden_layers=2,
    )
    gen = torch.Generator().manual_seed(n_experts * 10 + top_k)
    router = TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(n_experts, 16, generator=gen))
        # A large bias makes the bias-chosen set differ from the plain top-k of scores.
        router.e_score_correction_bias.copy_(torch.randn(n_experts, generator=gen))
    router = router.to(DEVICE)
    x = torch.randn(37, 16, generator=gen).to(DEVICE)
    logits = torch.nn.functional.linear(x, router.weight)
    bias = router.e_score_correction_bias

    w, ids = topk_routing(logits, bias, top_k, norm, 2.5)
    w_ref, ids_ref = topk_routing_torch(logits, bias, top_k, norm, 2.5)
    with torch.no_grad():
        w_model, ids_model = router(x)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (37, top_k)
    torch.testing.assert_close(ids, ids_ref, atol=0, rtol=0)  # both in descending score + bias order
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
    w_model, ids_model = _sorted_by_id(w_model, ids_model)
    w_ref, ids_ref = _sorted_by_id(w_ref, ids_ref)
    torch.testing.assert_close(ids_ref, ids_model, atol=0, rtol=0)
    torch.testing.assert_close(w_ref, w_model, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_tokens", [1, 7, 33])
def test_fused_moe(n_tokens):
    n_experts, hidden, inter, top_k = 6, 16, 8, 2
    cfg = MiMoV2FlashConfig(
        hidden_size=hidden,
        n_routed_experts=n_experts,
        moe_intermediate_size=inter,
        num_experts_per_tok=top_k,
        num_hidden_layers=2,
    )
    gen = torch.Generator().manual_seed(n_tokens)
    experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(n_experts, 2 * inter, hidden, generator=gen) * 0.3)
        experts.down_proj.copy_(torch.randn(n_experts, hidden, inter, generator=gen) * 0.3)
    experts = experts.to(DEVICE)
    x = torch.randn(n_tokens, hidden, generator=gen).to(DEVICE)
    # Only experts 0, 2, 3, 5 are used: 1 and 4 get no rows (their blocks must not exist or write anything).
    live = torch.tensor([0, 2, 3, 5])
    ids = torch.stack([live[torch.randperm(4, generator=gen)[:top_k]] for _ in range(n_tokens)]).to(DEVICE)
    weights = torch.rand(n_tokens, top_k, generator=gen).to(DEVICE)

    out = fused_moe(x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    ref = fused_moe_torch(x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    with torch.no_grad():
        model = moe_reference(x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref, model, atol=1e-5, rtol=1e-5)
    assert out.abs().max() > 0.1  # a real signal, not two matching zero tensors

    # The alignment the GEMMs rely on: every row once, every block of one expert, unused experts absent.
    sorted_rows, block_expert, counts = align_by_expert(ids, n_experts, 16)
    real = sorted_rows[sorted_rows < n_tokens * top_k].long()
    assert sorted(real.tolist()) == list(range(n_tokens * top_k))
    row_expert = ids.reshape(-1)[sorted_rows.clamp(max=n_tokens * top_k - 1).long()].view(-1, 16)
    row_real = (sorted_rows < n_tokens * top_k).view(-1, 16)
    for blk, e in enumerate(block_expert.tolist()):
        assert (row_expert[blk][row_real[blk]] == e).all()
        assert e not in (1, 4)
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=n_experts).tolist()


def test_rejects_bad_shapes():
    k_cache, v_cache, table, lens, sinks, _ = _paged_batch([3, 5], seed=3)
    q = torch.zeros(2, HQ, D, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        decode_attention(torch.zeros(2, HQ, D + 1, device=DEVICE), k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention_torch(torch.zeros(2, HQ + 1, D, device=DEVICE), k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        decode_attention(q, k_cache, v_cache, table, lens.long(), 1.0)
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(q, k_cache, v_cache, table, lens, 1.0, sinks=sinks[:2])
    with pytest.raises(ValueError, match="q_starts"):
        extend_attention(q, k_cache, v_cache, table, lens, torch.tensor([0, 2], dtype=torch.int32, device=DEVICE), 1.0)
    logits = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        topk_routing(logits, torch.zeros(8, device=DEVICE), 9, True, 1.0)
    with pytest.raises(ValueError, match="correction_bias"):
        topk_routing_torch(logits, torch.zeros(7, device=DEVICE), 2, True, 1.0)
    x = torch.zeros(3, 16, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="w_down"):
        fused_moe(
            x,
            torch.zeros(4, 16, 16, device=DEVICE),
            torch.zeros(4, 16, 7, device=DEVICE),
            torch.zeros(3, 2, device=DEVICE),
            ids,
        )


def test_triton_enabled(monkeypatch):
    monkeypatch.delenv("MIMO_EPD_LLM_KERNELS", raising=False)
    assert triton_enabled("cpu") is False
    assert triton_enabled(torch.device("cuda", 0)) is True
    monkeypatch.setenv("MIMO_EPD_LLM_KERNELS", "triton")
    assert triton_enabled("cpu") is True
    monkeypatch.setenv("MIMO_EPD_LLM_KERNELS", "torch")
    assert triton_enabled("cuda") is False


def test_half_precision():
    """fp16 in, fp16 out, fp32 softmax / accumulation inside. (bf16 is not checked here: Triton's CPU
    interpreter mis-evaluates bf16 tl.dot, so bf16 needs a GPU run.)"""
    kv_lens = [1, 19, 70]
    k_cache, v_cache, table, lens, sinks, gen = _paged_batch(kv_lens, seed=4)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    q = torch.randn(len(kv_lens), HQ, D, generator=gen).to(DEVICE).half()
    out = decode_attention(q, k_cache, v_cache, table, lens, 0.2, WINDOW, sinks)
    ref = decode_attention_torch(q, k_cache, v_cache, table, lens, 0.2, WINDOW, sinks)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)

    q_starts = torch.tensor([0, 1, 11, 41], dtype=torch.int32, device=DEVICE)
    qx = torch.randn(41, HQ, D, generator=gen).to(DEVICE).half()
    out = extend_attention(qx, k_cache, v_cache, table, lens, q_starts, 0.2, None, sinks)
    ref = extend_attention_torch(qx, k_cache, v_cache, table, lens, q_starts, 0.2, None, sinks)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)

    x = torch.randn(9, 16, generator=gen).to(DEVICE).half()
    w_gate_up = (torch.randn(4, 16, 16, generator=gen) * 0.3).to(DEVICE).half()
    w_down = (torch.randn(4, 16, 8, generator=gen) * 0.3).to(DEVICE).half()
    ids = torch.randint(0, 4, (9, 2), generator=gen).to(DEVICE)
    weights = torch.rand(9, 2, generator=gen).to(DEVICE)
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    ref = fused_moe_torch(x, w_gate_up, w_down, weights, ids)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


def test_real_head_dims_and_key_blocks():
    """MiMo's head dims (q/k 192 -> a masked 256 block, v 128) with the key block sized for them (32 keys in
    fp32): decode and extend cross several key blocks, with a window and sinks."""
    from llm_backend.kernels.attention import _blocks

    assert _blocks(192, 128, torch.float32)["BLOCK_N"] == 32 and _blocks(192, 128, torch.bfloat16)["BLOCK_N"] == 64
    gen = torch.Generator().manual_seed(7)
    d, dv, hkv, rep, slots = 192, 128, 1, 2, 160
    k_cache = torch.randn(slots, hkv, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(slots, hkv, dv, generator=gen).to(DEVICE)
    table = torch.randperm(slots, generator=gen)[:140].view(2, 70).to(torch.int32).to(DEVICE)
    lens = torch.tensor([70, 45], dtype=torch.int32, device=DEVICE)
    sinks = torch.randn(hkv * rep, generator=gen).to(DEVICE)
    scale = d**-0.5
    q = torch.randn(2, hkv * rep, d, generator=gen).to(DEVICE)
    for window in (None, 41):
        torch.testing.assert_close(
            decode_attention(q, k_cache, v_cache, table, lens, scale, window, sinks),
            decode_attention_torch(q, k_cache, v_cache, table, lens, scale, window, sinks),
            atol=1e-5,
            rtol=1e-5,
        )
    q_starts = torch.tensor([0, 37, 40], dtype=torch.int32, device=DEVICE)  # 37 new of 70, 3 new of 45
    qx = torch.randn(40, hkv * rep, d, generator=gen).to(DEVICE)
    torch.testing.assert_close(
        extend_attention(qx, k_cache, v_cache, table, lens, q_starts, scale, 41, sinks),
        extend_attention_torch(qx, k_cache, v_cache, table, lens, q_starts, scale, 41, sinks),
        atol=1e-5,
        rtol=1e-5,
    )
