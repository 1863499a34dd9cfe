"""When speculation pays: a measured rule that turns drafting off for a request or a whole step.

Speculating costs K more tokens through the target for each drafting request and the MTP chain (K sequential
single-layer passes, a roughly fixed cost per step); it saves E target steps per request,
E = the expected accepted drafts. Whether that pays depends on the machine: on a GPU a verify of K + 1 tokens costs
about what one token does, on a CPU every token costs. So the rule measures instead of guessing:

- step cost: every step's wall time is fitted online (exponentially weighted least squares) to
  t = a + b * target_tokens + c * [some request verified] (a drafting request's MTP catch-up runs over its
  target tokens and is folded into b and c; a request that does not draft defers its catch-up, so a plain step costs
  the target alone, and the deferred rows are caught up in the first step it drafts again: part of c);
- acceptance: each request's accepted drafts per verify (an exponential average), and the engine-wide one for
  requests that have none yet;
- per step, with B decoding requests last step and the fitted costs: a token of plain decoding costs
  t0 / B, t0 = a + b * (other tokens + B); a request is worth drafting when E_r * t0 / B >= K * b (its
  extra verify tokens), and the step drafts when the requests worth it together save more than c, the chain's
  fixed cost. Until the fit has seen `min_steps` of each kind it alternates them (steps with no decoding
  request count as plain); from then on it sometimes does the opposite of what it decided (a probe), so both kinds
  keep being measured and a bad phase never switches it off for good (a step probe inverts the step's decision; a
  request probe lets the requests the per-request rule keeps off draft in a drafting step). Probes start
  `probe_every` steps apart and the gap doubles while probing confirms the decision, up to `max_probe_gap` (a
  probe with drafting off costs the deferred MTP catch-up of every request: at batch 16 on a CPU about four plain
  steps); a changed decision resets the gap.
"""

from __future__ import annotations

import torch

FEATURES = 3  # 1, target tokens, any verify


class ProbeSchedule:
    """When to try the other choice: `first` steps after a decision changed, then at doubling gaps up to `cap`."""

    def __init__(self, first: int, cap: int):
        self.first, self.cap = first, max(first, cap)
        self.gap, self.next = first, first
        self.last: bool | None = None

    def due(self, step: int, decision: bool = True) -> bool:
        if decision != self.last:
            self.last, self.gap = decision, self.first
            self.next = min(self.next, step + self.gap)
        if step < self.next:
            return False
        self.gap = min(2 * self.gap, self.cap)
        self.next = step + self.gap
        return True


class SpecController:
    def __init__(
        self,
        steps: int,
        decay: float = 0.98,
        probe_every: int = 32,
        min_steps: int = 8,
        auto: bool = True,
        max_probe_gap: int = 1024,
    ):
        self.steps, self.decay, self.min_steps, self.auto = steps, decay, min_steps, auto
        self._step_probes = ProbeSchedule(probe_every, max_probe_gap)  # a step that does the opposite
        self._request_probes = ProbeSchedule(probe_every, max_probe_gap)  # requests the rule keeps off draft
        self._probe_requests = False
        self.xtx = torch.zeros(FEATURES, FEATURES, dtype=torch.float64)
        self.xty = torch.zeros(FEATURES, dtype=torch.float64)
        self.seen = [0, 0]  # steps observed without / with a verify
        self.global_accept = float(steps)  # optimistic until measured
        self.step = 0
        self._decided_at = -1
        self._draft_step = True
        self._last_batch = (1, 0)  # (decoding requests, other target tokens) of the last step
        self.decisions = {"on": 0, "off": 0, "probes": 0}

    # ----------------------------------------------------------------------------------- measurements
    def observe(self, seconds: float, target_tokens: int, verified: bool, decoding: int) -> None:
        x = torch.tensor([1.0, target_tokens, float(verified)], dtype=torch.float64)
        self.xtx = self.decay * self.xtx + torch.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.seen[int(verified)] += 1
        self._last_batch = (max(1, decoding), max(0, target_tokens - decoding * (1 + self.steps * verified)))
        self.step += 1

    def accepted(self, r_state, accepted: int) -> None:
        """A verify of one request accepted `accepted` drafts."""
        r_state.accept_ema = accepted if r_state.accept_ema is None else 0.8 * r_state.accept_ema + 0.2 * accepted
        self.global_accept = 0.95 * self.global_accept + 0.05 * accepted

    def costs(self) -> tuple[float, float, float]:
        """(a, b, c) of the step-time fit (ridge-regularised, never negative)."""
        beta = torch.linalg.solve(self.xtx + 1e-9 * torch.eye(FEATURES, dtype=torch.float64), self.xty)
        a, b, c = (max(0.0, float(v)) for v in beta)
        return a, b, c

    # ----------------------------------------------------------------------------------- decisions
    def _decide(self) -> bool:
        if not self.auto:
            return True
        if min(self.seen) < self.min_steps:  # measure both kinds first: a batch that always drafts would
            return self.seen[1] <= self.seen[0]  # never see a plain step (bench spec at batch 16 saw 2 in 195)
        a, b, c = self.costs()
        B, other = self._last_batch
        per_token = (a + b * (other + B)) / B
        worth = self.global_accept * per_token - self.steps * b
        on = B * worth > c
        if self._step_probes.due(self.step, on):
            self.decisions["probes"] += 1
            return not on
        return on

    @property
    def drafting(self) -> bool:
        """The last step decision: whether drafting was on (requests that do not draft defer their MTP catch-up)."""
        return self._draft_step

    def wants(self, r_state) -> bool:
        """Whether this request drafts in the coming step."""
        if self._decided_at != self.step:
            self._decided_at = self.step
            self._draft_step = self._decide()
            self._probe_requests = self.auto and self._draft_step and self._request_probes.due(self.step)
            self.decisions["on" if self._draft_step else "off"] += 1
        if not self._draft_step:
            return False
        if not self.auto or r_state.accept_ema is None or min(self.seen) < self.min_steps:
            return True
        a, b, c = self.costs()
        B, other = self._last_batch
        per_token = (a + b * (other + B)) / B
        return r_state.accept_ema * per_token >= self.steps * b or self._probe_requests

    def as_dict(self) -> dict:
        a, b, c = self.costs() if min(self.seen) else (0.0, 0.0, 0.0)
        return {
            "fit_ms": {"per_step": round(a * 1e3, 3), "per_token": round(b * 1e3, 4), "chain": round(c * 1e3, 3)},
            "steps_seen": {"plain": self.seen[0], "verify": self.seen[1]},
            "decisions": dict(self.decisions),
            "accept_ema": round(self.global_accept, 3),
        }
