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
