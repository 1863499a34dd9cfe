"""The page-hash index: which worker holds which prompt blocks, from the workers' KV events.

Blocks are named by chained hashes (llm_backend.kv.events.block_hashes), so a worker's reusable prefix for a
new prompt is its run of held blocks from the first one; the prediction ends at the last block of that run
that is a usable (window-safe) match end, and never covers the prompt's last token (the engine always
computes at least one token: it matches `prompt[:-1]`).

`MemoryIndex` is the in-process index (hash -> {worker: state}); the Redis backend (state.py) stores the
same states in one Redis hash per worker. Both are fed by `apply(worker, reset, hashes, states)`.
"""

from __future__ import annotations

from llm_backend.kv.events import ABSENT, USABLE, block_hashes

__all__ = ["MemoryIndex", "predict_tokens", "block_hashes"]


def predict_tokens(states, block_size: int, num_tokens: int) -> int:
    """Tokens reused, given a worker's state of each of the prompt's blocks in order (ABSENT / STORED / USABLE)."""
    cap = max(0, (num_tokens - 1) // block_size)  # whole blocks inside prompt[:-1]
    best = 0
    for k, s in enumerate(states[:cap]):
        if not s:
            break
        if s == USABLE:
            best = k + 1
    return best * block_size


class MemoryIndex:
    def __init__(self):
        self._by_hash: dict[int, dict[str, int]] = {}
        self._by_worker: dict[str, set[int]] = {}

    def apply(self, worker: str, reset: bool, hashes, states) -> None:
        if reset:
            self.drop(worker)
        held = self._by_worker.setdefault(worker, set())
        for h, s in zip(hashes, states):
            if s == ABSENT:
                entry = self._by_hash.get(h)
                if entry is not None:
                    entry.pop(worker, None)
                    if not entry:
                        del self._by_hash[h]
                held.discard(h)
            else:
                self._by_hash.setdefault(h, {})[worker] = int(s)
                held.add(h)

    def drop(self, worker: str) -> None:
        for h in self._by_worker.pop(worker, ()):
            entry = self._by_hash.get(h)
            if entry is not None:
                entry.pop(worker, None)
                if not entry:
                    del self._by_hash[h]

    def states(self, hashes, workers) -> dict[str, list[int]]:
        """Per worker, the state of each block of `hashes` (stops at the first block no worker holds)."""
        out: dict[str, list[int]] = {w: [] for w in workers}
        for h in hashes:
            entry = self._by_hash.get(h)
            if not entry:
                break
            for w in workers:
                out[w].append(entry.get(w, ABSENT))
        return out

    def blocks(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))
