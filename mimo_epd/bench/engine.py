"""`mimo-epd bench engine`: output tokens/s, TTFT, end-to-end latency and peak memory of our engine vs
transformers on the same weights and the same requests, in one run.

Workload: `--requests` requests (default 64) all arriving at once, prompt lengths uniform in
[--min-prompt, --max-prompt] (random byte tokens, no shared prefixes), output lengths uniform in
[--min-output, --max-output]; every request generates exactly its output length, greedy: ours with
`ignore_eos=True`, transformers with EOS disabled and `min_new_tokens` (bench/peers/hf_engine.py).

- `ours`: `llm_backend.LLM` (continuous batching, chunked prefill, dual KV pools, paged attention);
- `transformers_continuous`: transformers' continuous batching with its paged cache (`generate_batch`'s
  manager), what a user would pick for many requests; when it cannot run this model the entry says why, with
  the peer's own error;
- `transformers_static_b8`, `transformers_static_b64`: `generate` over batches of 8 / 64 requests sorted by
  prompt length, left-padded, each batch decoded to its longest requested output.

Output tokens/s counts each request's requested tokens over the mode's wall time. Peak memory is the process's
RSS high-water mark during the mode (VmHWM, reset before each mode: `peak_rss_mb`) and its rise over the RSS
just before it (`rss_added_mb`).
`greedy_agreement` (per peer, and top level against the fastest transformers peer) is the fraction of requests
whose greedy tokens are identical (padding changes float rounding, so a rare argmax near-tie may differ).
"""

from __future__ import annotations

import dataclasses
import gc
import random
import sys
import time

import torch

from llm_backend import LLM, SamplingParams
from llm_backend.models import load_llm, transformers_twin
from mimo_epd.bench.peers import hf_engine
from mimo_epd.bench.peers.proc import PeakRss

_IGNORE_EOS = "ignore_eos" in {f.name for f in dataclasses.fields(SamplingParams)}


def log(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        (
            [rng.randrange(256) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
            rng.randint(args.min_output, args.max_output),
        )
        for _ in range(args.requests)
    ]


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True) if _IGNORE_EOS else SamplingParams(max_tokens=n)


def run_ours(model, reqs, args) -> tuple[dict, list[list[int]]]:
    total = sum(len(p) + n for p, n in reqs)
    page_slack = len(reqs) * 2 * args.page_size + args.chunk_size  # partial pages + admission margin
    llm = LLM(
        model,
        kv_cache_tokens=total + page_slack,
        swa_cache_tokens=len(reqs) * (model.config.window + args.chunk_size + 32),
        chunk_size=args.chunk_size,
        max_running=args.max_running,
        page_size=args.page_size,
    )
    done: dict[int, float] = {}
    t0 = time.perf_counter()
    handles = [
        llm.add_request(p, params(n), on_finish=lambda r: done.__setitem__(r.id, time.perf_counter())) for p, n in reqs
    ]
    m0 = time.monotonic()  # the engine stamps first_token_at with time.monotonic
    steps = 0
    while any(not h.finish_reason for h in handles):
        llm.step()
        steps += 1
    wall = time.perf_counter() - t0
    bad = [h.finish_reason for h in handles if h.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"our engine finished requests with {bad[:3]}")
    ttft = [h.first_token_at - m0 for h in handles]
    e2e = [done[h.id] - t0 for h in handles]
    stats = hf_engine.summarize(wall, sum(len(h.output) for h in handles), ttft, e2e)
    stats.update(steps=steps, preemptions=llm.preemptions)
    return stats, [h.output for h in handles]


def _drive(llm, submit) -> tuple[float, int]:
    """Runs `submit(step)` before every engine step (it adds requests, returns them); (seconds, tokens) once all
    submitted requests finished."""
    t0 = time.perf_counter()
    handles: list = []
    step = 0
    while True:
        handles += submit(step)
        if handles and all(h.finish_reason for h in handles):
            break
        llm.step()
        step += 1
    return time.perf_counter() - t0, sum(len(h.output) for h in handles)


