"""KV slot pools: which token slots of the KV tensors are free.

Hybrid SWA keeps two pools (reference.md §4-5): the *full* pool holds every token's KV for the
full-attention layers (O(N) per sequence); the *SWA* pool holds the KV of the sliding-window layers,
but only while a token can still be seen by some query (O(W) per running sequence). A slot is an index
into the pool's KV tensors; this module only does the bookkeeping, the tensors live with the engine.
"""
from __future__ import annotations


class PoolExhausted(RuntimeError):
    pass


class SlotPool:
    """A fixed number of slots; `alloc` hands out free ones, `free` takes them back."""

    def __init__(self, name: str, size: int):
        if size <= 0:
            raise ValueError(f"{name} pool needs at least one slot, got {size}")
        self.name = name
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # a stack: recently freed slots are reused first
        self._used = bytearray(size)

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.name} pool: {n} slots wanted, {len(self._free)} free of {self.size}")
        out = [self._free.pop() for _ in range(n)]
        for s in out:
            self._used[s] = 1
        return out

    def free(self, slots) -> None:
        for s in slots:
            if not self._used[s]:
                raise RuntimeError(f"{self.name} pool: slot {s} freed twice")  # a double free corrupts the cache
            self._used[s] = 0
            self._free.append(s)
