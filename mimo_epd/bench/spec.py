"""`mimo-epd bench spec`: MTP speculative decoding on the trained default model, every mode side by side.

Modes (one engine each, the same requests, the same greedy settings):
- `off`: plain decoding (the reference);
- `k1`, `k2`, `k3`: K draft tokens a step, draft step k with MTP layer k, prefill MTP on, drafting always on
  (`--speculative-auto` off: the raw effect of K);
- `k3_no_prefill_mtp`: K = 3 with the MTP layers seeing only generated tokens;
- `k3_first_layer`: K = 3 with MTP layer 1 reused for every draft step (the way vLLM runs MiMo: the peer);
- `k3_auto`: K = 3 with the measured on/off rule (engine/spec_control.py), what serving uses;
- `k3_auto_no_margin`: the same rule drafting whenever the fit says it saves anything (`--speculative-auto-margin 0`,
  the rule before the margin).

Workloads: batch 1 (requests one after another) and batch 16 (all arriving at once, 16 running), in the report's
two output-length buckets: 0-128 (greedy, at most 128 tokens, stopping at EOS like a user's request) and 128-256
(exactly 128 + 8 * (i mod 16) tokens for request i, `ignore_eos`: the small default model ends its turn after
about 40 tokens, so a bucket of long outputs has to be asked for; past its turn's end it keeps writing). Prompts
are chat turns rendered with the model's own template.

Reported per mode and workload: output tokens/s (output tokens over wall time), ITL P50/P90 (the gap between
consecutive tokens as a streaming client sees them: an accepted run arrives at once), TPOT (per request,
(last token - first token) / (tokens - 1)), mean accept length (tokens per verify step) and acceptance by draft
position, and whether every output equals `off` token for token. `--sim` prices the same modes for the Flash shape
on the h200 cost model instead (llm_backend/sim/speculation.py), with the acceptance profile measured here or
the model card's figure.
"""

from __future__ import annotations

import statistics
import sys
import time

from mimo_epd.common.stats import percentile

PROMPTS = [
    "How do I read a file line by line in Python?",
    "What does the with statement do?",
    "Explain list comprehensions with an example.",
    "What is the difference between a list and a tuple?",
    "How do I handle exceptions in Python?",
    "What is a generator function?",
    "How can I format a string with variables?",
    "What does the __init__ method do in a class?",
    "How do I sort a dictionary by its values?",
    "What is the purpose of the pathlib module?",
    "How do I run a function in a separate thread?",
    "Explain what a decorator is.",
    "How do I parse command line arguments?",
    "What is the difference between == and is?",
    "How do I write a unit test with unittest?",
    "What does the yield keyword do?",
]

MODES = {
    "off": dict(speculative_steps=0),
    "k1": dict(speculative_steps=1, speculative_auto=False),
    "k2": dict(speculative_steps=2, speculative_auto=False),
    "k3": dict(speculative_steps=3, speculative_auto=False),
    "k3_no_prefill_mtp": dict(speculative_steps=3, speculative_auto=False, prefill_mtp=False),
    "k3_first_layer": dict(speculative_steps=3, speculative_auto=False, speculative_layers="first"),
    "k3_auto": dict(speculative_steps=3, speculative_auto=True),
    "k3_auto_no_margin": dict(speculative_steps=3, speculative_auto=True, speculative_auto_margin=0.0),
}


