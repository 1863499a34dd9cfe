"""When speculation pays: a measured rule that turns drafting off for a request or a whole step.

Speculating costs K more tokens through the target for each drafting request and the MTP chain (K sequential
single-layer passes, a roughly fixed cost per step); it saves E target steps per request,
E = the expected accepted drafts. Whether that pays depends on the machine: on a GPU a verify of K + 1 tokens costs
about what one token does, on a CPU every token costs. So the rule measures instead of guessing:

- step cost: every step's wall time, less the time spent resuming deferred catch-ups (timed on its own and
  reported per row: a one-off cost of switching drafting back on, not a cost of drafting), is fitted online
  (exponentially weighted least squares) to t = a + b * target_tokens + c * [some request verified] +
  d * drafting_requests: c is what a drafting step costs whatever its size (the K sequential MTP passes), d what
  each drafting request adds besides its verify tokens (its rows through the MTP layers and the LM head, K times,
  and its catch-up); a request that does not draft defers its catch-up, so a plain step costs the target alone;
- acceptance: each request's accepted drafts per verify (an exponential average), and the engine-wide one for
  requests that have none yet;
- per step, with B the requests of the last step (decoding or prefilling: after a step of prompt chunks they
  all decode) and the fitted costs: a token of plain decoding costs t0 / B, t0 = a + b * B (a plain decode step;
  other requests' prompt tokens cost the same whether or not anyone drafts, so they are no part of what an
  avoided step saves); a request is worth drafting when E_r * t0 / B >= K * b + d (its extra verify tokens and
  its drafting), and the step drafts when the requests worth it together save more than c by at least `margin`
  of a plain step's time (t0; a request: its saving exceeds its cost by `margin` of a plain token's). The margin keeps the fit's noise (a step's time moves ±25 % on a busy CPU) from turning
  drafting on where it only breaks even; where drafting pays (a GPU: 1.3-1.7x) it changes nothing. Until the fit has seen `min_steps` of each kind it alternates them (steps with no decoding request count as
  plain); from then on it sometimes does the opposite of what it decided (a probe), so both kinds keep being
  measured and a bad phase never switches it off for good (a step probe inverts the step's decision; a request
  probe lets the requests the per-request rule keeps off draft in a drafting step). A probe that turns drafting
  on drafts for a few requests only (alternately 1 and `probe_requests`, so c and d stay apart in the fit): each
  drafter first resumes its deferred rows (up to W), so a probe of the whole batch cost several plain steps.
  Probes start `probe_every` steps apart and the gap doubles while probing confirms the decision, up to
  `max_probe_gap`; a changed decision resets the gap.
"""

from __future__ import annotations

import torch

