"""How big a batch may grow and how long the batcher waits for it: fixed, or following the queue.

`BatchBudget` is the fixed policy (`--max-batch-tokens`, `--max-wait-ms`). `QueueFollowingBudget` lets both
follow the forward's queue: when the forward is the bottleneck, items are still queued after a batch closes
on its token budget; a bigger batch then amortises the forward's fixed cost per call (launching the blocks,
Python, the window index), so the budget grows by GROW up to `--max-batch-tokens-peak` and the wait
scales with it (up to `--max-wait-ms-peak`: a bigger batch is worth waiting a little longer for while the
forward is behind anyway). When a batch closes with nothing left queued, the forward keeps up: budget and
wait shrink by SHRINK back to their base, so an idle or decode-bound server answers as soon as it did.

Invariants: base <= tokens <= peak and base wait <= wait <= peak wait at all times; tokens grow only after
a batch that closed on its budget with items left queued (a backlog), never on timing; a single item larger
than the budget still runs alone (the batcher's rule). The latency cost is bounded by the peaks, which are
flags; `bench encoder` reports the P90 each setting gives.
"""

from __future__ import annotations


class BatchBudget:
    """A fixed token budget and wait."""

    def __init__(self, tokens: int, wait_ms: float):
        self.base_tokens = self.tokens = tokens
        self.base_wait_s = self.wait_s = wait_ms / 1e3

    def closed(self, tokens: int, on_budget: bool, backlog: int) -> None:
        """A batch of `tokens` patches closed (`on_budget`: the next item did not fit) with `backlog` items
        still queued behind it."""


class QueueFollowingBudget(BatchBudget):
    GROW = 1.5
    SHRINK = 0.8

    def __init__(self, tokens: int, wait_ms: float, peak_tokens: int, peak_wait_ms: float):
        super().__init__(tokens, wait_ms)
        self.peak_tokens = max(tokens, peak_tokens)
        self.peak_wait_s = max(self.base_wait_s, peak_wait_ms / 1e3)

    def closed(self, tokens: int, on_budget: bool, backlog: int) -> None:
        if on_budget and backlog > 0:  # the forward is behind: bigger batches
            self.tokens = min(self.peak_tokens, int(self.tokens * self.GROW))
        elif backlog == 0:  # the forward keeps up: back toward the base
            self.tokens = max(self.base_tokens, int(self.tokens * self.SHRINK))
        span = self.peak_tokens - self.base_tokens
        frac = (self.tokens - self.base_tokens) / span if span else 0.0
        self.wait_s = self.base_wait_s + frac * (self.peak_wait_s - self.base_wait_s)
