"""The store's key index: an open-addressing hash table from 128-bit keys to slot numbers, in shared memory.

No locking here: every call is made by `store.ShmCache` with the node-wide lock held and the segment's
`dirty` flag set, so a process killed mid-update leaves a table that the next lock holder rebuilds from the
slot table (`rebuild`). Needs only numpy and the standard library.

Layout of the region: `[used: i8 | tombstones: i8 | padding to 64 B | buckets: i4 x capacity]`. A bucket holds
a slot number, `FREE` (never used: ends a probe) or `TOMB` (its key was removed: a probe goes on past it, an
insert may reuse it). Capacity is a power of two of at least twice the slot count, so the table is at most
half full; probing is triangular (`b, b+1, b+3, b+6, ...` mod capacity), which visits every bucket of a
power-of-two table and avoids the long runs of linear probing. A probe stops after `MAX_PROBE` buckets: a
lookup costs O(1) whatever the number of entries. When tombstones pass a quarter of the table, or an insert
finds no bucket within the bound, the table is rebuilt in place from its own live buckets (vectorised).

Keys are content hashes (xxh3-128) already, but are mixed again so that structured keys (counters in tests,
benchmarks) spread as well.
"""

from __future__ import annotations

import numpy as np

FREE, TOMB = -1, -2
MAX_PROBE = 64
HEADER = 64
_M64 = (1 << 64) - 1
_K1, _K2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F


def capacity_for(max_entries: int) -> int:
    cap = 8
    while cap < 2 * max_entries:
        cap *= 2
    return cap


def region_bytes(max_entries: int) -> int:
    return HEADER + 4 * capacity_for(max_entries)


def _mix(lo: int, hi: int) -> int:
    x = lo ^ ((hi * _K1) & _M64)
    x ^= x >> 32
    x = (x * _K2) & _M64
    return x ^ (x >> 29)


def _mix_np(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    x = lo ^ (hi * np.uint64(_K1))  # uint64 arrays wrap like the masked ints above
    x ^= x >> np.uint64(32)
    x *= np.uint64(_K2)
    return x ^ (x >> np.uint64(29))


class HashIndex:
    """Views over one index region at `offset` of `buf`; the keys are the slot table's key columns at
    `keys_offset` (`max_entries` low halves, then as many high halves, little-endian u64)."""

    def __init__(self, buf: memoryview, offset: int, max_entries: int, keys_offset: int):
        self.capacity = capacity_for(max_entries)
        self.mask = self.capacity - 1
        self.counts = np.frombuffer(buf, "<i8", 2, offset)  # used, tombstones
        self.table = np.frombuffer(buf, "<i4", self.capacity, offset + HEADER)
        n = max_entries
        self.key_lo = np.frombuffer(buf, "<u8", n, keys_offset)
        self.key_hi = np.frombuffer(buf, "<u8", n, keys_offset + 8 * n)
        # memoryviews for the probes: indexing one gives a Python int, several times cheaper than numpy scalars
        self._t = buf[offset + HEADER : offset + HEADER + 4 * self.capacity].cast("i")
        self._lo = buf[keys_offset : keys_offset + 8 * n].cast("Q")
        self._hi = buf[keys_offset + 8 * n : keys_offset + 16 * n].cast("Q")

    def release(self) -> None:
        self.counts = self.table = self.key_lo = self.key_hi = None  # type: ignore[assignment]
        self._t.release()
        self._lo.release()
        self._hi.release()

    @staticmethod
    def initialise(buf: memoryview, offset: int, max_entries: int) -> None:
        np.frombuffer(buf, "<i4", capacity_for(max_entries), offset + HEADER)[:] = FREE

    # ------------------------------------------------------------------ scalar operations
    def find(self, lo: int, hi: int) -> int:
        """The slot holding key (lo, hi), or -1."""
        t, klo, khi, mask = self._t, self._lo, self._hi, self.mask
        b = _mix(lo, hi) & mask
        for p in range(1, MAX_PROBE + 1):
            v = t[b]
            if v == FREE:
                return -1
            if v >= 0 and klo[v] == lo and khi[v] == hi:
                return v
            b = (b + p) & mask
        return -1

    def insert(self, lo: int, hi: int, slot: int) -> bool:
        """Adds a key known to be absent (the caller looked it up under the same lock). False when no bucket
        is free within the probe bound even after a rebuild (the caller refuses the entry)."""
        for attempt in range(2):
            t, mask = self._t, self.mask
            b = _mix(lo, hi) & mask
            for p in range(1, MAX_PROBE + 1):
                v = t[b]
                if v < 0:
                    t[b] = slot
                    self.counts[0] += 1
                    if v == TOMB:
                        self.counts[1] -= 1
                    return True
                b = (b + p) & mask
            if attempt == 0:
                self.rebuild(self.table[self.table >= 0].astype(np.int64))
        return False

    def remove(self, slot: int) -> bool:
        """Removes `slot`'s bucket (found through its key, which must still be in the slot table)."""
        t, mask = self._t, self.mask
        lo, hi = self._lo[slot], self._hi[slot]
        b = _mix(lo, hi) & mask
        for p in range(1, MAX_PROBE + 1):
            v = t[b]
            if v == FREE:
                return False
            if v == slot:
                t[b] = TOMB
                self.counts[0] -= 1
                self.counts[1] += 1
                if self.counts[1] > self.capacity // 4:
                    self.rebuild(self.table[self.table >= 0].astype(np.int64))
                return True
            b = (b + p) & mask
        return False

    # ------------------------------------------------------------------ bulk
    def rebuild(self, slots: np.ndarray) -> np.ndarray:
        """Rebuilds the table to hold exactly `slots` (distinct keys); returns the slots it could not place
        within the probe bound (none at this load factor in practice; the caller frees them)."""
        table = self.table
        table[:] = FREE
        slots = np.asarray(slots, np.int64)
        pos = (_mix_np(self.key_lo[slots], self.key_hi[slots]) & np.uint64(self.mask)).astype(np.int64)
        pending = np.arange(len(slots))
        for p in range(1, MAX_PROBE + 1):
            if not len(pending):
                break
            b = pos[pending]
            empty = table[b] == FREE
            cand, cb = pending[empty], b[empty]
            buckets, first = np.unique(cb, return_index=True)  # one winner per contested bucket
            table[buckets] = slots[cand[first]]
            placed = np.zeros(len(slots), bool)
            placed[cand[first]] = True
            pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + p) & self.mask
        self.counts[0] = len(slots) - len(pending)
        self.counts[1] = 0
        return slots[pending]

    def verify(self, slots: np.ndarray) -> bool:
        """Whether the table holds exactly `slots`, each findable through its key."""
        live = np.sort(self.table[self.table >= 0])
        if not np.array_equal(live, np.sort(np.asarray(slots, np.int64)).astype(live.dtype)):
            return False
        return all(self.find(self._lo[s], self._hi[s]) == s for s in live.tolist())
