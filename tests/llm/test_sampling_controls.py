"""Sampling controls (engine/penalties.py) against transformers' logits processors on the shipped `tiny` model,
greedy: repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor), logit_bias (its sequence_bias on
single tokens), min_tokens (its min_new_tokens); presence and frequency penalties (no transformers processor: a
reference processor written out below, vLLM's formula) — each alone, token for token. Then the same controls
under MTP speculation (lossless: the verifier adjusts each draft row) and their validation by field."""

from __future__ import annotations

import pytest
import torch

from llm_backend import LLM, SamplingParams
from llm_backend.tokenizer import load_tokenizer
from tests.llm.test_tiny_model import hf_tiny

N = 24
PROMPTS = ["The json module can serialize Python objects. The json module", "1 2 3 4 5 6"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return hf_tiny(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


@pytest.fixture(scope="module")
def ids():
    tok = load_tokenizer("tiny")
    return [tok.encode(p) for p in PROMPTS]


class PresenceFrequency:
    """vLLM's presence / frequency penalties over the generated tokens, one position at a time."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.n, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for b in range(input_ids.shape[0]):
            counts: dict[int, int] = {}
            for t in input_ids[b, self.n :].tolist():
                counts[t] = counts.get(t, 0) + 1
            for t, c in counts.items():
                out[b, t] -= self.frequency * c + self.presence
        return out


def hf_greedy(hf, ids, eos=None, **kw):
    from transformers import LogitsProcessorList

    procs = kw.pop("processors", [])
    x = torch.tensor([ids])
    with torch.no_grad():
        y = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=eos,
            logits_processor=LogitsProcessorList(procs),
            **kw,
        )
    return y[0, len(ids) :].tolist()


def ours(llm, ids, **kw):
    sp = SamplingParams(max_tokens=N, ignore_eos=kw.pop("ignore_eos", True), **kw)
    return llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0].output_token_ids


@pytest.mark.parametrize("k", [0, 1])
def test_each_control_equals_transformers(hf, llm, ids, k):
    p = ids[k]
    plain = ours(llm, p)
    assert plain == hf_greedy(hf, p)
    rep = ours(llm, p, repetition_penalty=3.0)
    assert rep == hf_greedy(hf, p, repetition_penalty=3.0) and rep != plain
    top = plain[0]
    biased = ours(llm, p, logit_bias=((top, -30.0), (p[-1], 5.0)))
    assert biased == hf_greedy(hf, p, sequence_bias={(top,): -30.0, (p[-1],): 5.0}) and biased[0] != top
    pf = ours(llm, p, presence_penalty=2.0, frequency_penalty=2.0)
    assert pf == hf_greedy(hf, p, processors=[PresenceFrequency(len(p), 2.0, 2.0)]) and pf != plain


def test_min_tokens_masks_the_stop_tokens(hf, llm, ids):
    """With EOS as a stop token, the model stops early; min_tokens holds it back until then."""
    eos = llm.tokenizer.eos_token_id
    p = ids[1]
    free = ours(llm, p, logit_bias=((eos, 8.0),), ignore_eos=False)  # EOS made likely: it stops at once
    assert free[-1] == eos and len(free) < 5
    held = ours(llm, p, logit_bias=((eos, 8.0),), ignore_eos=False, min_tokens=10)
    want = hf_greedy(hf, p, eos=eos, sequence_bias={(eos,): 8.0}, min_new_tokens=10)
    assert held == want[: len(held)] and len(held) >= 10 and eos not in held[:10]


def test_controls_under_speculation_are_lossless(ids):
    """MTP speculation with the controls: each draft row is adjusted as if the accepted drafts were appended, so
    greedy outputs equal plain decoding's with the same controls, and drafts are still accepted."""
    kw = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((ids[0][1], 2.0),))
    plain = LLM("tiny")
    spec = LLM("tiny", speculative_steps=3, speculative_auto=False)
    for p in ids:
        assert ours(spec, p, **kw) == ours(plain, p, **kw)
    assert spec.stats()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias=((1, 101.0),)), "logit_bias"),
        (dict(logit_bias=((10**9, 1.0),)), "logit_bias"),
        (dict(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias"),
        (dict(min_tokens=30), "min_tokens"),
    ],
)
def test_bad_controls_are_refused_by_field(llm, ids, kw, field):
    with pytest.raises(ValueError, match=field):
        llm.add_request(ids[0], SamplingParams(max_tokens=N, **kw))
