"""The offline engine on the dual pools + SWA radix cache gives the reference model's outputs."""

from __future__ import annotations

import random

import pytest
import torch

from llm_backend import LLM, SamplingParams
from llm_backend.models import ContiguousKV, MiMoV2FlashConfig, MiMoV2FlashForCausalLM, init_random_weights


def small_model(window: int, kv_heads: int, seed: int = 0) -> MiMoV2FlashForCausalLM:
    cfg = MiMoV2FlashConfig(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        v_head_dim=8,
        sliding_window=window + 1,
        moe_intermediate_size=24,
        num_experts_per_tok=2,
        n_routed_experts=4,
    )
    m = MiMoV2FlashForCausalLM(cfg)
    init_random_weights(m, seed, std=0.2)
    return m.eval()


def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    kv = ContiguousKV(model.config)
    logits = model(torch.tensor(prompt), torch.arange(len(prompt)), kv, logits_for="last")
    out = []
    for i in range(steps):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = model(torch.tensor([tok]), torch.tensor([len(prompt) + i]), kv, logits_for="last")
    return out


@pytest.mark.parametrize("window,kv_heads,page,chunk", [(4, 1, 1, 3), (8, 2, 4, 20), (16, 1, 16, 7)])
def test_engine_equals_reference_model(window, kv_heads, page, chunk):
    model = small_model(window, kv_heads)
    rng = random.Random(window)
    prompts = [[rng.randrange(61) for _ in range(n)] for n in (window - 1, 10 * window, 3 * window + 1)]
    steps = 10 * window  # ten windows of decoding
    llm = LLM(model, kv_cache_tokens=4096, swa_cache_tokens=1024, page_size=page, chunk_size=chunk, release_interval=4)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=steps))
    for p, o in zip(prompts, outs):
        assert o.output_token_ids == reference_greedy(model, p, steps)
        assert o.usage.completion_tokens == steps and o.finish_reason == "length"
    assert llm.peak_swa_per_request <= window + chunk + 4 + 1  # W + chunk + release interval


def test_shared_prefix_is_cached_and_gives_the_cold_output():
    model = small_model(8, 1)
    system = list(range(1, 41))
    llm = LLM(model, kv_cache_tokens=4096, swa_cache_tokens=1024, chunk_size=16)
    first = llm.generate(prompt_token_ids=[system + [5, 6]], sampling_params=SamplingParams(max_tokens=6))[0]
    second = llm.generate(prompt_token_ids=[system + [7, 8, 9]], sampling_params=SamplingParams(max_tokens=6))[0]
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens >= 40
    cold = LLM(model, enable_prefix_cache=False).generate(
        prompt_token_ids=[system + [7, 8, 9]], sampling_params=SamplingParams(max_tokens=6)
    )[0]
    assert second.output_token_ids == cold.output_token_ids


