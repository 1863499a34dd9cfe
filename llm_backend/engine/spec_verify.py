"""Verification of a speculating request's drafts against the target's logits (step 2 of engine/speculative.py's
module docstring), lossless.

Row i of the logits is the target's distribution after the request's last token and drafts 1..i. Greedy: the
longest run where the target's argmax equals the draft, then the target's token at the first difference (or after
the last draft). Sampled: draft d at row i is accepted with probability min(1, p(d) / q(d)), p the target's
distribution under the request's settings and q the drafter's; on a rejection the token comes from
norm(max(p - q, 0)) and the run ends; all accepted adds a token from p at the last row (Leviathan et al. 2023;
Chen et al. 2023). Either way the output has exactly the distribution of non-speculative decoding, and logprobs are
the target's. With an output constraint, row i is masked at the constraint's state after drafts 1..i-1, which are
accepted tentatively and rolled back before returning (the scheduler advances it with what it appends), so a draft
the constraint forbids has probability 0 under the target and is rejected.
"""

from __future__ import annotations

from typing import Callable

import torch

from .interfaces import Constraint, mask_rows
from .request import SamplingParams
from .sampler import Sampled, check_finite, describe, distribution


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    q: list[torch.Tensor],
    params: SamplingParams,
    generator: torch.Generator | None,
    constraint: Constraint | None = None,
    adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> tuple[list[Sampled], Sampled]:
    """(the accepted drafts, the target's next token) for `logits` of len(drafts) + 1 rows; `q`: the drafts'
    distributions (sampled requests); `adjust(row, accepted)`: the request's sampling controls, row i adjusted as if
    the drafts accepted before it were appended (engine/penalties.py). Raises SamplingError on non-finite logits."""
    accepted: list[Sampled] = []
    try:
        for i in range(logits.shape[0]):
            row = logits[i] if adjust is None else adjust(logits[i], [a.token for a in accepted])
            row = row if constraint is None else mask_rows([constraint], [row])[0]
            check_finite(row)
            draft = drafts[i] if i < len(drafts) else None
            if params.greedy:
                tok = int(torch.argmax(row))
                if draft is not None and tok == draft:
                    accepted.append(describe(row, tok, params))
                    if constraint is not None:
                        constraint.accept(tok)  # tentatively: the next row is masked after it
                    continue
                return accepted, describe(row, tok, params)
            target = distribution(row, params)
            if draft is not None:
                ratio = float(target[draft]) / max(float(q[i][draft]), 1e-30)
                if float(torch.rand((), generator=generator)) < ratio:
                    accepted.append(describe(row, draft, params))
                    if constraint is not None:
                        constraint.accept(draft)
                    continue
                resid = (target - q[i]).clamp_min(0)
                total = float(resid.sum())
                target = resid / total if total > 0 else target
            return accepted, describe(row, int(torch.multinomial(target, 1, generator=generator)), params)
        raise AssertionError("the last row always gives the target's token")
    finally:
        if constraint is not None:
            constraint.rollback(len(accepted))