def log(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def prompt_ids(model: str, n: int) -> list[list[int]]:
    from llm_backend.server.chat_template import load_chat_template
    from llm_backend.tokenizer import load_tokenizer

    tok, template = load_tokenizer(model), load_chat_template(model)
    out = []
    for i in range(n):
        text = template.render([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], add_generation_prompt=True)
        out.append(tok.encode(text, add_bos=False))
    return out


def _drive(llm, prompts: list[list[int]], params: list, batch: int, on_token) -> list:
    """Runs `prompts` (request i with `params[i]`) on `llm`, at most `batch` at a time; returns the requests."""
    reqs = []
    pending = list(zip(prompts, params))
    while pending or llm.has_work():
        while pending and len(llm.scheduler.running) + len(llm.scheduler.waiting) < batch:
            prompt, sp = pending.pop(0)
            reqs.append(llm.add_request(prompt, sp, on_token=on_token))
        llm.step()
    return reqs


def run_mode(
    model, opts: dict, prompts: list[list[int]], params: list, batch: int, threads: int, warm: bool = True
) -> dict:
    """One engine with `opts` runs `prompts` (request i with `params[i]`), at most `batch` at a time."""
    import torch

    from llm_backend import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, max_running=batch, kv_cache_tokens=32768, swa_cache_tokens=8192, **opts)
    # warm-up: one short request (allocations, the first kernels); with `warm`, the whole workload once more, so
    # the timed pass sees a server that has been running (the auto controller's fit measured, not exploring), then
    # the prefix cache is emptied so the timed pass computes every prompt
    llm.generate(prompt_token_ids=[prompts[0]], sampling_params=SamplingParams(max_tokens=4))
    if warm:
        _drive(llm, prompts, params, batch, None)
        llm.cache.evict_full(10**9)
        llm.cache.evict_swa(10**9)
    stamps: dict[int, list[float]] = {}

    def on_token(r, _tok, _lp):
        stamps.setdefault(r.id, []).append(time.perf_counter())

    start = time.perf_counter()
    reqs = _drive(llm, prompts, params, batch, on_token)
    wall = time.perf_counter() - start
    itl, tpot, ttft = [], [], []
    for r in reqs:
        ts = stamps.get(r.id, [])
        itl += [b - a for a, b in zip(ts, ts[1:])]
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
        if r.first_token_at:
            ttft.append(r.first_token_at - r.arrival)
    n_out = sum(len(r.output) for r in reqs)
    s = llm.stats()
    out = {
        "output_tokens": n_out,
        "mean_output_tokens": round(n_out / len(reqs), 1),
        "seconds": round(wall, 3),
        "tokens_per_s": round(n_out / wall, 2),
        "itl_ms": {"p50": round(percentile(itl, 50) * 1e3, 2), "p90": round(percentile(itl, 90) * 1e3, 2)},
        "ttft_ms": {"p50": round(percentile(ttft, 50) * 1e3, 2), "p90": round(percentile(ttft, 90) * 1e3, 2)},
        "tpot_ms": {"p50": round(percentile(tpot, 50) * 1e3, 2), "mean": round(statistics.fmean(tpot) * 1e3, 2)}
        if tpot
        else {},
    }
    if opts.get("speculative_steps"):
        out.update(
            mean_accept_length=s["spec_mean_accept_length"],
            acceptance_by_position=s["spec_acceptance_by_position"],
            verify_steps=s["spec_verify_steps"],
        )
        if opts.get("speculative_auto"):
            out["control"] = s["spec_control"]
    out["_outputs"] = [list(r.output) for r in reqs]
    return out


def main(args) -> dict:
    if args.sim:
        from llm_backend.sim.speculation import simulate_modes

        return simulate_modes(args)
    from llm_backend.models import load_llm

    model = load_llm(args.model)
    if getattr(model.model, "mtp", None) is None:
        raise SystemExit(f"model {args.model!r} has no MTP layers: speculative decoding cannot run")
    quick = args.quick
    workloads = [(b, bucket) for b in (1, 16) for bucket in ("0_128", "128_256")]
    if quick:
        workloads = [(1, "quick"), (4, "quick")]
        args.threads = 1  # a smoke on a shared machine: one thread is not slowed by busy cores
    modes = list(MODES) if not args.modes else args.modes.split(",")
    warm = not (args.no_warm or quick)  # a smoke run checks the modes, it measures nothing
    results: dict[str, dict] = {}
    requests: dict[str, int] = {}
    spreads: list[dict] = []
    identical = True
    for batch, bucket in workloads:
        n = args.requests_b1 if batch == 1 else args.requests_batch
        if quick:
            n = 2 if batch == 1 else 4
        prompts = prompt_ids(args.model, n)
        params = [bucket_params(bucket, i) for i in range(n)]
        key = f"b{batch}_{bucket}"
        requests[key] = n
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for rep in range(args.repeats):  # modes interleaved: a slow phase of the machine hits all of them
            for mode in modes:
                log(f"{key} {mode}" + (f" (run {rep + 1} of {args.repeats})" if args.repeats > 1 else ""))
                runs[mode].append(run_mode(model, MODES[mode], prompts, params, batch, args.threads, warm))
        ref = runs["off"][0]["_outputs"] if "off" in runs else None
        for mode_runs in runs.values():
            for r in mode_runs:
                identical &= ref is not None and r["_outputs"] == ref
        results[key] = {mode: _median_run(mode_runs, ref) for mode, mode_runs in runs.items()}
        spreads.append(_paired_spread(key, runs))
    ratios = _ratios(results)
    k3 = [r["k3"]["mean_accept_length"] for r in results.values() if "k3" in r]
    return {
        "bench": "spec",
        "config": {
            "model": args.model,
            "threads": args.threads,
            "workloads": {k: {"requests": n, "batch": int(k[1:].split("_")[0])} for k, n in requests.items()},
            "greedy": True,
            "warm_pass": warm,
            "itl": "time between consecutive tokens as a client sees them (an accepted run arrives at once)",
        },
        "modes": results,
        "greedy_identical": identical,
        "accept_length_k3": round(statistics.fmean(k3), 4) if k3 else None,
        "ratios": ratios,
        **({"ratios_range": {k: v for d in spreads for k, v in d.items()}} if args.repeats > 1 else {}),
    }


