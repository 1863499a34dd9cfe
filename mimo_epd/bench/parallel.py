"""`mimo-epd bench parallel`: what tensor parallelism costs and gives on this machine, modes side by side
(`--sim`: the real shapes' deployments priced on the simulator instead, llm_backend/sim/parallel.py).

Modes (one engine each, the same requests, greedy, `ignore_eos`, the same total threads):
- `tp1`: one process, `--threads` torch threads (the reference: what a user of one device runs);
- `tp2`: two ranks (`--tensor-parallel-size 2`), `--threads / 2` threads each, gloo collectives over loopback;
- `tp2_ep`: the same with expert parallelism (each rank holds half the experts, whole);
- `dp2_ep`: data-parallel attention (`--data-parallel-size 2 --enable-expert-parallel`): two worker processes,
  `--threads / 2` threads each, each with half of the requests (alternate ones) and half of the experts; their MoE
  layers meet in rounds over gloo (llm_backend/parallel/data.py): each token sent to its experts' ranks and the sums
  sent back (all-to-all). Tokens/s is both ranks' tokens over the slower rank's wall time; TTFT over both ranks'
  requests; the collectives are DP rank 0's rounds;
- `dp2_ep_gather`: the same with `--data-parallel-dispatch all_gather` (every token to every rank, the sums
  all-reduced).

Workloads: batch 1 (requests one after another) and batch 16 (all arriving at once). Reported per mode and
workload: output tokens/s (output tokens over wall time), TTFT P50/P90 (from `add_request` to the first token's
callback) and, for the split modes, rank 0's collectives (calls per step, seconds and their share of the wall
time: where the time goes). Every mode's outputs are checked equal to `tp1`'s. On a CPU with two cores the split
cannot win much: a rank's GEMMs are half as big but so is its thread count, and each layer adds two all-reduces
over loopback TCP; on GPUs the same split buys memory (a model that does not fit one device) and bandwidth.
"""

from __future__ import annotations

import sys
import time

from mimo_epd.common.stats import percentile

MODES = {
    "tp1": dict(tensor_parallel_size=1),
    "tp2": dict(tensor_parallel_size=2),
    "tp2_ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dp2_ep": dict(data_parallel_size=2, enable_expert_parallel=True),
    "dp2_ep_gather": dict(data_parallel_size=2, enable_expert_parallel=True, data_parallel_dispatch="all_gather"),
}


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="the model (default: tiny, the shipped trained one)")
    p.add_argument("--requests-b1", type=int, default=8, help="requests of the batch-1 runs (default: 8)")
    p.add_argument("--requests-batch", type=int, default=32, help="requests of the batch-16 runs (default: 32)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default: 256)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in all, split over the ranks (default: 2)")
    p.add_argument("--modes", default="", help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    p.add_argument(
        "--sim",
        action="store_true",
        help="price the real shapes' deployments on the simulator instead (llm_backend/sim/parallel.py)",
    )
    p.add_argument("--sim-device", default="h200", choices=("h200", "h100"), help="device kind (default: h200)")
    p.add_argument("--sim-requests", type=int, default=300, help="requests per simulated deployment (default: 300)")
    p.add_argument("--sim-load", type=float, default=0.8, help="nominal load of the first deployment (default: 0.8)")


def log(msg: str) -> None:
    print(f"[bench parallel] {msg}", file=sys.stderr, flush=True)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, min(vocab, 4000), (length + (i % 8),), generator=g).tolist() for i in range(n)]


def run_workload(llm, batch: list[list[int]], params, concurrent: bool, waves_of: int = 0) -> dict:
    """Requests all at once (`concurrent`) or one after another; returns tokens/s, TTFTs and the outputs. A DP rank
    (`llm.data`) steps with the others (`generate` is collective) through `waves_of` waves, empty ones included."""
    firsts: dict[int, float] = {}
    starts: dict[int, float] = {}

    def on_token(r, token, logprob) -> None:
        firsts.setdefault(r.id, time.perf_counter())

    outputs, tokens = [], 0
    t0 = time.perf_counter()
    waves = [batch] if concurrent else [[p] for p in batch]
    waves += [[] for _ in range(waves_of - len(waves))]
    for wave in waves:
        reqs = []
        for p in wave:
            r = llm.add_request(p, params, on_token=on_token)
            starts[r.id] = time.perf_counter()
            reqs.append(r)
        if llm.data is not None:
            llm.generate(prompt_token_ids=[], sampling_params=params)
        while llm.has_work():
            llm.step()
        for r in reqs:
            if r.finish_reason == "error":
                raise SystemExit(f"request {r.id} failed: {r.error}")
            outputs.append(list(r.output))
            tokens += len(r.output)
    wall = time.perf_counter() - t0
    ttft = [firsts[i] - starts[i] for i in starts if i in firsts]
    return {
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_s": round(percentile(ttft, 50), 4),
        "ttft_p90_s": round(percentile(ttft, 90), 4),
        "wall_s": round(wall, 3),
        "_outputs": outputs,
        "_ttft": ttft,
        "_tokens": tokens,
    }


