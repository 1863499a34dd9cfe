"""`mimo-epd bench <name>`: benchmarks, each printing one JSON object (mimo_epd/bench/)."""

from __future__ import annotations

import json
from importlib import import_module

# (command, module under mimo_epd.bench, help). A benchmark module has add_arguments(parser) and
# main(args) -> dict; it is imported only when its command runs (they import torch at module level).
BENCHMARKS = (
    ("cache-routing", "cache_routing", "cache hit rates: round-robin vs consistent hashing, private vs shared cache"),
    ("video", "video", "a long video: naive vs parallel vs the decode floor, and worker scaling"),
    ("audio", "audio", "a long audio file: ours vs the transformers path (outputs checked equal); clips under load"),
    (
        "encoder",
        "encoder",
        "encoder QPS/latency: naive vs pipelined vs real peers (model-card path per request and batched)",
    ),
    (
        "load",
        "load",
        "loading a released-layout checkpoint: GB/s vs reading the files, peak RSS, FP8 vs bf16 resident and tokens/s",
    ),
    ("kv", "kv_capacity", "KV capacity: concurrent sequences in a byte budget, hybrid dual pool vs full-only"),
    ("prefix-cache", "prefix_cache", "prefix-cache hit tokens on a real trace: SWA-aware vs full-KV vs unbounded"),
    ("engine", "engine", "LLM engine output tokens/s and TTFT vs transformers (continuous and static batching)"),
    ("shm-index", "shm_index", "shm cache lookups (hit, miss) at 1K / 100K / 1M entries: the hash index vs a key scan"),
    ("scheduler", "scheduler", "simulated wait-queue policies, long-context mix: TTFT vs FCFS, intervals, 60-90%"),
    ("routing", "routing", "simulated fleet on the Mooncake trace: every routing policy, 8/32 workers, 60-90% load"),
    (
        "tier-ttft",
        "tier_ttft",
        "simulated fleet with KV tiers: TTFT with host/store loads at PCIe/network bandwidth vs recompute",
    ),
    ("routing-live", "routing_live", "live LLM workers: every routing policy and SGLang's gateway on multi-turn chat"),
    (
        "pd",
        "pd",
        "simulated prefill/decode disaggregation: colocated N vs every P:D split, goodput under TTFT/TPOT SLOs",
    ),
    ("pd-live", "pd_live", "live prefill/decode disaggregation: 2 colocated workers vs 1 prefill + 1 decode"),
    (
        "spec",
        "spec",
        "MTP speculative decoding: off vs K = 1-3, without prefill MTP, one MTP layer reused (--sim: h200)",
    ),
    (
        "parallel",
        "parallel",
        "tensor / expert parallelism on this machine: TP 2 (two ranks) vs one process, batch 1 and 16",
    ),
    (
        "structured",
        "structured",
        "grammar-constrained decoding (xgrammar): unconstrained vs json_schema vs regex, batch 1 and 16",
    ),
)


def _module(name: str):
    return import_module(f"mimo_epd.bench.{name}")


def _runner(name: str):
    def run(args) -> int:
        out = _module(name).main(args)
        out.setdefault("machine", import_module("mimo_epd.bench.machine").machine_facts())  # every bench says where
        print(json.dumps(out))  # one JSON object on stdout
        return 0

    return run


def register(commands) -> None:
    bench = commands.group("bench", "benchmarks; each prints one JSON object", dest="bench")
    for command, module, help_text in BENCHMARKS:
        bench.command(command, help_text, setup=lambda p, m=module: _module(m).add_arguments(p), run=_runner(module))
