"""`mimo-epd bench prefix-cache --trace ../shared/traces/conversation_trace.jsonl`: prefix-cache hit tokens of
the SWA-aware dual-pool cache vs a cache that keeps full KV for the sliding layers too vs an unbounded cache,
replaying a real request trace at a fixed KV byte budget under the MiMo-V2.5-Pro shape.

The trace (reference.md §7) gives each request's prompt as hash ids of 512-token blocks (equal ids = equal
content). Requests are replayed in trace order, one at a time, through the engine's own cache code path:
`RequestKV` matches the prompt in the real `SWARadixCache`, computes the rest in prefill chunks (each chunk's
whole pages go into the tree at once, as `engine.LLM` does), and finishes (its whole pages stay cached; the
cache evicts LRU when a pool runs out). Output tokens are not in the trace's ids and are not replayed.

- `swa_aware`: full pool = full-attention layers' KV (10 layers per token), SWA pool = sliding layers' KV
  (60 layers per token) kept only where a window needs it; the byte budget is split by `--swa-share`;
- `full_kv`: one pool holding all 70 layers' KV per token, nothing ever released (what serving stacks did
  before they supported SWA): the same bytes hold 7x fewer tokens;
- `unbounded`: the same as `full_kv` with no byte limit — the ideal (~36.6% of blocks, reference.md §7).

Tokens are simulated in units of `--token-unit` (default 128 = the window): a block is 4 units, the window one
unit; block boundaries and the window are multiples of it, so window-safe matching at block granularity is
exact. Hit tokens are counted in real tokens (a partial last block counts its real length).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from llm_backend.kv import PoolExhausted, RequestKV, SlotPool, SWARadixCache
from llm_backend.models import PRO_SHAPE_CONFIG
from mimo_epd.bench.kv_capacity import NEVER_RELEASE, token_bytes

BLOCK = 512


def load_trace(path: str, limit: int = 0) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"trace {path!r} not found (the Mooncake conversation trace lives in ../shared/traces/)")
    out = []
    with p.open() as f:
        for i, line in enumerate(f):
            if limit and len(out) >= limit:
                break
            r = json.loads(line)
            if not r.get("hash_ids") or r.get("input_length", 0) <= 0:
                raise SystemExit(f"trace line {i + 1}: needs non-empty hash_ids and a positive input_length")
            out.append(r)
    return out


def prompt_units(r: dict, unit: int) -> list[int]:
    """The prompt as unit ids: block h's j-th unit is h * (BLOCK // unit) + j; the last block may be partial."""
    per = BLOCK // unit
    ids = r["hash_ids"]
    last = r["input_length"] - BLOCK * (len(ids) - 1)
    units = [h * per + j for h in ids[:-1] for j in range(per)]
    units += [ids[-1] * per + j for j in range(max(1, min(per, math.ceil(last / unit))))]
    return units


class Replay:
    """One cache configuration replaying the trace."""

    def __init__(self, name: str, full_units: int, swa_units: int, window_units: int, page_units: int,
                 chunk_units: int, evict_fraction: float):
        self.name = name
        self.full_pool = SlotPool("full", full_units, page_units)
        self.swa_pool = SlotPool("swa", swa_units)
        self.cache = SWARadixCache(self.full_pool, self.swa_pool, window_units, page_units)
        self.chunk = chunk_units
        # Evicting a little more than needed at a time (a low watermark) amortises the LRU scan over many
        # requests; real servers do the same.
        self.evict_full_min = max(1, int(full_units * evict_fraction))
        self.evict_swa_min = max(1, int(swa_units * evict_fraction))
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.skipped = 0

    def request(self, units: list[int], input_length: int, unit: int) -> None:
        kv = RequestKV(self.cache, units, NEVER_RELEASE)
        self.prompt_tokens += input_length
        self.hit_tokens += min(kv.cached_tokens * unit, input_length)
        done = kv.cached_tokens
        try:
            while done < len(units):
                n = min(self.chunk, len(units) - done)
                if not self.cache.make_room(n + self.full_pool.page_size, n, self.evict_full_min, self.evict_swa_min):
                    raise PoolExhausted("pools full")
                kv.extend(units[done:done + n])
                kv.checkpoint()  # as the engine: each prompt chunk goes into the tree at once (shareable at once)
                done += n
            kv.finish(cache_result=True)
        except PoolExhausted:  # a prompt larger than the whole pool: served uncached
            kv.finish(cache_result=False)
            self.skipped += 1

    def result(self) -> dict:
        st = self.cache.stats
        return {"hit_tokens": self.hit_tokens, "prompt_tokens": self.prompt_tokens,
                "hit_token_rate": round(self.hit_tokens / max(self.prompt_tokens, 1), 4),
                "pool_units": {"full": self.full_pool.size, "swa": self.swa_pool.size},
                "evicted_units": {"full": st.full_evicted, "swa": st.swa_evicted}, "repairs": st.repairs,
                "uncacheable_requests": self.skipped}


