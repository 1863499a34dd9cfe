"""Speculative decoding's state (engine/speculative.py): a request's MTP progress (`MTPState`), the drafter's
counters (`SpecStats`), and the record of one request in an MTP layer pass (`_Run`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .request import Request


@dataclass
class MTPState:
    """A request's MTP progress: every kept layer has its entries for slots [.., next_slot) (from its origin on),
    and `inputs[l]` is H_l(next_slot - 1), the hidden input of layer l's entry at next_slot (None: unknown)."""

    origin: int
    next_slot: int
    inputs: list[torch.Tensor | None]
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # draft distributions (sampled requests)
    at_draft: list[torch.Tensor | None] = field(default_factory=list)  # H_l(L) from drafting, l >= 1
    accept_ema: float | None = None  # accepted drafts per verify, averaged (spec_control.py)
    # Deferred catch-up: H_0(s) for slots [next_slot, end) whose MTP entries are not computed yet.
    pending: list[torch.Tensor] = field(default_factory=list)
    marked: int = 0  # the first `marked` kept rows have their SWA slots marked stale (before_cache)
    floor: int = 0  # no MTP attention reads a slot before this one (raised when deferred rows were dropped)
    wanted: bool = True  # whether the controller let this request draft the last time it was asked

    @property
    def end(self) -> int:
        """The slot after the last final position this state covers (computed or kept in `pending`)."""
        return self.next_slot + len(self.pending)

    def first_slot(self, layer: int) -> int:
        """Layer `layer`'s first entry: its input H_layer reads the layer below at the slot before."""
        return self.origin + layer + 1

    @property
    def ready(self) -> bool:
        """Whether drafting can start at next_slot (the main hidden state before it is known)."""
        return bool(self.inputs) and (self.inputs[0] is not None or bool(self.pending))


@dataclass
class SpecStats:
    steps: int
    verifies: int = 0
    drafted: list[int] = field(default_factory=list)  # per draft position
    accepted: list[int] = field(default_factory=list)
    deferred: int = 0  # catch-up rows kept while not drafting
    resumed: int = 0  # ... of them caught up later (drafting resumed)
    left_stale: int = 0  # ... of them never computed although their slots entered the prefix cache (marked stale)

    def __post_init__(self):
        self.drafted = [0] * self.steps
        self.accepted = [0] * self.steps

    def add(self, drafted: int, accepted: int) -> None:
        self.verifies += 1
        for j in range(drafted):
            self.drafted[j] += 1
            self.accepted[j] += j < accepted

    def as_dict(self) -> dict:
        acc = sum(self.accepted)
        return {
            "verify_steps": self.verifies,
            "drafted_tokens": sum(self.drafted),
            "accepted_tokens": acc,
            "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted, self.drafted)],
            # tokens per verify step: the accepted drafts and the target's own token
            "mean_accept_length": round((acc + self.verifies) / self.verifies, 4) if self.verifies else 0.0,
            "catch_up_deferred_tokens": self.deferred,
            "catch_up_skipped_tokens": self.deferred - self.resumed,
            "catch_up_left_stale_tokens": self.left_stale,
        }


@dataclass
class _Run:
    """One request's entries in one MTP layer pass: consecutive slots from `first`, their tokens and hidden
    inputs; `out` gets the layer's outputs."""

    request: Request
    first: int
    tokens: list[int]
    hidden: list[torch.Tensor]
    out: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # set by the layer pass
