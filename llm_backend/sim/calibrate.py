"""Timed steps of the real tiny model, the `cpu-measured` fit, and the live-vs-simulated validation.

`timed_run` runs waves of requests through a live `llm_backend.LLM` (the tiny model, real forwards) and records
every step: its segments (real tokens), the measured seconds of `runner.execute`, and each request's cached
tokens and output ids. A step's seconds are the CPU time of the thread that ran it, with torch on one thread
(the forward runs in the caller): on an idle core that is its wall time, and unlike wall time it does not grow
when other processes share the machine's cores (this one has two, shared by everyone). `calibrate` fits a `LinearProfile` on one workload and reports its error on a held-out one.
`validate` replays one live workload through a `SimWorker` with the same pools, chunk and page (unit 1, the live
outputs as the trace's tokens) and compares per-request cached tokens (must be equal) and step times (the
profile's predictions against the measured ones on that held-out workload).

A fitted profile describes the machine it was fitted on (a CPU of another model or clock, or another torch
build, shifts every coefficient), so `validate` can also calibrate where it runs (`calibrate_here`): it fits a
profile on this machine's timed steps of the training workload and reports the step-time error of both
profiles on the held-out live run, the committed one (`committed_profile`) and this machine's
(`this_machine`), plus whether the committed profile's recorded CPU is this one (`same_machine`: True, False,
or None when the profile does not say). `step_time_error` is then this machine's, the figure a simulation run
here should be judged by.
"""

from __future__ import annotations

import os
import platform
import random
import time
from pathlib import Path

import numpy as np

from .cost import CostModel, fit_linear, step_features
from .engine import SimWorker, WorkerConfig, simulate
from .shapes import get_shape
from .trace import SimRequest

LIVE = dict(
    kv_cache_tokens=6144, swa_cache_tokens=1024, page_size=16, chunk_size=256, max_running=8, release_interval=16
)


def workload(seed: int, waves: int = 6, per_wave: int = 8, max_prompt: int = 1200) -> list[list[tuple[list[int], int]]]:
    """Waves of (prompt ids, max_tokens): shared system prompts, multi-turn follow-ups (a previous prompt plus
    more) and fresh prompts, so there are hits, misses and, with the small pools, evictions and preemptions."""
    rng = random.Random(seed)
    systems = [[256] + [rng.randrange(256) for _ in range(rng.randrange(64, 400))] for _ in range(3)]
    history: list[list[int]] = []
    out = []
    for _ in range(waves):
        wave = []
        for _ in range(per_wave):
            kind = rng.random()
            if kind < 0.35 and history:
                base = rng.choice(history)
            elif kind < 0.75:
                base = rng.choice(systems)
            else:
                base = [256]
            p = base + [rng.randrange(256) for _ in range(rng.randrange(8, max(9, max_prompt - len(base))))]
            p = p[:max_prompt]
            history.append(p)
            wave.append((p, rng.randrange(4, 48)))
        out.append(wave)
    return out


def timed_run(waves, live=LIVE, threads: int = 1) -> dict:
    """Runs the waves through the live engine; every step's segments and measured seconds, per request its
    cached tokens and output ids."""
    import torch

    from ..engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM("tiny-random", **live)  # the `tiny` shape (TINY_LLM_CONFIG) the profile is fitted on
    steps: list[tuple[list[tuple[int, int, bool]], float]] = []
    inner = llm.runner.execute

    def timed(segments):
        segs = [(s.start, s.n, s.samples) for s in segments]
        t0 = time.thread_time()
        res = inner(segments)
        steps.append((segs, time.thread_time() - t0))
        return res

    llm.runner.execute = timed
    requests = []
    for wave in waves:
        reqs = [llm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=False)) for p, m in wave]
        while any(not r.finish_reason for r in reqs):
            llm.step()
        requests.extend(reqs)
    return {
        "steps": steps,
        "requests": [
            {"prompt": r.prompt, "output": r.output, "cached_tokens": r.cached_tokens, "finish_reason": r.finish_reason}
            for r in requests
        ],
        "preemptions": llm.preemptions,
        "threads": threads,
    }


def _errors(cost: CostModel, steps) -> dict:
    pred = np.array([cost.step_seconds(s) for s, _ in steps])
    meas = np.array([t for _, t in steps])
    rel = np.abs(pred - meas) / meas
    return {
        "steps": len(steps),
        "measured_s": round(float(meas.sum()), 4),
        "predicted_s": round(float(pred.sum()), 4),
        "total_error": round(float(abs(pred.sum() - meas.sum()) / meas.sum()), 4),
        "per_step_median_error": round(float(np.median(rel)), 4),
        "per_step_mean_error": round(float(rel.mean()), 4),
    }


