"""Choosing the next token from one position's logits: greedy, or temperature + top-k + top-p (seeded when the
request has a generator), with the logprobs the request asked for."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .request import SamplingParams


class Sampled(NamedTuple):
    token: int
    logprob: float  # log-probability of the token under the model's distribution (temperature 1)
    top: list[tuple[int, float]]  # the top_logprobs most likely tokens and their logprobs


class SamplingError(RuntimeError):
    """The logits of one request cannot be sampled (non-finite values): that request fails, no other."""


def check_finite(logits: torch.Tensor) -> None:
    if not bool(torch.isfinite(logits).any()) or bool(torch.isnan(logits).any()):
        raise SamplingError("the model produced non-finite logits for this request")


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one position (not greedy): temperature, then top-k, then top-p."""
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < params.top_p
        keep[0] = True  # the most likely token always survives
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise SamplingError("the sampling distribution is degenerate for this request")
    return probs


def describe(logits: torch.Tensor, token: int, params: SamplingParams) -> Sampled:
    """`token` chosen at a position with these logits: its logprob under the model (temperature 1) and the top
    logprobs the request asked for."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if params.top_logprobs:
        values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return Sampled(token, float(logprobs[token]), top)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Sampled:
    logits = logits.float()
    check_finite(logits)
    if params.greedy:
        tok = int(torch.argmax(logits))
    else:
        tok = int(torch.multinomial(distribution(logits, params), 1, generator=generator))
    return describe(logits, tok, params)
