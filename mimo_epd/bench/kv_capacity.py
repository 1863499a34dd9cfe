"""`mimo-epd bench kv`: how many concurrent sequences fit in a fixed KV byte budget, hybrid dual pool vs one
full pool for all layers, for the MiMo-V2.5-Pro shape (docs/llm.md) at several context lengths.

Both layouts allocate through the engine's own allocator: `KVPools` sizes the tensors (on the `meta` device,
so terabyte budgets cost no memory; their `nbytes` is checked against the budget), `SlotPool` hands out
full-pool pages and SWA slots, and each sequence is a `RequestKV` that prefills its context in chunks,
releasing the SWA slots of tokens that left the window after each chunk, exactly as the engine does.
Sequences are added until the next one cannot get its slots; that count is the capacity.

- `prefill` figure: every held sequence has just been released to its last W tokens (the theoretical
  ratio `70L / (10L + 60·min(L, W))` assumes this);
- `decode` figure: every held sequence is in decode and holds W + release_interval SWA slots (the worst
  moment, just before its next release), against `70L / (10L + 60·min(L, W + N))`.

Hybrid pools are sized for the context, as an operator sizes them for a workload (the SWA pool holds W (+N)
slots per sequence plus one prefill chunk in flight, the full pool the rest); `--swa-share` fixes the SWA
pool's share of the bytes instead. Token counts are simulated in units of `--token-unit` tokens: the
window, chunk, release interval and page size are multiples of it, so every count is exactly what a
token-level run gives, at a fraction of the bookkeeping.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from llm_backend.kv import PoolExhausted, RequestKV
from llm_backend.kv.build import KVLayout, build_kv
from llm_backend.models import PRO_SHAPE_CONFIG
from llm_backend.paged_attention import KVPools

NEVER_RELEASE = 1 << 60  # a "window" no token ever leaves: full KV for every layer


def token_bytes(cfg, sliding: bool, dtype_bytes: int) -> int:
    """KV bytes one token takes in all layers of one type."""
    return sum(
        cfg.kv_heads(i) * (cfg.head_dim + cfg.v_head_dim) * dtype_bytes
        for i, kind in enumerate(cfg.layer_types)
        if (kind == "sliding_attention") == sliding
    )


def theoretical_ratio(cfg, context: int, swa_tokens: int) -> float:
    full = sum(k == "full_attention" for k in cfg.layer_types)
    swa = len(cfg.layer_types) - full
    return len(cfg.layer_types) * context / (full * context + swa * min(context, swa_tokens))


def count_sequences(
    cfg,
    budget: int,
    context: int,
    *,
    hybrid: bool,
    unit: int,
    page: int,
    chunk: int,
    release_interval: int,
    decode: bool,
    swa_share: float | None,
    dtype: torch.dtype,
) -> dict:
    """Sizes the pools within `budget` bytes and adds sequences of `context` tokens until one does not fit."""
    esz = torch.tensor([], dtype=dtype).element_size()
    window = cfg.window
    if not hybrid:  # one full pool for every layer
        cfg = replace(cfg, layer_types=["full_attention"] * cfg.num_hidden_layers)
    full_b, swa_b = token_bytes(cfg, False, esz), token_bytes(cfg, True, esz)
    per_seq_full = math.ceil(context / page) * page
    if hybrid:
        held = min(context, window + (release_interval if decode else 0))
        if swa_share is None:
            n = (budget - (window + chunk) * swa_b) // (per_seq_full * full_b + held * swa_b)
            swa_slots = n * held + chunk + window
        else:
            swa_slots = int(budget * swa_share) // swa_b
        full_slots = (budget - swa_slots * swa_b) // full_b
    else:
        full_slots, swa_slots = budget // full_b, 0
    full_slots -= full_slots % page
    pools = KVPools(cfg, full_slots, swa_slots, dtype, "meta")  # the engine's tensors, without memory
    if pools.nbytes() > budget:
        raise AssertionError(f"pools take {pools.nbytes()} bytes, over the budget {budget}")
    u = unit
    # Full-only: no sliding layer, so no SWA bytes; its "SWA" bookkeeping mirrors the full pool and never releases.
    kv = build_kv(
        KVLayout(
            full_slots // u,
            swa_slots // u if hybrid else full_slots // u,
            page // u,
            window // u if hybrid else NEVER_RELEASE,
        )
    )
    cache = kv.cache
    held_kv = []
    ctx, step = context // u, chunk // u
    prefill = ctx - (release_interval // u if decode else 0)
    try:
        while True:
            kv = RequestKV(cache, [], NEVER_RELEASE)
            held_kv.append(kv)
            done = 0
            while done < prefill:  # chunked prefill, releasing after every chunk (engine.LLM._finish_step)
                n = min(step, prefill - done)
                kv.extend([0] * n)
                kv.release_out_of_window()
                done += n
            for _ in range(ctx - prefill):  # decode, one token at a time, no release until the interval ends
                kv.extend([0])
    except PoolExhausted:
        held_kv.pop().finish(cache_result=False)
    return {
        "seqs": len(held_kv),
        "full_pool_tokens": full_slots,
        "swa_pool_tokens": swa_slots,
        "pool_bytes": pools.nbytes(),
        "swa_bytes_share": round(swa_slots * swa_b / max(pools.nbytes(), 1), 4),
    }


def parse_context(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KM" else s) * mult


def main(args) -> dict:
    cfg = PRO_SHAPE_CONFIG
    dtype = getattr(torch, args.dtype)
    contexts = [parse_context(c) for c in args.contexts.split(",")]
    if args.quick:
        contexts, args.full_seqs_at_longest = contexts[:2], 8
    for name, v in (
        ("chunk", args.chunk_size),
        ("page", args.page_size),
        ("release interval", args.release_interval),
        ("window", cfg.window),
    ):
        if v % args.token_unit:
            raise SystemExit(f"--token-unit {args.token_unit} must divide the {name} ({v})")
    esz = torch.tensor([], dtype=dtype).element_size()
    all_full_b = token_bytes(replace(cfg, layer_types=["full_attention"] * 70), False, esz)
    # One fixed budget for every context: what one full-attention-only pool needs for N sequences at the longest
    # context (so the baseline count is never tiny and the ratio is not rounding noise).
    budget = int(args.budget_gib * 2**30) if args.budget_gib else args.full_seqs_at_longest * max(contexts) * all_full_b
    t0 = time.perf_counter()
    rows = []
    for L in contexts:
        if L % args.token_unit:
            raise SystemExit(f"context {L} is not a multiple of --token-unit {args.token_unit}")
        row = {"context": L}
        for fig, decode in (("prefill", False), ("decode", True)):
            kw = dict(
                unit=args.token_unit,
                page=args.page_size,
                chunk=args.chunk_size,
                release_interval=args.release_interval,
                decode=decode,
                swa_share=args.swa_share,
                dtype=dtype,
            )
            hyb = count_sequences(cfg, budget, L, hybrid=True, **kw)
            full = count_sequences(cfg, budget, L, hybrid=False, **kw)
            measured = hyb["seqs"] / max(full["seqs"], 1)
            theory = theoretical_ratio(cfg, L, cfg.window + (args.release_interval if decode else 0))
            fig_row = {
                "seqs_hybrid": hyb["seqs"],
                "seqs_full": full["seqs"],
                "measured_ratio": round(measured, 4),
                "theoretical_ratio": round(theory, 4),
                "fraction_of_theoretical": round(measured / theory, 4),
                "hybrid_pools": {k: hyb[k] for k in ("full_pool_tokens", "swa_pool_tokens", "swa_bytes_share")},
            }
            if fig == "prefill":
                row.update(fig_row)
            else:
                row["decode"] = fig_row
        rows.append(row)
    return {
        "bench": "kv",
        "config": {
            "shape": "MiMo-V2.5-Pro (70 layers, full at 0,7,15,23,31,39,47,55,62,69; 8 KV heads; "
            "head dims 192/128; window 128)",
            "dtype": args.dtype,
            "budget_bytes": budget,
            "budget_gib": round(budget / 2**30, 1),
            "budget_rule": (
                f"--budget-gib {args.budget_gib}"
                if args.budget_gib
                else f"the bytes one full-only pool needs for {args.full_seqs_at_longest} sequences "
                f"at {max(contexts)} tokens, the same for every context"
            ),
            "tensors": "meta device (sized, not allocated)",
            "page_size": args.page_size,
            "chunk_size": args.chunk_size,
            "release_interval": args.release_interval,
            "token_unit": args.token_unit,
            "swa_pool_sizing": "auto (W(+N) per sequence + one chunk)"
            if args.swa_share is None
            else f"--swa-share {args.swa_share}",
        },
        "contexts": rows,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def add_arguments(p) -> None:
    p.add_argument("--contexts", default="8K,32K,128K,1M", help="context lengths (default: 8K,32K,128K,1M)")
    p.add_argument(
        "--budget-gib",
        type=float,
        default=0.0,
        help="KV byte budget in GiB (0 = enough for --full-seqs-at-longest full-only sequences) (default: 0)",
    )
    p.add_argument(
        "--full-seqs-at-longest",
        type=int,
        default=16,
        help="with --budget-gib 0: full-only sequences the budget holds at the longest context (default: 16)",
    )
    p.add_argument("--dtype", default="bfloat16", help="KV dtype (default: bfloat16)")
    p.add_argument("--page-size", type=int, default=64, help="full-pool page, tokens (default: 64)")
    p.add_argument("--chunk-size", type=int, default=8192, help="prefill chunk, tokens (default: 8192)")
    p.add_argument("--release-interval", type=int, default=16, help="decode steps between SWA releases (default: 16)")
    p.add_argument(
        "--swa-share",
        type=float,
        default=None,
        help="fixed share of the bytes for the SWA pool (default: sized for each context)",
    )
    p.add_argument("--token-unit", type=int, default=16, help="tokens per simulated slot (default: 16)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI)")