FEATURES = 4  # 1, target tokens, any verify, drafting requests


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
        probe_requests: int = 4,
        margin: float = 0.1,
    ):
        self.steps, self.decay, self.min_steps, self.auto = steps, decay, min_steps, auto
        self.margin = max(0.0, margin)
        self.probe_requests = max(1, probe_requests)
        self._probe_sizes = 0  # probes that turned drafting on so far (their size alternates 1, probe_requests)
        self._probe_left: int | None = None  # drafters still allowed in this step (None = no limit)
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
        self._last_batch = 1  # requests in the last step: the batch the next step's decision prices
        self.decisions = {"on": 0, "off": 0, "probes": 0}
        self.resume = {"rows": 0, "seconds": 0.0}  # deferred catch-ups resumed when drafting came back
        self._costs_at: tuple[int, tuple[float, float, float, float]] = (-1, (0.0, 0.0, 0.0, 0.0))

    # ----------------------------------------------------------------------------------- measurements
    def observe(
        self, seconds: float, target_tokens: int, verified: bool, decoding: int, drafting: int = -1, requests: int = -1
    ) -> None:
        """A step's time (less its resumes), target tokens, whether any request verified, decoding requests,
        drafting requests (-1: all decoding requests when verified) and requests in it (-1: the decoding ones)."""
        drafting = (decoding if verified else 0) if drafting < 0 else drafting
        x = torch.tensor([1.0, target_tokens, float(verified), float(drafting)], dtype=torch.float64)
        self.xtx = self.decay * self.xtx + torch.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.seen[int(verified)] += 1
        self._last_batch = max(1, decoding if requests < 0 else requests)
        self.step += 1

    def resumed(self, rows: int, seconds: float) -> None:
        """A step resumed `rows` deferred catch-up rows in `seconds` (left out of the step's fit)."""
        self.resume["rows"] += rows
        self.resume["seconds"] += seconds

    def accepted(self, r_state, accepted: int) -> None:
        """A verify of one request accepted `accepted` drafts."""
        r_state.accept_ema = accepted if r_state.accept_ema is None else 0.8 * r_state.accept_ema + 0.2 * accepted
        self.global_accept = 0.95 * self.global_accept + 0.05 * accepted

    def costs(self) -> tuple[float, float, float, float]:
        """(a, b, c, d) of the step-time fit (ridge-regularised, never negative)."""
        beta = torch.linalg.solve(self.xtx + 1e-9 * torch.eye(FEATURES, dtype=torch.float64), self.xty)
        a, b, c, d = (max(0.0, float(v)) for v in beta)
        return a, b, c, d

    def _step_costs(self) -> tuple[float, float, float, float]:
        """costs(), solved once per step (every request of a step asks)."""
        if self._costs_at[0] != self.step:
            self._costs_at = (self.step, self.costs())
        return self._costs_at[1]

    def _plain_token(self) -> float:
        """What one decoding request's token costs in a plain decode step of the last step's batch (t0 / B)."""
        a, b, _, _ = self._step_costs()
        B = self._last_batch
        return (a + b * B) / B

    def _gain(self, accept: float) -> float:
        """What drafting saves per request and step, with `accept` expected accepted drafts (negative: it costs)."""
        _, b, _, d = self._step_costs()
        return accept * self._plain_token() - self.steps * b - d

    # ----------------------------------------------------------------------------------- decisions
    def _decide(self) -> bool:
        if not self.auto:
            return True
        if min(self.seen) < self.min_steps:  # measure both kinds first: a batch that always drafts would
            return self.seen[1] <= self.seen[0]  # never see a plain step (bench spec at batch 16 saw 2 in 195)
        c = self._step_costs()[2]
        B = self._last_batch
        on = B * self._gain(self.global_accept) > c + self.margin * B * self._plain_token()
        if self._step_probes.due(self.step, on):
            self.decisions["probes"] += 1
            if not on:  # a few drafters only: each resumes its deferred rows first
                self._probe_left = 1 if self._probe_sizes % 2 == 0 else self.probe_requests
                self._probe_sizes += 1
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
            self._probe_left = None
            self._draft_step = self._decide()
            self._probe_requests = self.auto and self._draft_step and self._request_probes.due(self.step)
            self.decisions["on" if self._draft_step else "off"] += 1
        if not self._draft_step:
            return False
        if self._probe_left is not None:  # a probe of drafting: its first few requests
            self._probe_left -= 1
            return self._probe_left >= 0
        if not self.auto or r_state.accept_ema is None or min(self.seen) < self.min_steps:
            return True
        return self._gain(r_state.accept_ema) >= self.margin * self._plain_token() or self._probe_requests

    def as_dict(self) -> dict:
        a, b, c, d = self.costs() if min(self.seen) else (0.0, 0.0, 0.0, 0.0)
        rows = self.resume["rows"]
        return {
            "fit_ms": {
                "per_step": round(a * 1e3, 3),
                "per_token": round(b * 1e3, 4),
                "chain": round(c * 1e3, 3),
                "per_drafting_request": round(d * 1e3, 4),
            },
            "resumed_rows": rows,
            "resume_ms_per_row": round(self.resume["seconds"] * 1e3 / rows, 4) if rows else None,
            "steps_seen": {"plain": self.seen[0], "verify": self.seen[1]},
            "decisions": dict(self.decisions),
            "accept_ema": round(self.global_accept, 3),
            "margin": self.margin,
        }
