"""`mimo-epd bench load`: loading a released-layout checkpoint, and what FP8 residency costs and saves.

One checkpoint written by `make-checkpoint` (V2.5 layout: fused pre-split QKV, sharded, with an index) in FP8 and
its bf16 twin (the same seed, so the same shapes). Each mode loads in a fresh process (peak RSS is that process's
VmHWM over its RSS before the load, so imports do not count), then decodes greedily at batch 1:

- `read`: the files read start to end into one reused buffer (the disk / page-cache limit the loader is held to);
- `fp8_kept`: the FP8 checkpoint, FP8 resident (dequantized per GEMM on this CPU), serving dtype bf16;
- `fp8_dequantized`: the same files dequantized once at load into bf16 (`--fp8-weights dequantize`);
- `bf16`: the bf16 twin, bf16 resident.

Every load reads warm files (each is read once before the timed modes), so GB/s compares the loader with the page
cache, not with the disk. Ratios: `load_gbps_vs_read` (the FP8 load's stored bytes per second over plain reading),
`peak_rss_vs_resident` (FP8 load), `resident_fp8_vs_bf16`, `tokens_per_s_fp8_vs_bf16`,
`tokens_per_s_fp8_dequantized_vs_kept` (the CPU default's cost: docs/model.md says which is the default and why).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time


def add_arguments(p) -> None:
    p.add_argument("--dir", default="", help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument(
        "--scale", choices=("tiny", "small"), default="small", help="make-checkpoint --scale (default: small)"
    )
    p.add_argument("--like", default="v2.5", help="make-checkpoint --like (default: v2.5)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length before decoding (default: 64)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens decoded per mode (default: 32)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0 = torch's default)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (CI): tiny scale, 8 tokens")


def _status_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process (VmHWM starts afresh at exec; ru_maxrss would carry the parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(kind: str, path: str, prompt: int, decode: int, threads: int, q) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from llm_backend.models import load_llm
    from llm_backend.paged_attention import ContiguousKV

    base = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    if kind == "read":
        buf = bytearray(64 << 20)
        n = 0
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                with open(os.path.join(path, f), "rb", buffering=0) as fh:
                    while k := fh.readinto(buf):
                        n += k
        q.put({"seconds": time.perf_counter() - t0, "bytes": n})
        return
    model = load_llm(path, dtype=torch.bfloat16, fp8_weights="dequantize" if kind == "fp8_dequantized" else "keep")
    load_s = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    resident = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    ids = torch.randint(9, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    kv, out = ContiguousKV(model.config), []
    t1 = time.perf_counter()
    logits = model(ids, torch.arange(prompt), kv, logits_for="last")
    prefill_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    for _ in range(decode):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = model(torch.tensor([tok]), torch.tensor([kv.length]), kv, logits_for="last")
    decode_s = time.perf_counter() - t2
    q.put(
        {
            "load_s": round(load_s, 3),
            "resident_bytes": resident,
            "peak_rss_over_base_bytes": peak - base,
            "prefill_s": round(prefill_s, 3),
            "tokens_per_s": round(decode / decode_s, 2),
            "tokens": out,
        }
    )


def _run(kind: str, path: str, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(kind, path, args.prompt_tokens, args.decode_tokens, args.threads, q))
    p.start()
    result = q.get(timeout=1800)
    p.join()
    return result


def _stored(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def main(args) -> dict:
    from llm_backend.models.make_checkpoint import write_checkpoint

    if args.quick:
        args.scale, args.decode_tokens, args.prompt_tokens = "tiny", 8, 16
    root = args.dir or tempfile.mkdtemp(prefix="mimo-bench-load-")
    paths = {}
    for weights in ("fp8", "bf16"):
        d = os.path.join(root, f"{args.like}-{args.scale}-{weights}")
        if not os.path.isfile(os.path.join(d, "config.json")):
            write_checkpoint(d, args.like, weights, args.scale)
        paths[weights] = d
        _run("read", d, args)  # warm the page cache: every timed mode reads warm files
    read = _run("read", paths["fp8"], args)
    modes = {
        "fp8_kept": _run("fp8_kept", paths["fp8"], args),
        "fp8_dequantized": _run("fp8_dequantized", paths["fp8"], args),
        "bf16": _run("bf16", paths["bf16"], args),
    }
    stored = _stored(paths["fp8"])
    read_gbps = read["bytes"] / read["seconds"] / 1e9
    kept = modes["fp8_kept"]
    kept["load_gbps"] = round(stored / kept["load_s"] / 1e9, 3)
    modes["fp8_dequantized"]["load_gbps"] = round(stored / modes["fp8_dequantized"]["load_s"] / 1e9, 3)
    modes["bf16"]["load_gbps"] = round(_stored(paths["bf16"]) / modes["bf16"]["load_s"] / 1e9, 3)
    outputs_match = kept["tokens"] == modes["fp8_dequantized"]["tokens"]
    for m in modes.values():
        m.pop("tokens")
    return {
        "checkpoint": {
            "like": args.like,
            "scale": args.scale,
            "fp8_bytes": stored,
            "bf16_bytes": _stored(paths["bf16"]),
        },
        "read": {"seconds": round(read["seconds"], 3), "gbps": round(read_gbps, 3)},
        "modes": modes,
        "fp8_kept_equals_dequantized_tokens": outputs_match,
        "ratios": {
            "load_gbps_vs_read": round(kept["load_gbps"] / read_gbps, 3),
            "peak_rss_vs_resident": round(kept["peak_rss_over_base_bytes"] / kept["resident_bytes"], 3),
            "resident_fp8_vs_bf16": round(kept["resident_bytes"] / modes["bf16"]["resident_bytes"], 3),
            "tokens_per_s_fp8_vs_bf16": round(kept["tokens_per_s"] / modes["bf16"]["tokens_per_s"], 3),
            "tokens_per_s_fp8_dequantized_vs_kept": round(
                modes["fp8_dequantized"]["tokens_per_s"] / kept["tokens_per_s"], 3
            ),
        },
    }
