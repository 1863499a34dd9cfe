"""Sampling controls that change a request's logits before it samples, with vLLM's meaning:

- `presence_penalty` p: every token generated so far loses p (once, however often it appeared);
- `frequency_penalty` f: every token generated so far loses f times its count;
- `repetition_penalty` r: every token of the prompt or generated so far has its logit divided by r when positive,
  multiplied by r when negative (the CTRL rule, transformers' and vLLM's);
- `logit_bias`: token id -> a bias added to its logit;
- `min_tokens` m: the request's stop tokens (EOS unless ignore_eos, and stop_token_ids) are masked out until m
  tokens were generated.

Order (vLLM's): logit bias and min_tokens first, then repetition, frequency, presence.

State per request (`RequestPenalties`, kept here keyed by the request object, gone with it): the generated
tokens' counts and the prompt's token mask as device tensors of the vocabulary's size, brought up to date with the
tokens appended since the last step (O(new tokens) per step, never O(context)). The adjusted row is what sampling,
greedy choice, logprobs' `top` and speculative verification see; a verifier adjusts row i as if drafts 1..i-1 were
appended (`extra`), so MTP speculation stays lossless under the same distribution. Grammar masks compose: a token
a grammar forbids is -inf before and after.
"""

from __future__ import annotations

import weakref

import torch

from .request import Request, SamplingParams


def needs_adjusting(p: SamplingParams) -> bool:
    return bool(
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias or p.min_tokens
    )


class RequestPenalties:
    """One request's counts of generated tokens and mask of prompt tokens, on the logits' device."""

    def __init__(self, r: Request, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = [t for t in r.prompt if 0 <= t < vocab]  # media placeholders are not tokens
        if ids:
            self.seen_prompt[torch.tensor(ids, device=device)] = True
        self.synced = 0  # r.output[:synced] are counted
        p = r.params
        self.bias = None
        if p.logit_bias:
            self.bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            idx = torch.tensor([t for t, _ in p.logit_bias], device=device)
            self.bias[idx] = torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32, device=device)

    def sync(self, r: Request) -> None:
        new = [t for t in r.output[self.synced :] if 0 <= t < self.vocab]
        if new:
            self.counts.index_add_(0, torch.tensor(new, device=self.device), torch.ones(len(new), device=self.device))
        self.synced = len(r.output)

    def adjust(self, r: Request, row: torch.Tensor, extra: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
        """`row` (1-D logits) adjusted for r as if `extra` tokens were appended after its output."""
        p = r.params
        row = row.float().clone()
        counts = self.counts
        if extra:
            counts = counts.clone()
            counts.index_add_(
                0, torch.tensor(list(extra), device=self.device), torch.ones(len(extra), device=self.device)
            )
        v = min(self.vocab, row.shape[-1])
        if self.bias is not None:  # vLLM's order: logit bias and min_tokens first, then the penalties
            row[:v] += self.bias[:v]
        if p.min_tokens and len(r.output) + len(extra) < p.min_tokens:
            stops = [t for t in r.stop_ids if 0 <= t < row.shape[-1]]
            if stops:
                row[torch.tensor(stops, device=row.device)] = float("-inf")
        head = row[:v]
        if p.repetition_penalty != 1.0:
            seen = self.seen_prompt[:v] | (counts[:v] > 0)
            penalised = torch.where(head > 0, head / p.repetition_penalty, head * p.repetition_penalty)
            head = torch.where(seen, penalised, head)
        if p.frequency_penalty:
            head = head - p.frequency_penalty * counts[:v]
        if p.presence_penalty:
            head = head - p.presence_penalty * (counts[:v] > 0).float()
        row[:v] = head
        return row


class Penalties:
    """The engine's sampling controls for every request that uses them (module docstring), keyed by request."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.state: weakref.WeakKeyDictionary[Request, RequestPenalties] = weakref.WeakKeyDictionary()

    def adjust(self, r: Request, row: torch.Tensor, extra: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
        """r's row adjusted (unchanged when r asks for no control)."""
        if not needs_adjusting(r.params):
            return row
        st = self.state.get(r)
        if st is None:
            st = self.state[r] = RequestPenalties(r, self.vocab, row.device)
        st.sync(r)
        return st.adjust(r, row, extra)