@pytest.mark.parametrize("page", [1, 4])
def test_no_pseudo_hits_under_heavy_eviction(page):
    """200 randomized requests over shared prefixes with a tiny SWA pool: outputs with the cache equal
    outputs without it (paged full pool of page size 1 and 4)."""
    model = small_model(4, 1, seed=3)
    rng = random.Random(0)
    bases = [[rng.randrange(61) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    prompts = [
        rng.choice(bases)[: rng.randrange(1, 30)] + [rng.randrange(61) for _ in range(rng.randrange(0, 6))]
        for _ in range(200)
    ]
    prompts = [p or [1] for p in prompts]
    params = SamplingParams(max_tokens=4)
    cached = LLM(model, kv_cache_tokens=600, swa_cache_tokens=64, chunk_size=8, max_running=4, page_size=page)
    plain = LLM(model, kv_cache_tokens=600, swa_cache_tokens=64, chunk_size=8, max_running=4, enable_prefix_cache=False)
    got, want = [], []
    for i in range(0, 200, 20):  # in waves, so later waves hit what earlier ones cached
        got += cached.generate(prompt_token_ids=prompts[i : i + 20], sampling_params=params)
        want += plain.generate(prompt_token_ids=prompts[i : i + 20], sampling_params=params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert sum(o.usage.cached_tokens for o in got) > 0
    assert cached.cache.stats.swa_evicted > 0 or cached.cache.stats.full_evicted > 0


def test_sampling_params_logprobs_and_text():
    llm = LLM("tiny-random", chunk_size=32)
    p = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, top_k=20, seed=7, logprobs=True, prompt_logprobs=True)
    a = llm.generate(["hi there"], p)[0]
    b = LLM("tiny-random").generate(["hi there"], p)[0]
    assert a.output_token_ids == b.output_token_ids  # seeded
    assert len(a.logprobs) == 5 and all(lp <= 0 for lp in a.logprobs)
    assert len(a.prompt_logprobs) == len(a.prompt_token_ids) and a.prompt_logprobs[0] is None
    assert isinstance(a.text, str)
    stop = llm.generate(["hi"], SamplingParams(max_tokens=50, stop_token_ids=tuple(range(320))))[0]
    assert len(stop.output_token_ids) == 1 and stop.finish_reason == "stop"
    with pytest.raises(ValueError):
        llm.generate(["x"], SamplingParams(max_tokens=0))


@pytest.mark.parametrize("buckets,long_position", [((20,), "early"), ((), "last")])
def test_length_buckets_keep_long_requests_from_waiting_behind_short_ones(buckets, long_position):
    model = small_model(8, 1)
    llm = LLM(model, max_running=1, length_buckets=buckets, wait_penalty_tokens_per_s=0.0, chunk_size=64)
    long = llm.add_request(list(range(1, 51)), SamplingParams(max_tokens=1))
    shorts = [llm.add_request([1, 2, 3, 4, i], SamplingParams(max_tokens=1)) for i in range(6)]
    while llm.has_work():
        llm.step()
    pos = llm.admitted.index(long.id)
    if long_position == "early":
        assert pos <= 1  # its bucket gets a turn right away
    else:
        assert pos == len(shorts)  # uncached-tokens-first alone puts it behind every short request


def test_fcfs_order():
    llm = LLM(small_model(8, 1), max_running=1, fcfs=True)
    ids = [llm.add_request(list(range(1, n)), SamplingParams(max_tokens=1)).id for n in (40, 5, 20)]
    while llm.has_work():
        llm.step()
    assert llm.admitted == ids


def test_checkpoint_tokenizer_json_is_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from llm_backend.engine import ByteTokenizer, HFTokenizer, load_tokenizer

    tok = Tokenizer(models.WordLevel({"hello": 5, "world": 7, "[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path))
    assert isinstance(t, HFTokenizer) and t.encode("hello world") == [5, 7] and t.decode([5, 7]) == "hello world"
    assert isinstance(load_tokenizer("tiny-random"), ByteTokenizer)
    assert isinstance(load_tokenizer("tiny"), HFTokenizer)  # the shipped checkpoint's tokenizer.json


@pytest.mark.parametrize("window,kv_heads,page,chunk", [(4, 1, 1, 5), (8, 2, 4, 20)])
def test_engine_on_triton_kernels_equals_reference_model(monkeypatch, window, kv_heads, page, chunk):
    """The CUDA code path (paged decode/extend attention, fused routing, grouped expert GEMM), run by Triton's
    interpreter on the CPU: a mixed batch of prefill chunks (with cached prefixes) and decode tokens crossing
    several windows gives the reference model's greedy tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MIMO_EPD_LLM_KERNELS", "triton")
    model = small_model(window, kv_heads, seed=1)
    rng = random.Random(window + 100)
    shared = [rng.randrange(61) for _ in range(2 * window + 3)]
    prompts = [shared + [rng.randrange(61) for _ in range(n)] for n in (1, 3 * window)] + [[5, 6, 7]]
    steps = 2 * window + 1
    llm = LLM(model, kv_cache_tokens=2048, swa_cache_tokens=512, page_size=page, chunk_size=chunk, release_interval=4)
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=steps))
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=SamplingParams(max_tokens=steps))
    assert rest[0].usage.cached_tokens > 0  # the second prompt extended a cached prefix through the extend kernel
    for p, o in zip(prompts, first + rest):
        assert o.output_token_ids == reference_greedy(model, p, steps)


def test_an_swa_pool_too_small_for_the_running_requests_is_logged(caplog):
    """A pool that passes the one-request check but cannot hold --max-running windows plus a chunk starts, and
    says that prompt chunks will preempt."""
    model = small_model(8, 1)
    with caplog.at_level("WARNING", logger="llm_backend.engine.llm"):
        LLM(model, swa_cache_tokens=100, chunk_size=16, max_running=16, release_interval=4)
    assert any("preempts a younger request" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="llm_backend.engine.llm"):
        LLM(model, swa_cache_tokens=400, chunk_size=16, max_running=16, release_interval=4)
    assert not any("preempts" in r.getMessage() for r in caplog.records)