def cpu_model() -> str:
    """This machine's CPU model name (Linux: /proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fit(seed: int, waves: int, warmup_steps: int, threads: int):
    """(profile, training steps): a warm-up run, then the fit on the workload of `seed`."""
    shape = get_shape("tiny")
    timed_run(workload(99, waves=1, per_wave=4), threads=threads)  # warm-up: allocator, kernels, caches
    train = timed_run(workload(seed, waves), threads=threads)["steps"][warmup_steps:]
    prof = fit_linear("cpu-measured", [step_features(shape, s) for s, _ in train], [t for _, t in train])
    prof.fitted_on = {
        "shape": "tiny",
        "machine": platform.machine(),
        "processor": platform.processor() or "",
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "train_steps": len(train),
        "created": time.strftime("%Y-%m-%d"),
    }
    return prof, train


def calibrate(seed: int = 1, holdout_seed: int = 2, waves: int = 6, warmup_steps: int = 5, threads: int = 1) -> tuple:
    """(profile, report): fit on the workload of `seed`, error on the held-out workload of `holdout_seed`."""
    prof, train = _fit(seed, waves, warmup_steps, threads)
    test = timed_run(workload(holdout_seed, waves), threads=threads)["steps"]
    cost = CostModel(get_shape("tiny"), prof)
    report = {"train": _errors(cost, train), "holdout": _errors(cost, test)}
    prof.fitted_on["holdout"] = report["holdout"]
    return prof, report


def _same_machine(profile) -> bool | None:
    cpu = getattr(profile, "fitted_on", {}).get("cpu")
    return None if not cpu else cpu == cpu_model()


def _both_ways(profile, here, train, train_seed: int, live_steps) -> dict:
    """Both profiles' step-time errors on the live run's steps (`here`: fitted on this machine's `train`)."""
    shape = get_shape("tiny")
    committed = _errors(CostModel(shape, profile), live_steps)
    own = _errors(CostModel(shape, here), live_steps)
    return {
        "committed_profile": {"name": profile.name, "fitted_on": getattr(profile, "fitted_on", {}), **committed},
        "this_machine": {"cpu": cpu_model(), "train_seed": train_seed, "train_steps": len(train), **own},
        "same_machine": _same_machine(profile),
        "measured_vs_committed_prediction": round(committed["measured_s"] / max(1e-9, committed["predicted_s"]), 4),
        "profile": here.to_json(),
    }


def validate(
    profile, seed: int = 3, waves: int = 6, threads: int = 1, calibrate_here: bool = False, train_seed: int = 1
) -> dict:
    """Live engine vs simulated worker on one workload (see the module docstring)."""
    shape = get_shape("tiny")
    fitted = _fit(train_seed, waves, 5, threads) if calibrate_here else None  # first: it warms the process up
    live = timed_run(workload(seed, waves), threads=threads)
    cost = CostModel(shape, profile)
    cfg = WorkerConfig(
        full_tokens=LIVE["kv_cache_tokens"],
        swa_tokens=LIVE["swa_cache_tokens"],
        page_size=LIVE["page_size"],
        chunk_size=LIVE["chunk_size"],
        max_running=LIVE["max_running"],
        release_interval=LIVE["release_interval"],
        unit=1,
    )
    worker = SimWorker(cost, cfg)
    # Each wave arrives when the previous one is done (far apart on the virtual clock), as the live run does.
    specs, k = [], 0
    per = [len(w) for w in workload(seed, waves)]
    for wi, n in enumerate(per):
        for _ in range(n):
            r = live["requests"][k]
            specs.append(SimRequest(k, wi * 1e6, r["prompt"], len(r["prompt"]), len(r["output"]), r["output"]))
            k += 1
    simulate(worker, specs)
    sim_cached = {f.index: f.cached_tokens for f in worker.finished}
    live_cached = [r["cached_tokens"] for r in live["requests"]]
    mismatches = [i for i, c in enumerate(live_cached) if sim_cached.get(i) != c]
    errs = _errors(cost, live["steps"])
    both = _both_ways(profile, *fitted, train_seed, live["steps"]) if fitted else None
    return {
        "cached_tokens_equal": not mismatches and len(sim_cached) == len(live_cached),
        "step_time_error": (both["this_machine"] if both else errs)["per_step_median_error"],
        "step_time_error_committed_profile": errs["per_step_median_error"],
        **({"calibration": both} if both else {"same_machine": _same_machine(profile)}),
        "requests": len(live_cached),
        "cached_tokens": {"live": sum(live_cached), "sim": sum(sim_cached.values())},
        "mismatched_requests": mismatches[:20],
        "steps": {"live": len(live["steps"]), "sim": worker.runner.steps},
        "preemptions": {"live": live["preemptions"], "sim": worker.scheduler.preemptions},
        "step_times": errs,
        "sim_busy_s": round(worker.runner.busy_s, 4),
        "config": {
            **LIVE,
            "model": "tiny-random",
            "workload_seed": seed,
            "waves": waves,
            "torch_threads": threads,
            "profile": profile.name,
        },
    }
