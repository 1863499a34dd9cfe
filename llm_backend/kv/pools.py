"""KV slot pools: which token slots of the KV tensors are free.

Hybrid SWA keeps two pools (docs/llm.md): the *full* pool holds every token's KV for the
full-attention layers (O(N) per sequence); the *SWA* pool holds the KV of the sliding-window layers,
but only while a token can still be seen by some query (O(W) per running sequence). A slot is an index
into the pool's KV tensors; this module only does the bookkeeping, the tensors live with the engine.

The full pool is paged: it hands out whole pages of `page_size` consecutive slots (slot = page * P +
offset), and takes whole pages back. The SWA pool is token-granular (page size 1): its slots are
released one by one as tokens leave the window.

A slot can be marked *stale*: its KV tensors hold rows that were never computed for some layers (speculative
decoding's MTP layers, whose entries may be left for later: engine/speculative.py). The mark is the pool's: it is
cleared when the slot is freed (the next owner's slot is not stale), and the KV tiers copy it with the slot's KV
(to the host and back, into a store page and back), so an entry restored from a tier is exactly as valid as it was.
"""

from __future__ import annotations


class PoolExhausted(RuntimeError):
    pass


class SlotPool:
    def __init__(self, name: str, size: int, page_size: int = 1):
        if size <= 0 or page_size <= 0:
            raise ValueError(f"{name} pool needs a positive size and page size, got {size} and {page_size}")
        self.name = name
        self.page_size = page_size
        self.pages = size // page_size
        if self.pages == 0:
            raise ValueError(f"{name} pool of {size} slots holds no page of {page_size}")
        self.size = self.pages * page_size
        self._free = list(range(self.pages - 1, -1, -1))  # a stack: recently freed pages are reused first
        self._used = bytearray(self.pages)
        self._stale = bytearray(self.size)  # per slot: 1 = some layers' rows of it were never computed
        self.stale_count = 0

    def available(self) -> int:
        """Free slots (whole free pages)."""
        return len(self._free) * self.page_size

    @property
    def free_pages_count(self) -> int:
        """Free pages."""
        return len(self._free)

    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.name} pool: {n} pages wanted, {len(self._free)} free of {self.pages}")
        if n <= 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()  # the stack's top first
        used = self._used
        for p in out:
            used[p] = 1
        return out

    def free_pages(self, pages) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"{self.name} pool: page {p} freed twice")  # a double free corrupts the cache
            self._used[p] = 0
            self._free.append(p)
            if self.stale_count:
                self.clear_stale(range(p * self.page_size, (p + 1) * self.page_size))

    # stale marks (module docstring)
    def mark_stale(self, slots) -> int:
        """Marks slots stale; returns how many were not marked before."""
        new = 0
        for s in slots:
            if not self._stale[s]:
                self._stale[s] = 1
                new += 1
        self.stale_count += new
        return new

    def clear_stale(self, slots) -> None:
        for s in slots:
            if self._stale[s]:
                self._stale[s] = 0
                self.stale_count -= 1

    def is_stale(self, slot: int) -> bool:
        return bool(self._stale[slot])

    def page_slots(self, page: int) -> list[int]:
        return list(range(page * self.page_size, (page + 1) * self.page_size))

    # token-granular API (page size 1)
    def alloc(self, n: int) -> list[int]:
        if self.page_size != 1:
            raise RuntimeError(f"{self.name} pool is paged: allocate pages")
        return self.alloc_pages(n)

    def free(self, slots) -> None:
        """Frees slots; on a paged pool they must cover whole pages."""
        if self.page_size == 1:
            self.free_pages(slots)
            return
        slots = list(slots)
        pages = sorted({s // self.page_size for s in slots})
        if len(slots) != len(pages) * self.page_size:
            raise RuntimeError(f"{self.name} pool: freeing {len(slots)} slots that are not whole pages")
        self.free_pages(pages)
