"""Embeddings to an LLM worker over Mooncake's transfer engine (`--embedding-transfer tcp|rdma`), instead of
inside the gRPC reply.

The protocol (push, as P/D moves KV; two small gRPC messages):
1. The worker's `Encode` says `hold`. For each item the encoder copies the rows into a range of its staging
   buffer (registered once, `--embedding-transfer-staging-bytes`) and replies with `held` = (this encoder's
   address, id, bytes) and the shape and dtype, no data. An item with no room in the staging buffer goes as bytes.
2. The worker, now knowing the sizes, takes exact ranges of its own registered buffer and calls `Transfer`
   (its engine's session, ids, addresses). The encoder writes every range in one `batch_transfer_sync_write`
   and frees them. The worker never blocks on Mooncake: the encoder's call does the moving.

Invariants: a held range is freed exactly once, by its Transfer (whatever the outcome), by a release (a Transfer
with no session), or when it has been held `--embedding-transfer-hold-s` (a worker that died between the two
messages). Ids are random 63-bit numbers, never one held now: a late Transfer for an expired id is NOT_FOUND (not
another item's rows, but for a 2^-63 chance), and another caller of `Transfer` cannot guess a hold to take or
release someone else's rows. Counters (`counts`): held, sent, bytes, seconds, released, expired, no_room, failed.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass

import torch

from mimo_epd.common.transfer_buffer import TransferBuffer

log = logging.getLogger(__name__)


class NotHeld(KeyError):
    """An id this encoder does not hold (expired, moved already, or never held)."""


@dataclass
class _Held:
    off: int
    n: int
    until: float


class EmbeddingSender:
    def __init__(self, staging_bytes: int, hold_s: float, host: str, protocol: str = "tcp", device: str = ""):
        self.buf = TransferBuffer(staging_bytes, host, protocol, device)
        self.hold_s = hold_s
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()
        self.counts = {k: 0 for k in ("held", "sent", "bytes", "released", "expired", "no_room", "failed")}
        self.counts["seconds"] = 0.0

    def hold(self, rows: torch.Tensor) -> tuple[int, int] | None:
        """(id, bytes) of a staged copy of `rows`, or None when the staging buffer has no room for them."""
        self.expire()
        raw = rows.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
        off = self.buf.ranges.alloc(raw.size)
        if off is None:
            self.counts["no_room"] += 1
            return None
        self.buf.view(off, raw.size)[:] = raw
        with self._lock:
            i = secrets.randbits(63) or 1
            while i in self._held:  # never a live id (a 2^-63 chance)
                i = secrets.randbits(63) or 1
            self._held[i] = _Held(off, int(raw.size), time.monotonic() + self.hold_s)
            self.counts["held"] += 1
        return i, int(raw.size)

    def _take(self, ids: list[int]) -> list[_Held]:
        """Removes the ids from the held set (all or none: NotHeld names the first missing one)."""
        with self._lock:
            missing = [i for i in ids if i not in self._held]
            if missing:
                for i in ids:  # the others go too: the caller gives up on the whole transfer
                    h = self._held.pop(i, None)
                    if h is not None:
                        self.buf.ranges.free(h.off)
                raise NotHeld(missing[0])
            return [self._held.pop(i) for i in ids]

    def send(self, session: str, ids: list[int], addresses: list[int]) -> int:
        """Writes the held rows of `ids` to `addresses` in `session` (blocking) and frees them; returns the bytes.
        Raises NotHeld, or TransferError (the ranges are freed either way)."""
        held = self._take(ids)
        t0 = time.perf_counter()
        try:
            n = self.buf.write(session, [h.off for h in held], list(addresses), [h.n for h in held])
        except Exception:
            self.counts["failed"] += 1
            raise
        finally:
            for h in held:
                self.buf.ranges.free(h.off)
        self.counts["sent"] += len(held)
        self.counts["bytes"] += n
        self.counts["seconds"] += time.perf_counter() - t0
        return n

    def release(self, ids: list[int]) -> None:
        """Frees held ids without moving them (ids not held are ignored)."""
        with self._lock:
            for i in ids:
                h = self._held.pop(i, None)
                if h is not None:
                    self.buf.ranges.free(h.off)
                    self.counts["released"] += 1

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for i in [i for i, h in self._held.items() if h.until <= now]:
                self.buf.ranges.free(self._held.pop(i).off)
                self.counts["expired"] += 1

    @property
    def held_bytes(self) -> int:
        return self.buf.ranges.used_bytes

    def close(self) -> None:
        self.buf.close()
