"""MiMo-V2-Flash parity with transformers' `mimo_v2_flash` (fp32, logits within 1e-4).

Tiny random configs saved by transformers, loaded through `load_llm`; prompts shorter than the window
and ten times longer; incremental decoding through a KV store; greedy continuations."""

import pytest
import torch

from llm_backend.models import ContiguousKV, load_llm

transformers = pytest.importorskip("transformers")
from transformers import MiMoV2FlashConfig as HFConfig  # noqa: E402
from transformers import MiMoV2FlashForCausalLM as HFModel  # noqa: E402

TOL = 1e-4
CONFIGS = {
    "w4-kv1": dict(sliding_window_size=4, num_key_value_heads=1, num_hidden_layers=6),
    "w8-kv2": dict(sliding_window_size=8, num_key_value_heads=2, num_hidden_layers=7),
    "w16-kv1-groups": dict(sliding_window_size=16, num_key_value_heads=1, num_hidden_layers=6, n_group=2, topk_group=1),
}


def hf_model(kw, tmp_path, seed=0):
    torch.manual_seed(seed)
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        head_dim=24,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        attention_value_scale=0.7,
        tie_word_embeddings=False,
    )
    base.update(kw)
    cfg = HFConfig(**base)
    model = HFModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if "sinks" in name else 0.08)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.05)
    model.save_pretrained(tmp_path)
    return model


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = hf_model(CONFIGS[request.param], d)
    return hf, load_llm(str(d))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].float()


@pytest.mark.parametrize("length", ["short", "long"])
def test_prefill_logits_match(pair, length):
    hf, ours = pair
    w = ours.config.window
    n = max(2, w - 1) if length == "short" else 10 * w + 3
    ids = torch.randint(0, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    ref = hf_logits(hf, ids)
    out = ours(ids, torch.arange(n), ContiguousKV(ours.config))
    assert (out - ref).abs().max().item() <= TOL


def test_chunked_and_incremental_equal_one_pass(pair):
    hf, ours = pair
    w = ours.config.window
    n = 5 * w + 2
    ids = torch.randint(0, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(7))
    ref = hf_logits(hf, ids)
    for chunk in (max(1, w - 1), w + 3):  # chunk < window and > window
        kv = ContiguousKV(ours.config)
        outs = [ours(ids[s : s + chunk], torch.arange(s, min(n, s + chunk)), kv) for s in range(0, n, chunk)]
        assert (torch.cat(outs) - ref).abs().max().item() <= TOL


def test_greedy_decoding_five_windows_past_the_prompt(pair):
    hf, ours = pair
    w = ours.config.window
    prompt = torch.randint(0, ours.config.vocab_size, (w + 2,), generator=torch.Generator().manual_seed(3))
    steps = 5 * w
    with torch.no_grad():
        ref = hf.generate(
            prompt[None], max_new_tokens=steps, do_sample=False, min_new_tokens=steps, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :]
    kv = ContiguousKV(ours.config)
    logits = ours(prompt, torch.arange(len(prompt)), kv, logits_for="last")
    got = []
    for i in range(steps):
        tok = int(logits[-1].argmax())
        got.append(tok)
        logits = ours(torch.tensor([tok]), torch.tensor([len(prompt) + i]), kv, logits_for="last")
    assert got == ref.tolist()


def test_tiny_random_loads_into_transformers():
    ours = load_llm("tiny-random")
    cfg = HFConfig(**{k: v for k, v in ours.config.to_hf_dict().items() if k != "model_type"})
    hf = HFModel(cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not [m for m in missing if "e_score_correction_bias" not in m] and not unexpected
    hf.load_state_dict(
        {
            **hf.state_dict(),
            **ours.state_dict(),
            **{k: v for k, v in ours.named_buffers() if "e_score_correction_bias" in k},
        }
    )
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    assert (ours(ids, torch.arange(40), ContiguousKV(ours.config)) - hf_logits(hf, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("page,chunk_vs_window", [(1, "smaller"), (4, "larger"), (16, "smaller")])
def test_engine_prompt_logprobs_and_mixed_batch_match_transformers(pair, page, chunk_vs_window):
    """Through the serving engine (dual pools, radix cache, chunked prefill, a batch of mixed lengths)."""
    from llm_backend import LLM, SamplingParams

    hf, ours = pair
    w = ours.config.window
    chunk = max(1, w - 1) if chunk_vs_window == "smaller" else w + 3
    gen = torch.Generator().manual_seed(page)
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (w - 1, 10 * w, 3)]
    llm = LLM(ours, page_size=page, chunk_size=chunk, kv_cache_tokens=4096, swa_cache_tokens=1024)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))
    for p, o in zip(prompts, outs):
        lp = torch.log_softmax(hf_logits(hf, torch.tensor(p)), dim=-1)
        want = [lp[j, p[j + 1]].item() for j in range(len(p) - 1)]
        got = o.prompt_logprobs[1:]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want)) <= TOL if want else True
        assert o.output_token_ids == [int(lp[-1].argmax())]
