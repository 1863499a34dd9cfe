"""The KV slots of one running request, on top of the radix cache (docs/caches.md, "Releasing").

A request starts from a cache match (full slots of the whole prefix, SWA slots of its last W tokens,
both locked in the tree), then takes full-pool *pages* for the tokens it computes (its tokens fill a page
before it takes the next) and one SWA slot per token. SWA slots of its *own* tokens that left the window
are released after each prefill chunk, every `release_interval` decode steps and at the end, so a running
request holds about W + chunk + interval SWA slots whatever its length. Whole pages of its tokens go into
the tree at a checkpoint or at the end (the tree frees duplicates and repairs tombstones); the partial
last page is freed at the end; its locks are then released.
"""

from __future__ import annotations

from .swa_radix_cache import Match, SWARadixCache


class RequestKV:
    def __init__(self, cache: SWARadixCache, tokens: list[int], release_interval: int = 16):
        self.cache = cache
        self.page = cache.full_pool.page_size
        self.release_interval = release_interval
        self.match: Match = cache.match_prefix(tokens)
        cache.lock(self.match.node)
        self.tokens = list(tokens[: self.match.length])
        self.full: list[int] = list(self.match.full)
        self.swa: list[int | None] = list(self.match.swa)
        self.owned_from = self.match.length  # tokens before this belong to the tree (a page boundary)
        # Own positions before this have no SWA slot (released out of the window): a decode step's release looks
        # at the positions after it only, so its cost does not grow with the context.
        self.released_to = self.owned_from
        self.own_pages: list[int] = []  # full-pool pages of tokens [owned_from, ...), in order
        self._forget_unprotected_swa()
        self._steps = 0
        self.finished = False

    def _forget_unprotected_swa(self) -> None:
        """Drops references to tree-owned SWA slots outside this request's locked window. The tree may evict
        (and the pool hand out again) those slots at any time; keeping them would be a stale mapping that a
        later insert could "repair" a node with — a slot owned by someone else."""
        for p in range(0, max(0, self.owned_from - self.cache.window)):
            self.swa[p] = None

    @property
    def cached_tokens(self) -> int:
        return self.match.length

    def own_full_slots(self) -> int:
        """Full-pool slots this request holds outside the tree (whole pages, the last one maybe part used)."""
        return len(self.own_pages) * self.page

    def own_swa_live(self) -> int:
        return sum(s is not None for s in self.swa[max(self.owned_from, self.released_to) :])

    def extend(self, new_tokens: list[int]) -> tuple[list[int], list[int]]:
        """Takes slots for tokens about to be computed; returns (their full slots, their swa slots)."""
        n = len(new_tokens)
        end = len(self.tokens) + n
        need_pages = -(-(end - self.owned_from) // self.page) - len(self.own_pages)
        pages = self.cache.full_pool.alloc_pages(need_pages) if need_pages > 0 else []
        try:
            swa = self.cache.swa_pool.alloc(n)
        except Exception:
            self.cache.full_pool.free_pages(pages)
            raise
        self.own_pages.extend(pages)
        full = []
        for p in range(len(self.tokens), end):
            rel = p - self.owned_from
            full.append(self.own_pages[rel // self.page] * self.page + rel % self.page)
        self.tokens.extend(new_tokens)
        self.full.extend(full)
        self.swa.extend(swa)
        return full, swa

    def truncate(self, keep: int, tail: list[int] | None = None) -> None:
        """Rolls the request back to its first `keep` tokens (speculative decoding: draft positions the target
        rejected): their SWA slots and the full pages wholly past `keep` are freed; a page `keep` ends inside stays
        (its remaining slots are written again by the next tokens). `tail` replaces the ids of the last tokens
        kept (the accepted drafts, stored as placeholders when their slots were taken). Only own tokens can be
        rolled back: nothing of the tree is touched."""
        if not self.owned_from <= keep <= len(self.tokens):
            raise ValueError(
                f"cannot roll back to {keep} tokens: own tokens are [{self.owned_from}, {len(self.tokens)})"
            )
        self.cache.swa_pool.free([s for s in self.swa[keep:] if s is not None])
        pages = -(-(keep - self.owned_from) // self.page)
        self.cache.full_pool.free_pages(self.own_pages[pages:])
        del self.own_pages[pages:], self.tokens[keep:], self.full[keep:], self.swa[keep:]
        self.released_to = min(self.released_to, keep)
        if tail:
            self.tokens[keep - len(tail) : keep] = tail

    def release_out_of_window(self, end: int | None = None) -> int:
        """Frees the SWA slots of own tokens no future query can see: older than the last W before `end`
        (default: all tokens)."""
        cut = (len(self.tokens) if end is None else end) - self.cache.window
        first = max(self.owned_from, self.released_to)
        freed = []
        for p in range(first, max(first, cut)):
            if self.swa[p] is not None:
                freed.append(self.swa[p])
                self.swa[p] = None
        self.released_to = max(self.released_to, cut)
        self.cache.swa_pool.free(freed)
        return len(freed)

    def step(self) -> None:
        """Call once per decode step: releases every `release_interval` steps."""
        self._steps += 1
        if self._steps % self.release_interval == 0:
            self.release_out_of_window()

    def window_slots(self) -> list[int | None]:
        """The SWA slots a next token attends over (must all be live)."""
        w = self.swa[max(0, len(self.tokens) - self.cache.window) :]
        if any(s is None for s in w):
            raise RuntimeError("SWA slot of an in-window token was released")
        return w

    def _insert_whole_pages(self) -> int:
        """Gives the tree every whole page of own tokens; returns the new page-aligned boundary."""
        aligned = len(self.tokens) - len(self.tokens) % self.page
        if aligned <= self.owned_from:
            return self.owned_from
        self.cache.insert(self.tokens[:aligned], self.full[:aligned], self.swa[:aligned])
        del self.own_pages[: (aligned - self.owned_from) // self.page]  # now the tree's (or freed as duplicates)
        return aligned

    def checkpoint(self) -> None:
        """Chunked prefill: puts the whole pages computed so far into the tree, so requests arriving
        meanwhile share them, and moves this request's locks to the new end. The tree may already hold some
        of these tokens (another request inserted them first): then ours were freed as duplicates and this
        request continues with the tree's slots (never with a freed one)."""
        aligned = self._insert_whole_pages()
        if aligned == self.owned_from:
            return
        node, full, swa = self.cache.path_to(self.tokens[:aligned])
        self.full[:aligned], self.swa[:aligned] = full, swa
        self.cache.lock(node)
        self.cache.unlock(self.match.node)
        self.match.node = node
        self.owned_from = aligned
        self._forget_unprotected_swa()

    def finish(self, cache_result: bool = True) -> None:
        """Ends the request: its whole pages go into the tree (or are freed), the rest is freed, its locks
        are released."""
        if self.finished:
            return
        self.finished = True
        # Keep the window before the last page boundary: that is where the cached prefix will end, and a
        # later request can only resume there if those W tokens still have their SWA slots.
        self.release_out_of_window(len(self.tokens) - len(self.tokens) % self.page if cache_result else None)
        start = self._insert_whole_pages() if cache_result else self.owned_from
        self.cache.swa_pool.free([s for s in self.swa[start:] if s is not None])
        self.cache.full_pool.free_pages(self.own_pages)
        self.own_pages = []
        self.cache.unlock(self.match.node)