def run_sampling(model, args) -> dict:
    """Sampling at batch 16 (issue #46's evidence): plain temperature-1 sampling, the same with the sampling
    controls on (presence, frequency and repetition penalties, a logit_bias of 8 entries), and `n = 4` (4 prompts,
    each prefilled once and sampled 4 times: the first sample's prompt cached before the other 3 start, as the
    server runs `n`) against the same 16 requests submitted at once as separate requests."""
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(256) for _ in range(args.sampling_prompt)] for _ in range(16)]
    out_n = args.sampling_output
    base = dict(max_tokens=out_n, ignore_eos=True, temperature=1.0)
    controls = dict(
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias=tuple((t, -2.0) for t in range(8)),
    )

    def fresh():
        return LLM(
            model,
            kv_cache_tokens=16 * (args.sampling_prompt + out_n) + 64 * args.page_size,
            swa_cache_tokens=16 * (model.config.window + args.chunk_size + 32),
            chunk_size=args.chunk_size,
            max_running=16,
            page_size=args.page_size,
        )

    def at_once(llm, sps):
        return _drive(llm, lambda step: [llm.add_request(p, sp) for p, sp in sps] if step == 0 else [])

    out: dict = {}
    for name, kw in (("plain_b16", {}), ("penalties_b16", controls)):
        sps = [(p, SamplingParams(seed=i, **base, **kw)) for i, p in enumerate(prompts)]
        sec, tok = at_once(fresh(), sps)
        out[name] = {"seconds": round(sec, 3), "output_tokens": tok, "tokens_per_s": round(tok / sec, 1)}
    four = prompts[:4]
    sec, tok = at_once(fresh(), [(p, SamplingParams(seed=j, **base)) for p in four for j in range(4)])
    out["four_requests_b16"] = {"seconds": round(sec, 3), "output_tokens": tok, "tokens_per_s": round(tok / sec, 1)}
    llm = fresh()
    firsts: list = []
    rest_sent = False

    def n4(step):
        nonlocal rest_sent
        if step == 0:
            firsts.extend(llm.add_request(p, SamplingParams(seed=0, **base)) for p in four)
            return list(firsts)
        if not rest_sent and all(f.output for f in firsts):  # every prompt cached: the other samples start
            rest_sent = True
            return [llm.add_request(p, SamplingParams(seed=j, **base)) for p in four for j in range(1, 4)]
        return []

    sec, tok = _drive(llm, n4)
    out["n4_b16"] = {
        "seconds": round(sec, 3),
        "output_tokens": tok,
        "tokens_per_s": round(tok / sec, 1),
        "prefix_hit_tokens": llm.stats()["prefix_hit_tokens"],
    }
    out["ratios"] = {
        "penalties_vs_plain_b16": round(out["penalties_b16"]["tokens_per_s"] / out["plain_b16"]["tokens_per_s"], 3),
        "n4_vs_four_requests": round(out["n4_b16"]["tokens_per_s"] / out["four_requests_b16"]["tokens_per_s"], 3),
    }
    log(f"sampling: {out['ratios']}")
    return out


def measured(name: str, fn, *a) -> tuple[dict, list | None]:
    """Runs one engine under an RSS sampler; a peer that cannot run becomes {"ran": false, "error": ...}."""
    gc.collect()
    try:
        with PeakRss() as rss:
            stats, outputs = fn(*a)
    except hf_engine.PeerFailed as e:
        log(f"{name}: could not run: {e}")
        return {"ran": False, "error": str(e)}, None
    stats.update(
        ran=True, peak_rss_mb=round(rss.peak / 2**20, 1), rss_added_mb=round((rss.peak - rss.before) / 2**20, 1)
    )
    log(
        f"{name}: {stats['output_tokens_per_s']} tok/s ttft_p50={stats['ttft_p50_ms']}ms "
        f"e2e_p90={stats['e2e_p90_ms']}ms peak_rss={stats['peak_rss_mb']}MB"
    )
    return stats, outputs


CONTINUOUS_WHY = (
    "transformers' paged cache (generation/continuous_batching/cache.py) sizes every layer's K and V "
    "pages with one head_dim (find_head_dim(config) = {head_dim}); MiMo-V2-Flash's V heads are "
    "v_head_dim = {v_head_dim}, so writing V into its page fails"
)