def run_mode(args, mode: str, workloads: dict) -> dict:
    import torch

    if "data_parallel_size" in MODES[mode]:
        return run_dp_mode(args, mode, workloads)
    from llm_backend import LLM, SamplingParams

    size = MODES[mode]["tensor_parallel_size"]
    threads = max(1, args.threads // size)
    torch.set_num_threads(threads)  # this process is rank 0; the other ranks take --torch-threads
    llm = LLM(
        args.model,
        kv_cache_tokens=32768,
        swa_cache_tokens=16384,
        max_running=16,
        torch_threads=threads,
        **MODES[mode],
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    out = {"threads_per_rank": threads}
    try:
        run_workload(llm, workloads["b1"][:1], SamplingParams(max_tokens=4, temperature=0), False)  # warm-up
        for key, batch in workloads.items():
            before = llm.stats()
            log(f"{mode} {key}")
            res = run_workload(llm, batch, params, concurrent=key != "b1")
            after = llm.stats()
            if size > 1:
                res.update(
                    collective_costs(before, after, res["wall_s"], "tp_collective_s", collective_calls="tp_collectives")
                )
            out[key] = res
    finally:
        llm.close()
    return out


def collective_costs(before: dict, after: dict, wall_s: float, seconds: str, **counts: str) -> dict:
    """A run's collective figures from the engine's stats before and after it: each of `counts` (reported name:
    stats key) as a difference, the seconds in collectives and their share of the wall time."""
    secs = after[seconds] - before[seconds]
    out = {name: after[key] - before[key] for name, key in counts.items()}
    return {**out, "collective_s": round(secs, 3), "collective_share_of_wall": round(secs / wall_s, 3)}


def run_dp_mode(args, mode: str, workloads: dict) -> dict:
    """Two DP ranks as spawned processes, alternate requests each; their results merged in the requests' order."""
    import multiprocessing as mp

    from llm_backend.parallel.replica import free_init_method

    size = MODES[mode]["data_parallel_size"]
    threads = max(1, args.threads // size)
    addr = free_init_method().removeprefix("tcp://")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    setup = dict(model=args.model, max_tokens=args.max_tokens, threads=threads, addr=addr, size=size, mode=mode)
    procs = [ctx.Process(target=dp_rank_main, args=(setup, r, workloads, queue), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=3600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    out: dict = {"threads_per_rank": threads}
    for key, batch in workloads.items():
        parts = [got[r][key] for r in range(size)]
        outputs: list = [None] * len(batch)
        for r, part in enumerate(parts):
            outputs[r::size] = part["_outputs"]
        wall = max(part["wall_s"] for part in parts)
        ttft = [t for part in parts for t in part["_ttft"]]
        out[key] = {
            "output_tokens_per_s": round(sum(part["_tokens"] for part in parts) / wall, 2),
            "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p90_s": round(percentile(ttft, 90), 4),
            "wall_s": wall,
            "_outputs": outputs,
            **{k: v for k, v in parts[0].items() if k.startswith(("collective", "dp_"))},
        }
    return out


def dp_rank_main(setup: dict, rank: int, workloads: dict, queue) -> None:
    """One DP rank of `run_dp_mode` (a spawned process): its share of each workload, with the others in lockstep."""
    import torch

    from llm_backend import LLM, SamplingParams

    torch.set_num_threads(setup["threads"])
    size = setup["size"]
    llm = LLM(
        setup["model"],
        kv_cache_tokens=32768,
        swa_cache_tokens=16384,
        max_running=16,
        torch_threads=setup["threads"],
        dist_init_addr=setup["addr"],
        data_parallel_rank=rank,
        **MODES[setup["mode"]],
    )
    params = SamplingParams(max_tokens=setup["max_tokens"], temperature=0, ignore_eos=True)
    out = {}
    try:
        run_workload(llm, workloads["b1"][:1], SamplingParams(max_tokens=4, temperature=0), False)  # warm-up
        for key, batch in workloads.items():
            mine = batch[rank::size]
            waves = 1 if key != "b1" else -(-len(batch) // size)
            before = llm.stats()
            res = run_workload(llm, mine, params, concurrent=key != "b1", waves_of=waves)
            after = llm.stats()
            counts = dict(collective_rounds="dp_rounds", dp_shadow_rounds="dp_shadow_rounds")
            res.update(collective_costs(before, after, res["wall_s"], "dp_collective_s", **counts))
            out[key] = res
    finally:
        llm.close()
    queue.put((rank, out))


def main(args) -> dict:
    if args.sim:
        from llm_backend.sim.parallel import simulate_modes

        return simulate_modes(args)
    import torch

    from llm_backend.models import model_config

    modes = list(MODES) if not args.modes else args.modes.split(",")
    if "tp1" not in modes:
        modes.insert(0, "tp1")  # the reference every output is checked against
    n1, nb = (2, 4) if args.quick else (args.requests_b1, args.requests_batch)
    length, max_tokens = (32, 8) if args.quick else (args.prompt_tokens, args.max_tokens)
    args.max_tokens = max_tokens
    vocab = model_config(args.model).vocab_size
    workloads = {"b1": prompts(n1, length, vocab), "b16": prompts(nb, length, vocab)}
    torch.set_num_threads(args.threads)
    results = {mode: run_mode(args, mode, workloads) for mode in modes}
    identical = all(results[m][k]["_outputs"] == results["tp1"][k]["_outputs"] for m in modes for k in workloads)
    for r in results.values():
        for k in workloads:
            for private in ("_outputs", "_ttft", "_tokens"):
                r[k].pop(private, None)
    ratios = {}
    for m in modes:
        if m == "tp1":
            continue
        for k in workloads:
            ratios[f"{m}_vs_tp1_tokens_per_s_{k}"] = round(
                results[m][k]["output_tokens_per_s"] / results["tp1"][k]["output_tokens_per_s"], 3
            )
            ratios[f"{m}_vs_tp1_ttft_p50_{k}"] = round(
                results[m][k]["ttft_p50_s"] / max(results["tp1"][k]["ttft_p50_s"], 1e-9), 3
            )
    return {
        "bench": "parallel",
        "model": args.model,
        "threads_total": args.threads,
        "prompt_tokens": length,
        "max_tokens": max_tokens,
        "requests": {"b1": n1, "b16": nb},
        "outputs_identical": identical,
        "modes": results,
        "ratios": ratios,
    }
