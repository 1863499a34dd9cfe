"""Media rows from the prefix cache (`add_request(media_span=...)`): a request whose media KV is cached runs without
the rows and generates what it generates with them; one whose cache entry is gone ends at once with MEDIA_NEEDED and
no token; a preempted one keeps its prefix pinned, so evicting everything meanwhile cannot strand it."""

from __future__ import annotations

import pytest
import torch

from llm_backend import LLM, SamplingParams
from llm_backend.engine import MEDIA_NEEDED

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _run(llm: LLM) -> None:
    while llm.has_work():
        llm.step()


@pytest.fixture(scope="module")
def turn():
    llm = LLM("tiny-random")
    cfg = llm.model.config
    g = torch.Generator().manual_seed(0)
    media = {3 + j: torch.randn(cfg.hidden_size, generator=g) * 0.05 for j in range(6)}
    p1 = [5, 6, 7] + [cfg.vocab_size + 100 + j for j in range(6)] + list(range(20, 44))
    r1 = llm.add_request(p1, GREEDY, media=dict(media))
    _run(llm)
    return llm, media, p1 + r1.output + [12, 13]


def test_a_cached_prefix_stands_in_for_the_rows(turn):
    llm, media, p2 = turn
    assert llm.cached_prefix_length(p2) >= 9
    want = llm.add_request(p2, GREEDY, media=dict(media))
    _run(llm)
    got = llm.add_request(p2, GREEDY, media_span=9)
    _run(llm)
    assert got.finish_reason == "length" and got.output == want.output and got.cached_tokens >= 9


def test_without_the_cache_entry_the_request_asks_for_its_rows(turn):
    _, _, p2 = turn
    cold = LLM("tiny-random")
    assert cold.cached_prefix_length(p2) == 0
    r = cold.add_request(p2, GREEDY, media_span=9)
    _run(cold)
    assert (r.finish_reason, r.error_code, r.output) == ("error", MEDIA_NEEDED, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):  # a placeholder past the span needs its row
        cold.add_request(p2, GREEDY, media_span=5)
    warm, _, _ = turn  # prompt_logprobs computes every position: it matches nothing and needs its rows too
    r = warm.add_request(p2, SamplingParams(max_tokens=2, prompt_logprobs=True), media_span=9)
    _run(warm)
    assert (r.error_code, r.output) == (MEDIA_NEEDED, [])


def test_a_preempted_request_keeps_its_media_prefix_pinned(turn):
    llm, media, p2 = turn
    want = llm.add_request(p2, GREEDY, media=dict(media))
    _run(llm)
    r = llm.add_request(p2, GREEDY, media_span=9)
    llm.step()  # admitted, its first tokens computed
    s = llm.scheduler
    assert r in s.running and not r.done
    s._preempt(r)
    assert r.id in s._pins
    llm.cache.evict_full(10**9)  # everything evictable goes; the pinned prefix cannot
    _run(llm)
    assert r.finish_reason == "length" and r.output == want.output and not s._pins


def _idle(llm: LLM) -> None:
    """No lock left (no pin, no request): every slot is free or evictable, and evicting frees them all."""
    acc = llm.cache.accounting()
    assert acc.full.protected == 0 and acc.swa.protected == 0, acc
    llm.cache.evict_full(10**9)
    llm.cache.evict_swa(10**9)
    assert llm.full_pool.available() == llm.full_pool.size and llm.swa_pool.available() == llm.swa_pool.size


def test_the_pools_come_back_idle_after_a_bounce_a_pin_and_an_abort():
    llm = LLM("tiny-random")
    cfg = llm.model.config
    media = {3 + j: torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(1)) for j in range(6)}
    p = [5, 6, 7] + [cfg.vocab_size + 200 + j for j in range(6)] + list(range(20, 44))
    llm.add_request(p, GREEDY, media=dict(media))
    _run(llm)
    r = llm.add_request(p + [50], GREEDY, media_span=9)  # admitted from the cache, then preempted: pinned
    llm.step()
    llm.scheduler._preempt(r)
    llm.abort(r)  # aborted while waiting with its pin
    _run(llm)
    assert r.done and not llm.scheduler._pins
    cold = llm.add_request([1] + p[1:], GREEDY, media_span=9)  # another first token: nothing cached, bounced
    _run(llm)
    assert cold.error_code == MEDIA_NEEDED
    _idle(llm)


def test_media_span_with_mtp_speculation_equals_the_rows():
    from tests.llm.test_speculative import CFG, MiMoV2FlashForCausalLM, engine, init_random_weights

    model = MiMoV2FlashForCausalLM(CFG)  # a model with MTP layers, random weights (test_speculative's)
    init_random_weights(model, 0)
    llm = engine(model.eval(), speculative_steps=2)
    cfg = llm.model.config
    media = {3 + j: torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.05 for j in range(6)}
    p1 = [5, 6, 7] + [cfg.vocab_size + 300 + j for j in range(6)] + list(range(20, 44))
    r1 = llm.add_request(p1, SamplingParams(max_tokens=12, ignore_eos=True), media=dict(media))
    _run(llm)
    p2 = p1 + r1.output + [12, 13]
    want = llm.add_request(p2, SamplingParams(max_tokens=12, ignore_eos=True), media=dict(media))
    _run(llm)
    got = llm.add_request(p2, SamplingParams(max_tokens=12, ignore_eos=True), media_span=9)
    _run(llm)
    assert got.finish_reason == "length" and got.output == want.output and got.cached_tokens >= 9
    assert got.stats.drafted_tokens > 0  # MTP drafted for the request that had no rows
    _idle(llm)
