"""The KV slots of one running request, on top of the radix cache (reference.md §5, "Releasing").

A request starts from a cache match (full slots of the whole prefix, SWA slots of its last W tokens,
both locked in the tree), then allocates one full and one SWA slot per token it computes. SWA slots of
its *own* tokens that left the window are released after each prefill chunk, every
`release_interval` decode steps and at the end, so a running request holds about W + chunk + interval
SWA slots whatever its length. At the end its tokens go into the tree (which frees duplicates and repairs
tombstones) and its locks are released.
"""
from __future__ import annotations

from .swa_radix_cache import Match, SWARadixCache


class RequestKV:
    def __init__(self, cache: SWARadixCache, tokens: list[int], release_interval: int = 16):
        self.cache = cache
        self.tokens: list[int] = []
        self.release_interval = release_interval
        self.match: Match = cache.match_prefix(tokens)
        cache.lock(self.match.node)
        self.tokens = list(tokens[: self.match.length])
        self.full: list[int] = list(self.match.full)
        self.swa: list[int | None] = list(self.match.swa)
        self.owned_from = self.match.length  # tokens before this belong to the tree
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

    def own_swa_live(self) -> int:
        return sum(s is not None for s in self.swa[self.owned_from:])

    def extend(self, new_tokens: list[int]) -> tuple[list[int], list[int]]:
        """Allocates slots for tokens about to be computed; returns (full slots, swa slots)."""
        n = len(new_tokens)
        full = self.cache.full_pool.alloc(n)
        try:
            swa = self.cache.swa_pool.alloc(n)
        except Exception:
            self.cache.full_pool.free(full)
            raise
        self.tokens.extend(new_tokens)
        self.full.extend(full)
        self.swa.extend(swa)
        return full, swa

    def release_out_of_window(self) -> int:
        """Frees the SWA slots of own tokens no future query can see (older than the last W)."""
        cut = len(self.tokens) - self.cache.window
        freed = []
        for p in range(self.owned_from, max(self.owned_from, cut)):
            if self.swa[p] is not None:
                freed.append(self.swa[p])
                self.swa[p] = None
        self.cache.swa_pool.free(freed)
        return len(freed)

    def step(self) -> None:
        """Call once per decode step: releases every `release_interval` steps."""
        self._steps += 1
        if self._steps % self.release_interval == 0:
            self.release_out_of_window()

    def window_slots(self) -> list[int]:
        """The SWA slots a next token attends over (must all be live)."""
        w = self.swa[max(0, len(self.tokens) - self.cache.window):]
        if any(s is None for s in w):
            raise RuntimeError("SWA slot of an in-window token was released")
        return w

    def checkpoint(self) -> None:
        """Chunked prefill: puts the tokens computed so far into the tree, so requests arriving meanwhile
        share them, and moves this request's locks to the new end. The tree may already hold some of these
        tokens (another request inserted them first): then ours were freed as duplicates and this request
        continues with the tree's slots (never with a freed one)."""
        if len(self.tokens) <= self.owned_from:
            return
        # No release first: what goes into the tree keeps its SWA slots until the tree evicts them, so a
        # request arriving now can resume anywhere in this prefix (e.g. right after a shared system prompt).
        self.cache.insert(self.tokens, self.full, self.swa)
        node, self.full, self.swa = self.cache.path_to(self.tokens)
        self.cache.lock(node)
        self.cache.unlock(self.match.node)
        self.match.node = node
        self.owned_from = len(self.tokens)
        self._forget_unprotected_swa()

    def finish(self, cache_result: bool = True) -> None:
        """Ends the request: its tokens go into the tree (or are freed), its locks are released."""
        if self.finished:
            return
        self.finished = True
        self.release_out_of_window()
        own = slice(self.owned_from, len(self.tokens))
        if cache_result and len(self.tokens) > self.owned_from:
            self.cache.insert(self.tokens, self.full, self.swa)
        else:
            self.cache.full_pool.free(self.full[own])
            self.cache.swa_pool.free([s for s in self.swa[own] if s is not None])
        self.cache.unlock(self.match.node)
