"""A request can never take the engine down: bad floats are refused, a sequence that can no longer grow
finishes instead of spinning, and a failing forward fails only its own step's requests."""

from __future__ import annotations

import math

import pytest
import torch

from llm_backend import LLM, PromptTooLong, SamplingParams
from tests.llm.test_engine import small_model


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -1.0),
        ("top_p", math.nan),
        ("top_p", 0.0),
        ("top_k", -1),
        ("max_tokens", 0),
        ("temperature", 1e9),
        ("seed", -5),
        ("top_logprobs", 99),
    ],
)
def test_bad_sampling_numbers_are_refused_with_the_field_named(field, value):
    llm = LLM(small_model(4, 1))
    with pytest.raises(ValueError, match=field):
        llm.add_request([1, 2, 3], SamplingParams(**{field: value}))
    assert not llm.has_work()


def test_tiny_temperature_is_greedy_not_nan():
    llm = LLM(small_model(4, 1))
    greedy = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=6))[0]
    tiny = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=6, temperature=1e-300))[
        0
    ]
    assert tiny.output_token_ids == greedy.output_token_ids and tiny.finish_reason == "length"


def test_huge_max_tokens_ends_at_the_pool_capacity_without_spinning():
    llm = LLM(small_model(4, 1), kv_cache_tokens=48, swa_cache_tokens=40, chunk_size=8, release_interval=4)
    r = llm.add_request([1, 2, 3], SamplingParams(max_tokens=2**31 - 1))
    steps = 0
    while llm.has_work():
        llm.step()
        steps += 1
        assert steps < 500, "the engine spins"
    assert r.finish_reason == "length" and len(r.tokens) == llm.max_model_len
    assert llm.full_pool.available() + llm.cache.accounting().full.evictable == llm.full_pool.size


def test_long_requests_competing_for_a_small_pool_all_finish():
    llm = LLM(
        small_model(4, 1), kv_cache_tokens=40, swa_cache_tokens=40, chunk_size=8, release_interval=4, max_running=3
    )
    reqs = [llm.add_request([1 + i, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True)) for i in range(3)]
    steps = 0
    while llm.has_work():
        llm.step()
        steps += 1
        assert steps < 1000, "the engine spins"
    assert all(r.finish_reason == "length" for r in reqs)


def test_prompt_that_can_never_fit_is_refused_with_the_numbers():
    llm = LLM(small_model(4, 1), kv_cache_tokens=64, swa_cache_tokens=64, chunk_size=8, release_interval=4)
    with pytest.raises(PromptTooLong, match="64"):
        llm.add_request(list(range(1, 61)) * 2, SamplingParams())


def test_a_failing_forward_fails_only_that_step_and_the_engine_goes_on(monkeypatch):
    llm = LLM(small_model(4, 1))
    real = llm.runner.execute
    calls = {"n": 0}

    def flaky(segments):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(segments)

    monkeypatch.setattr(llm.runner, "execute", flaky)
    bad = llm.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    llm.step()
    assert bad.finish_reason == "error" and "boom" in bad.error and bad.error_code == "internal"
    good = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=SamplingParams(max_tokens=3))[0]
    assert good.finish_reason == "length" and len(good.output_token_ids) == 3
    assert llm.full_pool.available() + llm.cache.accounting().full.evictable == llm.full_pool.size


def test_non_finite_logits_fail_that_request_only(monkeypatch):
    llm = LLM(small_model(4, 1))
    from llm_backend.engine import runner as runner_mod

    real = runner_mod.sample

    def poisoned(logits, params, generator):
        if params.seed == 13:
            logits = torch.full_like(logits, float("nan"))
        return real(logits, params, generator)

    monkeypatch.setattr(runner_mod, "sample", poisoned)
    bad = llm.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.5, seed=13))
    ok = llm.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.5, seed=14))
    while llm.has_work():
        llm.step()
    assert bad.finish_reason == "error" and "non-finite" in bad.error
    assert ok.finish_reason == "length"


def test_eos_stops_unless_ignore_eos():
    llm = LLM("tiny-random")
    first = llm.generate(["abc"], SamplingParams(max_tokens=8))[0]
    eos = llm.tokenizer.eos_token_id
    # Make EOS the greedy choice by asking to stop at whatever the first token is, via stop_token_ids,
    # and check ignore_eos keeps going past the real EOS id.
    forced = llm.generate(["abc"], SamplingParams(max_tokens=4, stop_token_ids=(first.output_token_ids[0],)))[0]
    assert forced.finish_reason == "stop" and len(forced.output_token_ids) == 1
    r = llm.add_request(llm.tokenizer.encode("abc"), SamplingParams(max_tokens=5, ignore_eos=True))
    assert eos not in r.stop_ids
    r2 = llm.add_request(llm.tokenizer.encode("abc"), SamplingParams(max_tokens=5))
    assert eos in r2.stop_ids
    while llm.has_work():
        llm.step()
    assert r.finish_reason == "length" and len(r.output) == 5


def test_a_failing_admission_fails_that_request_and_the_engine_goes_on(monkeypatch):
    llm = LLM(small_model(4, 1))
    real = llm.scheduler._admit
    calls = {"n": 0}

    def flaky(r):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bookkeeping bug")
        return real(r)

    monkeypatch.setattr(llm.scheduler, "_admit", flaky)
    bad = llm.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    llm.step()
    assert bad.finish_reason == "error" and "bookkeeping bug" in bad.error and not llm.has_work()
    good = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=SamplingParams(max_tokens=3))[0]
    assert good.finish_reason == "length"


def test_nothing_running_never_refuses_a_request_the_trees_evictable_swa_makes_room_for():
    """The smallest SWA pool the engine accepts (window + chunk + release interval + 1), filled with the cached
    windows and checkpoints of earlier prompts: with nothing running, a new prompt that needs a whole chunk of SWA
    is admitted (the tree's unlocked SWA is evicted for it), never refused as "does not fit"."""
    model = small_model(8, 1)
    W, chunk, interval = 8, 16, 4
    llm = LLM(
        model,
        kv_cache_tokens=4000,
        swa_cache_tokens=W + chunk + interval + 1,
        chunk_size=chunk,
        release_interval=interval,
        page_size=4,
        swa_checkpoint_interval=16,
    )
    sp = SamplingParams(max_tokens=3)
    for i in range(12):
        prompt = [(i * 7 + j) % 61 for j in range(40 + i)]
        (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
        assert out.finish_reason == "length", (i, out.finish_reason)
        assert llm.cache.accounting().swa.evictable > 0  # the tree keeps SWA for the next request to evict
