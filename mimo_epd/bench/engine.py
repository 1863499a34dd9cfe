"""`mimo-epd bench engine`: output tokens/s and TTFT of our engine vs transformers `generate`, same weights,
same requests, in one run.

Workload: `--requests` requests (default 64) all arriving at once, prompt lengths uniform in
[--min-prompt, --max-prompt] (random byte tokens, no shared prefixes), output lengths uniform in
[--min-output, --max-output]; every request generates exactly its output length (no EOS), greedy.

- `ours`: `llm_backend.LLM` (continuous batching, chunked prefill, dual KV pools, paged attention);
- `transformers`: what a user writes: the same weights in transformers' `MiMoV2FlashForCausalLM`, requests in
  arrival order in batches of `--hf-batch`, left-padded, `generate(max_new_tokens = the batch's longest)`;
  each request keeps its own number of tokens. Its TTFT is when its batch produced its first token.

Output tokens/s counts each request's requested tokens over the mode's wall time. `greedy_agreement` is the
fraction of requests whose tokens are identical in both (padding changes float rounding, so a rare argmax
near-tie may differ).
"""
from __future__ import annotations

import random
import time

import numpy as np
import torch

from llm_backend import LLM, SamplingParams
from llm_backend.models import load_llm, transformers_twin


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randrange(256) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.requests)]


def pct(xs, q) -> float:
    return round(float(np.percentile(np.array(xs) * 1000, q)), 2)


def run_ours(model, reqs, args) -> tuple[dict, list[list[int]]]:
    total = sum(len(p) + n for p, n in reqs)
    page_slack = len(reqs) * 2 * args.page_size + args.chunk_size  # partial pages + admission margin
    llm = LLM(model, kv_cache_tokens=total + page_slack, swa_cache_tokens=len(reqs) * (model.config.window + args.chunk_size + 32),
              chunk_size=args.chunk_size, max_running=args.max_running, page_size=args.page_size)
    t0 = time.monotonic()
    handles = [llm.add_request(p, SamplingParams(max_tokens=n)) for p, n in reqs]
    for h in handles:
        h.arrival = t0
    steps = 0
    while any(not h.finish_reason for h in handles):
        llm.step()
        steps += 1
    wall = time.monotonic() - t0
    bad = [h.finish_reason for h in handles if h.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"our engine finished requests with {bad[:3]}")
    ttft = [h.first_token_at - t0 for h in handles]
    out_tokens = sum(len(h.output) for h in handles)
    return {"seconds": round(wall, 3), "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / wall, 1),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "steps": steps,
            "preemptions": llm.preemptions}, [h.output for h in handles]


def run_transformers(model, reqs, args) -> tuple[dict, list[list[int]]]:
    from transformers import LogitsProcessor, LogitsProcessorList

    hf = transformers_twin(model)

    class FirstToken(LogitsProcessor):  # called once per generated position, right after its forward
        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = time.monotonic()
            return scores

    outputs, ttft = [], []
    t0 = time.monotonic()
    for b in range(0, len(reqs), args.hf_batch):
        batch = reqs[b:b + args.hf_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        steps = max(n for _, n in batch)
        first = FirstToken()
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, eos_token_id=None, pad_token_id=0,
                              logits_processor=LogitsProcessorList([first]))
        for i, (_, n) in enumerate(batch):
            outputs.append(gen[i, width:width + n].tolist())
            ttft.append(first.at - t0)
    wall = time.monotonic() - t0
    out_tokens = sum(n for _, n in reqs)
    return {"seconds": round(wall, 3), "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / wall, 1),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "batch_size": args.hf_batch}, outputs


def main(args) -> dict:
    if args.quick:
        args.requests, args.min_prompt, args.max_prompt, args.min_output, args.max_output = 6, 50, 300, 4, 12
    if not (1 <= args.min_prompt <= args.max_prompt and 1 <= args.min_output <= args.max_output and args.requests >= 1):
        raise SystemExit("need 1 <= --min-prompt <= --max-prompt, 1 <= --min-output <= --max-output, --requests >= 1")
    torch.manual_seed(0)
    model = load_llm("tiny")
    reqs = workload(args)
    ours, ours_tokens = run_ours(model, reqs, args)
    hf, hf_tokens = run_transformers(model, reqs, args)
    agree = sum(a == b for a, b in zip(ours_tokens, hf_tokens)) / len(reqs)
    ratio = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    return {
        "bench": "engine",
        "config": {"model": "tiny (8 layers: 2 full + 6 sliding window 128, 8 experts top-2, hidden 256)",
                   "device": "cpu", "torch_threads": torch.get_num_threads(), "requests": len(reqs),
                   "prompt_tokens": [args.min_prompt, args.max_prompt], "output_tokens": [args.min_output, args.max_output],
                   "total_prompt_tokens": sum(len(p) for p, _ in reqs),
                   "total_output_tokens": sum(n for _, n in reqs), "chunk_size": args.chunk_size,
                   "max_running": args.max_running, "page_size": args.page_size, "hf_batch": args.hf_batch,
                   "arrivals": "all at t=0", "decoding": "greedy, exactly the requested length"},
        "engines": {"ours": ours, "transformers": hf},
        "ratios": {"tokens_per_s": round(ratio, 3),
                   "ttft_p50": round(ours["ttft_p50_ms"] / hf["ttft_p50_ms"], 3),
                   "ttft_p90": round(ours["ttft_p90_ms"] / hf["ttft_p90_ms"], 3)},
        "greedy_agreement": round(agree, 3),
        "goal": "tokens_per_s >= 3",
        "goal_met": ratio >= 3,
    }


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=64, help="requests, all arriving at once (default: 64)")
    p.add_argument("--min-prompt", type=int, default=100, help="shortest prompt, tokens (default: 100)")
    p.add_argument("--max-prompt", type=int, default=2000, help="longest prompt, tokens (default: 2000)")
    p.add_argument("--min-output", type=int, default=16, help="shortest output, tokens (default: 16)")
    p.add_argument("--max-output", type=int, default=256, help="longest output, tokens (default: 256)")
    p.add_argument("--chunk-size", type=int, default=512, help="our prefill chunk, tokens (default: 512)")
    p.add_argument("--max-running", type=int, default=64, help="our requests running at once (default: 64)")
    p.add_argument("--page-size", type=int, default=16, help="our full-pool page, tokens (default: 16)")
    p.add_argument("--hf-batch", type=int, default=8,
                   help="transformers generate batch size (default: 8, its fastest of 4/8/16/64 here)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI)")