def main(args) -> dict:
    if args.quick:
        args.requests, args.min_prompt, args.max_prompt, args.min_output, args.max_output = 6, 50, 300, 4, 12
        args.threads = args.threads or 1  # a smoke on a shared machine: one thread is not slowed by busy cores
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (1 <= args.min_prompt <= args.max_prompt and 1 <= args.min_output <= args.max_output and args.requests >= 1):
        raise SystemExit("need 1 <= --min-prompt <= --max-prompt, 1 <= --min-output <= --max-output, --requests >= 1")
    import transformers

    torch.manual_seed(0)
    model = load_llm("tiny")
    reqs = workload(args)
    engines: dict = {}
    outputs: dict = {}
    engines["ours"], outputs["ours"] = measured("ours", run_ours, model, reqs, args)
    hf = transformers_twin(model)
    engines["transformers_continuous"], outputs["transformers_continuous"] = measured(
        "transformers_continuous", hf_engine.continuous, hf, reqs
    )
    if not engines["transformers_continuous"]["ran"]:
        hfd = model.config.to_hf_dict()
        err = engines["transformers_continuous"]["error"]
        if "slice shape" in err and hfd.get("v_head_dim") not in (None, hfd.get("head_dim")):
            engines["transformers_continuous"]["why"] = CONTINUOUS_WHY.format(
                head_dim=hfd.get("head_dim"), v_head_dim=hfd.get("v_head_dim")
            )
    for b in args.hf_batches:
        name = f"transformers_static_b{b}"
        engines[name], outputs[name] = measured(name, hf_engine.static, hf, reqs, b)
    sampling = run_sampling(model, args) if args.sampling_prompt else None
    ours = engines["ours"]
    peers = [k for k in engines if k != "ours" and engines[k]["ran"]]
    for k in peers:
        engines[k]["greedy_agreement"] = round(sum(a == b for a, b in zip(outputs["ours"], outputs[k])) / len(reqs), 3)
    best = max(peers, key=lambda k: engines[k]["output_tokens_per_s"])
    b = engines[best]
    return {
        "bench": "engine",
        "config": {
            "model": "tiny (the shipped trained model: 8 layers, 2 full + 6 sliding window 128, 8 experts top-2, hidden 256, vocabulary 4096)",
            "device": "cpu",
            "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__,
            "requests": len(reqs),
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "output_tokens": [args.min_output, args.max_output],
            "total_prompt_tokens": sum(len(p) for p, _ in reqs),
            "total_output_tokens": sum(n for _, n in reqs),
            "chunk_size": args.chunk_size,
            "max_running": args.max_running,
            "page_size": args.page_size,
            "hf_batches": list(args.hf_batches),
            "ignore_eos": _IGNORE_EOS,
            "arrivals": "all at t=0",
            "decoding": "greedy, exactly the requested length (EOS ignored by every engine)",
        },
        "engines": engines,
        "best_transformers": best,
        "ratios": {
            "tokens_per_s_vs_best_transformers": round(ours["output_tokens_per_s"] / b["output_tokens_per_s"], 3),
            "ttft_p50_vs_best_transformers": round(ours["ttft_p50_ms"] / b["ttft_p50_ms"], 3),
            "ttft_p90_vs_best_transformers": round(ours["ttft_p90_ms"] / b["ttft_p90_ms"], 3),
            "e2e_p90_vs_best_transformers": round(ours["e2e_p90_ms"] / b["e2e_p90_ms"], 3),
            "rss_added_vs_best_transformers": round(ours["rss_added_mb"] / b["rss_added_mb"], 3)
            if b["rss_added_mb"] > 0
            else None,
        },
        "greedy_agreement": b["greedy_agreement"],
        "sampling": sampling,
    }


def _batches(spec: str) -> list[int]:
    out = [int(x) for x in spec.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise ValueError("--hf-batches must be positive integers, comma-separated")
    return out


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=64, help="requests, all arriving at once (default: 64)")
    p.add_argument("--min-prompt", type=int, default=100, help="shortest prompt, tokens (default: 100)")
    p.add_argument("--max-prompt", type=int, default=2000, help="longest prompt, tokens (default: 2000)")
    p.add_argument("--min-output", type=int, default=16, help="shortest output, tokens (default: 16)")
    p.add_argument("--max-output", type=int, default=256, help="longest output, tokens (default: 256)")
    p.add_argument("--chunk-size", type=int, default=512, help="our prefill chunk, tokens (default: 512)")
    p.add_argument("--max-running", type=int, default=64, help="our requests running at once (default: 64)")
    p.add_argument("--page-size", type=int, default=16, help="our full-pool page, tokens (default: 16)")
    p.add_argument(
        "--hf-batches",
        type=_batches,
        default=[8, 64],
        help="transformers static batch sizes, comma-separated (default: 8,64)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument(
        "--sampling-prompt",
        type=int,
        default=256,
        help="prompt tokens of the sampling modes (plain, penalties, n = 4 at batch 16; 0 = not run; default: 256)",
    )
    p.add_argument("--sampling-output", type=int, default=64, help="output tokens of the sampling modes (default: 64)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for every engine (0 = torch's default; --quick: 1) (default: 0)",
    )
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI)")
