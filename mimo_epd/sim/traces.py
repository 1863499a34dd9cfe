"""The Mooncake trace as simulated requests, through the prefix-cache benchmark's parser (bench/prefix_cache.py:
`load_trace`, and `prompt_units`, which turns each 512-token hash id into deterministic ids so equal hash ids
give equal prefixes). Arrival times are the trace's timestamps (ms) in seconds; scale them with
llm_backend.sim.load.scale_to_load."""

from __future__ import annotations

from llm_backend.sim.trace import SimRequest
from mimo_epd.bench.prefix_cache import BLOCK, load_trace, prompt_units
from mimo_epd.data import MOONCAKE_TRACE

DEFAULT_TRACE = MOONCAKE_TRACE


def session_key(hash_ids: list[int]) -> int:
    """A conversation's turns share their prompt's first blocks: block 0 is the system prompt every request
    shares, block 1 starts the conversation (-1 for single-block prompts)."""
    return hash_ids[1] if len(hash_ids) > 1 else -1


def in_sample(key: int, fraction: float, seed: int = 0) -> bool:
    """A fixed pseudo-random choice of conversations; each `seed` draws another (mostly disjoint) sample."""
    return ((key + seed * 7919) * 2654435761 + 12345) % 1_000_003 < fraction * 1_000_003


def mooncake_requests(
    path: str = DEFAULT_TRACE,
    limit: int = 0,
    unit: int = 16,
    offset: int = 0,
    sessions: float = 1.0,
    seed: int = 0,
) -> list[SimRequest]:
    """The trace's requests from line `offset`, at most `limit` (0 = all). `sessions` < 1 keeps that fraction of
    the conversations (all their turns, over the whole trace) instead of a contiguous stretch, so a short replay
    still has the trace's multi-turn reuse; `seed` picks which conversations (0: the historical sample)."""
    if BLOCK % unit:
        raise ValueError(f"the token unit ({unit}) must divide the trace's block of {BLOCK} tokens")
    rows = load_trace(path, offset + limit if limit and sessions >= 1 else 0)[offset:]
    if sessions < 1:
        rows = [r for r in rows if in_sample(session_key(r["hash_ids"]), sessions, seed)]
        rows = rows[:limit] if limit else rows
    return [
        SimRequest(
            i, r["timestamp"] / 1e3, prompt_units(r, unit), int(r["input_length"]), max(1, int(r["output_length"]))
        )
        for i, r in enumerate(rows)
    ]