def bucket_params(bucket: str, i: int):
    """Request i's sampling settings in an output-length bucket (the module docstring)."""
    from llm_backend import SamplingParams

    if bucket == "128_256":
        return SamplingParams(max_tokens=128 + 8 * (i % 16), ignore_eos=True)
    return SamplingParams(max_tokens=16 if bucket == "quick" else 128)


def _median_run(runs: list[dict], ref) -> dict:
    """The run with the median tokens/s (all its figures from that one run), with every run's tokens/s."""
    order = sorted(runs, key=lambda r: r["tokens_per_s"])
    out = dict(order[(len(order) - 1) // 2])
    out["outputs_equal_off"] = ref is not None and all(r["_outputs"] == ref for r in runs)
    if len(runs) > 1:
        out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    out.pop("_outputs")
    return out


def _paired_spread(key: str, runs: dict[str, list[dict]]) -> dict:
    """[min, max] over repetitions of each mode's tokens/s over `off`'s in the same repetition."""
    if "off" not in runs or len(runs["off"]) < 2:
        return {}
    out = {}
    for mode in ("k3", "k3_auto", "k3_auto_no_margin"):
        if mode in runs:
            paired = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(runs[mode], runs["off"])]
            out[f"speedup_{mode}_{key}"] = [round(min(paired), 3), round(max(paired), 3)]
    return out


def _ratios(results: dict) -> dict:
    def tps(key: str, mode: str):
        r = results.get(key, {}).get(mode)
        return r["tokens_per_s"] if r else None

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    out = {}
    for key in results:
        tag = key  # b1_0_128, ...
        out[f"speedup_k3_{tag}"] = ratio(tps(key, "k3"), tps(key, "off"))
        out[f"speedup_k3_auto_{tag}"] = ratio(tps(key, "k3_auto"), tps(key, "off"))
        out[f"speedup_k3_auto_no_margin_{tag}"] = ratio(tps(key, "k3_auto_no_margin"), tps(key, "off"))
        out[f"prefill_mtp_vs_without_{tag}"] = ratio(tps(key, "k3"), tps(key, "k3_no_prefill_mtp"))
        out[f"all_layers_vs_one_reused_{tag}"] = ratio(tps(key, "k3"), tps(key, "k3_first_layer"))
    if "b1_0_128" in results:
        out["prefill_mtp_vs_without_0_128"] = out["prefill_mtp_vs_without_b1_0_128"]
        out["all_layers_vs_one_reused"] = out["all_layers_vs_one_reused_b1_0_128"]
    return {k: v for k, v in out.items() if v is not None}


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="a model with MTP layers (default: tiny, the shipped one)")
    p.add_argument("--modes", default="", help=f"comma-separated subset of {', '.join(MODES)} (default: all)")
    p.add_argument("--requests-b1", type=int, default=16, help="requests of the batch-1 workloads (default: 16)")
    p.add_argument("--requests-batch", type=int, default=32, help="requests of the batch-16 workloads (default: 32)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every mode, interleaved; each mode reports its median run, `ratios_range` the paired "
        "spread (default: 1)",
    )
    p.add_argument(
        "--no-warm",
        action="store_true",
        help="time each mode's first pass over the workload (default: one untimed pass first, the prefix cache "
        "emptied after it: the auto controller has measured, as in a server that has been running; --quick "
        "never warms)",
    )
    p.add_argument("--sim", action="store_true", help="price the modes on the simulator's cost model instead")
    p.add_argument("--shape", default="flash", choices=("flash", "pro"), help="--sim: model shape (default: flash)")
    p.add_argument(
        "--accept-profile",
        default="",
        help="--sim: JSON of acceptance by draft position per mode (a `bench spec` output); default: the model "
        "card's accept length 3.08 for 3 MTP layers",
    )
