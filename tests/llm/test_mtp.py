"""The MTP layers and the training forward (llm_backend/models/mimo_v2_flash_mtp.py, models/dense.py): the batch
attention used for training equals the engine's paged attention, for the main layers and for every MTP layer, on
sequences longer than the window; the MTP weights load from and save to MiMo's release names."""

from __future__ import annotations

import torch

from llm_backend.models import ContiguousKV, MiMoV2FlashConfig, MiMoV2FlashForCausalLM, init_random_weights
from llm_backend.models.dense import causal_attention, main_hidden, mtp_hidden
from llm_backend.models.mimo_v2_flash import SeqInput

CFG = MiMoV2FlashConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    v_head_dim=8,
    sliding_window=9,  # window 8
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    n_routed_experts=4,
    num_nextn_predict_layers=3,
)


def _model(seed=0):
    model = MiMoV2FlashForCausalLM(CFG)
    init_random_weights(model, seed, std=0.1)
    return model.eval()


def test_the_mtp_layers_have_the_release_names():
    names = {k for k in _model().state_dict() if k.startswith("model.mtp.")}
    expected = {
        f"model.mtp.layers.{i}.{p}"
        for i in range(3)
        for p in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.sinks",
            "pre_mlp_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "final_layernorm.weight",
        )
    }
    assert names == expected
    assert _model().model.mtp.layers[0].eh_proj.weight.shape == (64, 128)


def test_batch_attention_equals_a_loop_over_queries():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, 11, 4, 6, generator=g),
        torch.randn(2, 11, 2, 6, generator=g),
        torch.randn(2, 11, 2, 5, generator=g),
    )
    sinks = torch.randn(4, generator=g)
    out = causal_attention(q, k, v, 0.3, 4, sinks)
    for b in range(2):
        for i in range(11):
            for h in range(4):
                lo = max(0, i - 3)
                s = (k[b, lo : i + 1, h // 2] @ q[b, i, h]) * 0.3
                p = torch.softmax(torch.cat([s, sinks[h : h + 1]]), 0)[:-1]
                torch.testing.assert_close(out[b, i, h], p @ v[b, lo : i + 1, h // 2], atol=1e-5, rtol=1e-5)


def test_training_forward_equals_the_paged_path_for_the_main_model_and_every_mtp_layer():
    model = _model()
    n = 3 * CFG.window + 5
    ids = torch.randint(0, CFG.vocab_size, (2, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden, _ = main_hidden(model, ids)
        chain = [hidden]
        for k in range(3):
            # MTP layer k+1 at position t reads the embedding of token t+k+1 (the last k+1 positions have none).
            nxt = torch.roll(ids, -(k + 1), dims=1)
            chain.append(mtp_hidden(model, k, model.model.embed_tokens(nxt), chain[-1]))
    for b in range(2):
        kv = ContiguousKV(CFG)
        pos = torch.arange(n)
        with torch.inference_mode():
            paged, _ = model.hidden_states([SeqInput(ids[b], pos, None)], kv.step(0, n))
        torch.testing.assert_close(paged, hidden[b], atol=1e-5, rtol=1e-5)
        mtp = model.model.mtp
        mkv = ContiguousKV(mtp.kv_config())
        prev = paged
        for k in range(3):
            emb = model.model.embed_tokens(torch.roll(ids[b], -(k + 1)))
            # One prefill of the first half, then token by token: the paged MTP KV is reused across steps.
            half = n // 2
            with torch.inference_mode():
                if k == 0:
                    outs = [mtp.step(k, emb[:half], prev[:half], pos[:half], mkv.step(0, half))]
                    outs += [
                        mtp.step(k, emb[t : t + 1], prev[t : t + 1], pos[t : t + 1], mkv.step(t, 1))
                        for t in range(half, n)
                    ]
                    out = torch.cat(outs)
                else:
                    kvk = ContiguousKV(mtp.kv_config())
                    out = mtp.step(k, emb, prev, pos, kvk.step(0, n))
            torch.testing.assert_close(out, chain[k + 1][b], atol=1e-5, rtol=1e-5)
            prev = out
