"""Simulated requests and the long-context traffic generator.

A `SimRequest` is what a trace says about one request: when it arrives (seconds), its prompt (token ids, in
units of `unit` tokens: see engine.py), its real prompt and output lengths, and optionally the exact output
token ids (the validation replays a live engine's outputs; otherwise output ids are made up, distinct per
request). The Mooncake trace loader lives with the fleet (mimo_epd/sim/traces.py, it reuses the prefix-cache
benchmark's parser).

`long_context_mix`: prompt lengths drawn over the three length buckets 0-64K / 64K-256K / 256K-1M (log-uniform
inside a bucket, bucket shares as given), output lengths log-uniform, Poisson arrivals. Prompts are random
unit ids (no sharing) unless `shared_prefix_tokens` gives every request a common system prompt.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

BUCKETS = (("0-64K", 0, 65536), ("64K-256K", 65536, 262144), ("256K-1M", 262144, 1 << 20))
OUTPUT_BASE = 1 << 40  # made-up output ids live above any prompt id


def length_class(tokens: int) -> str:
    for name, _, hi in BUCKETS:
        if tokens < hi:
            return name
    return BUCKETS[-1][0]


@dataclass
class SimRequest:
    index: int
    arrival: float  # seconds
    prompt: list[int]  # unit ids
    prompt_len: int  # real tokens
    output_len: int  # real tokens generated
    output_ids: list[int] | None = None  # exact output ids (unit 1 only), e.g. from a live run
    meta: dict = field(default_factory=dict)

    def output_unit(self, j: int) -> int:
        if self.output_ids is not None:
            return self.output_ids[j]
        return OUTPUT_BASE + (self.index << 20) + j


def long_context_mix(
    n: int,
    rate_per_s: float,
    seed: int = 0,
    unit: int = 128,
    shares=(0.8, 0.15, 0.05),
    output=(64, 1024),
    min_prompt: int = 512,
    shared_prefix_tokens: int = 0,
) -> list[SimRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    prefix = [rng.getrandbits(48) for _ in range(shared_prefix_tokens // unit)]
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        b = rng.choices(range(len(BUCKETS)), weights=shares)[0]
        _, lo, hi = BUCKETS[b]
        lo = max(lo, min_prompt)
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi - 1))))
        olen = int(math.exp(rng.uniform(math.log(output[0]), math.log(output[1]))))
        units = -(-length // unit)
        body = [rng.getrandbits(48) for _ in range(max(0, units - len(prefix)))]
        out.append(SimRequest(i, t, (prefix + body)[: max(units, 1)], length, olen))
    return out
