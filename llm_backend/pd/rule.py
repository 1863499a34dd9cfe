"""Which KV positions move from a prefill worker to a decode worker: the transfer rule, written once.

A request of `length` L prompt tokens reaches the decode worker, whose own SWA-aware radix cache already holds a
window-safe prefix of `decode_prefix` tokens (a page boundary). After prefill the decode side must be able to compute
token L, so it needs:
- full-attention layers: the KV of every position it lacks, `[decode_prefix, L)`;
- sliding-window layers: only the last W positions before the last page boundary inside the prompt, and what
  follows: `[max(decode_prefix, B - W), L)` with `B = (L - 1) - (L - 1) % page`. Token L needs only `[L - W, L)`;
  the few more (`(L - 1) % page + 1` tokens) let the decode worker's own radix cache end a window-safe match at B,
  where a re-sent prompt (or a next turn diverging inside the last page) matches; without them the decode side's
  copy of the prompt would never be matchable. (The decode prefix's own window is already live in its tree: that
  is what window-safe means.)
Bytes per request are therefore `(L - decode_prefix) * full_bytes + (L - max(decode_prefix, B - W)) * swa_bytes`,
with `full_bytes` / `swa_bytes` the KV bytes of one token over all full / all sliding layers (keys and values). A
first turn (`decode_prefix` 0) with page 1 moves `L * full_bytes + min(L, W + 1) * swa_bytes`; a full-KV transfer
(what a non-hybrid model, or a transfer ignorant of the window, moves) is `L * (full_bytes + swa_bytes)`.

Invariants: `0 <= decode_prefix < L` (the last prompt token is always computed by prefill, it gives the first
token); the two ranges end at L; the SWA range lies inside the full range. Slot lists are index-aligned with
their ranges. The transfer (kv/transfer.py `runs`) merges (source slot, destination slot) pairs into maximal runs
contiguous on both sides, so one transfer request moves a whole run of rows (a page, or a whole prompt in a fresh
pool).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferRule:
    length: int  # L: prompt tokens
    decode_prefix: int  # tokens the decode worker already holds (window-safe, page-aligned)
    window: int  # W of the sliding layers
    page: int = 1  # the decode worker's full-pool page size (its cache's match granularity)

    def __post_init__(self):
        if not 0 <= self.decode_prefix < self.length:
            raise ValueError(f"decode prefix {self.decode_prefix} must be in [0, {self.length}) (the prompt length)")
        if self.window < 0 or self.page < 1:
            raise ValueError(f"window must be >= 0 and page >= 1, got {self.window} and {self.page}")

    @property
    def full_range(self) -> tuple[int, int]:
        return self.decode_prefix, self.length

    @property
    def swa_range(self) -> tuple[int, int]:
        last = self.length - 1
        return max(self.decode_prefix, last - last % self.page - self.window, 0), self.length

    @property
    def full_tokens(self) -> int:
        a, b = self.full_range
        return b - a

    @property
    def swa_tokens(self) -> int:
        a, b = self.swa_range
        return b - a

    def full_pages(self, page: int) -> int:
        """Full-pool pages the decode worker allocates for the positions it lacks (its prefix is page-aligned)."""
        return -(-self.full_tokens // page)

    def bytes(self, full_bytes: int, swa_bytes: int) -> int:
        """Bytes the rule moves, given one token's KV bytes over the full and over the sliding layers."""
        return self.full_tokens * full_bytes + self.swa_tokens * swa_bytes

    def full_kv_bytes(self, full_bytes: int, swa_bytes: int) -> int:
        """Bytes a transfer of every layer's KV of the whole prompt would move (the comparison point)."""
        return self.length * (full_bytes + swa_bytes)

    def clip(self, which: str, start: int, end: int) -> tuple[int, int]:
        """The part of positions [start, end) that the `which` ("full" or "swa") range wants."""
        a, b = self.full_range if which == "full" else self.swa_range
        return max(a, start), min(b, end)