def main(args) -> dict:
    cfg = PRO_SHAPE_CONFIG
    unit, page = args.token_unit, args.page_size
    if BLOCK % unit or cfg.window % unit or page % unit or args.chunk_size % unit:
        raise SystemExit(f"--token-unit {unit} must divide the block (512), the window ({cfg.window}), "
                         f"--page-size ({page}) and --chunk-size ({args.chunk_size})")
    trace = load_trace(args.trace, 1000 if args.quick and not args.requests else args.requests)
    reqs = [(prompt_units(r, unit), r["input_length"]) for r in trace]
    unique_blocks = len({h for r in trace for h in r["hash_ids"]})
    esz = 2  # bf16
    full_b, swa_b = token_bytes(cfg, False, esz), token_bytes(cfg, True, esz)
    all_full_b = full_b + swa_b  # every layer's KV per token
    unique_full_kv_bytes = unique_blocks * BLOCK * all_full_b
    budget = int(unique_full_kv_bytes * args.budget_fraction)
    w, c, p = cfg.window // unit, args.chunk_size // unit, page // unit
    swa_units = int(budget * args.swa_share) // (swa_b * unit)
    full_units = (budget - swa_units * swa_b * unit) // (full_b * unit)
    modes = {
        "swa_aware": Replay("swa_aware", full_units, max(swa_units, w + c), w, p, c, args.evict_fraction),
        "full_kv": Replay("full_kv", budget // (all_full_b * unit), budget // (all_full_b * unit), NEVER_RELEASE, p, c,
                          args.evict_fraction),
        "unbounded": Replay("unbounded", sum(len(u) for u, _ in reqs) + c + p, sum(len(u) for u, _ in reqs) + c,
                            NEVER_RELEASE, p, c, args.evict_fraction),
    }
    results, seconds = {}, {}
    for name, replay in modes.items():
        t0 = time.perf_counter()
        for units, length in reqs:
            replay.request(units, length, unit)
        results[name] = replay.result()
        seconds[name] = round(time.perf_counter() - t0, 2)
    rate = {k: v["hit_token_rate"] for k, v in results.items()}
    ratios = {"swa_aware_vs_full_kv": round(results["swa_aware"]["hit_tokens"] / max(results["full_kv"]["hit_tokens"], 1), 3),
              "swa_aware_vs_unbounded": round(results["swa_aware"]["hit_tokens"] / max(results["unbounded"]["hit_tokens"], 1), 3)}
    return {
        "bench": "prefix-cache",
        "config": {"trace": args.trace, "requests": len(reqs), "unique_blocks": unique_blocks,
                   "shape": "MiMo-V2.5-Pro (10 full + 60 sliding layers, 8 KV heads, head dims 192/128, window 128)",
                   "kv_bytes_per_token": {"full_layers": full_b, "sliding_layers": swa_b, "all_layers": all_full_b},
                   "unique_full_kv_bytes": unique_full_kv_bytes, "budget_fraction": args.budget_fraction,
                   "budget_bytes": budget, "swa_share": args.swa_share, "token_unit": unit, "page_size": page,
                   "chunk_size": args.chunk_size, "replay": "trace order, one request at a time, prompts only"},
        "hit_token_rate": rate,
        "ratios": ratios,
        "modes": results,
        "seconds": seconds,
    }


def add_arguments(p) -> None:
    p.add_argument("--trace", default="../shared/traces/conversation_trace.jsonl",
                   help="Mooncake-format JSONL trace (default: ../shared/traces/conversation_trace.jsonl)")
    p.add_argument("--requests", type=int, default=0, help="replay only the first N requests, 0 = all (default: 0)")
    p.add_argument("--budget-fraction", type=float, default=0.05,
                   help="KV bytes as a fraction of the trace's unique full-attention KV bytes (default: 0.05)")
    p.add_argument("--swa-share", type=float, default=0.3,
                   help="share of the budget for the SWA pool in the SWA-aware cache (default: 0.3)")
    p.add_argument("--page-size", type=int, default=128, help="full-pool page, tokens (default: 128)")
    p.add_argument("--chunk-size", type=int, default=8192, help="prefill chunk, tokens (default: 8192)")
    p.add_argument("--token-unit", type=int, default=128, help="tokens per simulated slot (default: 128)")
    p.add_argument("--evict-fraction", type=float, default=0.01,
                   help="evict at least this fraction of a pool at a time (default: 0.01)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI): the first 1000 requests")
