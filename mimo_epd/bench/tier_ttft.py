"""`mimo-epd bench tier-ttft`: what the KV tiers do to TTFT, in the fleet simulator (mimo_epd/sim) on the
Mooncake conversation trace — a hit loaded from the host at PCIe bandwidth or from the shared store at network
bandwidth, against recomputing the miss.

Every run is the same fleet (`--workers` simulated workers, the engine's own scheduler and SWA radix cache,
the router's real policy over a real page-hash index) at `--load` nominal load, under `round_robin` and
`affinity` routing, in four modes:

- `recompute`: device pools only; what the pools lost is prefilled again;
- `tiers`: plus a host tier of `--host-factor` x the device KV bytes per worker and one shared store of
  `--store-factor` x a worker's device bytes (written at insert), loads priced by llm_backend/sim/tiers.py at
  `--pcie-gbps` per GPU and `--store-gbps` per worker, overlapped layer by layer with the forward;
- `tiers_no_overlap`: the same with the copies before the forward (step = compute + load);
- `tiers_free`: the same with free copies (infinite bandwidth): the bound no load path can beat;
- `tiers_<store>` (with `--kv-store`, e.g. `local` for a throwaway redis-server and mooncake_master): `tiers`
  with the store's reads priced at that real store's transport as measured here (mimo_epd/bench/store_probe.py:
  read bytes per second of 1 MiB values, plus one lookup's P50 per step that reads the store), side by side;
  ratios `<policy>_ttft_p90_<store>_vs_<first store>`.

Reports per (policy, mode) TTFT P50/P90/P99, end-to-end P90, hit tokens (per tier for the tiered modes), the
loads' bytes and exposed seconds, throughput; ratios of TTFT P90 and hit tokens of `tiers` vs `recompute` per
policy, and of round-robin's hit tokens vs affinity's with and without tiers.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from llm_backend.sim.load import scale_to_load
from llm_backend.sim.tiers import TierLinks
from mimo_epd.sim.fleet import run_fleet
from mimo_epd.sim.setup import DEFAULT_GPUS, add_model_flags, add_trace_flags, build, describe
from mimo_epd.sim.traces import mooncake_requests

POLICIES = ("round_robin", "affinity")
MODES = ("recompute", "tiers", "tiers_no_overlap", "tiers_free")


def _point(res: dict) -> dict:
    out = {
        "requests": res["requests"],
        "ttft_s": {k: res["ttft_s"]["all"].get(k) for k in ("p50", "p90", "p99")},
        "e2e_p90_s": res["e2e_s"]["all"].get("p90"),
        "hit_tokens": res["hit_tokens"],
        "hit_token_rate": res["hit_token_rate"],
        "input_tokens_per_s": res["throughput"]["input_tokens_per_s"],
        "preemptions": res["preemptions"],
        "rejected": res["rejected"],
    }
    for k in ("hit_tokens_by_tier", "tier_loads"):
        if k in res:
            out[k] = res[k]
    return out


def main(args) -> dict:
    if args.quick:
        args.sessions, args.workers = 0.005, 2
    if args.host_factor <= 0 or args.store_factor <= 0 or args.pcie_gbps <= 0 or args.store_gbps <= 0:
        raise SystemExit("--host-factor, --store-factor, --pcie-gbps and --store-gbps must be positive")
    cost, cfg = build(args)
    sh = cost.shape
    gpus = args.gpus or DEFAULT_GPUS[args.shape]
    device_bytes = cfg.full_tokens * sh.kv_bytes_full + cfg.swa_tokens * sh.kv_bytes_swa
    # the host bytes split like the device pools' (as engine.LLM does)
    host_full = int(cfg.full_tokens * args.host_factor)
    host_swa = int(cfg.swa_tokens * args.host_factor)
    store_bytes = int(device_bytes * args.store_factor)
    links = TierLinks(
        pcie_bytes_per_s=args.pcie_gbps * 1e9,
        store_bytes_per_s=args.store_gbps * 1e9,
        gpus=gpus,
        layers=sh.full_layers + sh.swa_layers,
    )
    configs = {
        "recompute": (cfg, 0),
        "tiers": (replace(cfg, host_full_tokens=host_full, host_swa_tokens=host_swa, links=links), store_bytes),
        "tiers_no_overlap": (
            replace(cfg, host_full_tokens=host_full, host_swa_tokens=host_swa, links=replace(links, overlap=False)),
            store_bytes,
        ),
        "tiers_free": (
            replace(
                cfg,
                host_full_tokens=host_full,
                host_swa_tokens=host_swa,
                links=replace(links, pcie_bytes_per_s=float("inf"), store_bytes_per_s=float("inf")),
            ),
            store_bytes,
        ),
    }
    figures = store_figures(args)
    for scheme, f in figures.items():  # `tiers` priced at each real store's measured transport
        configs[f"tiers_{scheme}"] = (
            replace(
                cfg,
                host_full_tokens=host_full,
                host_swa_tokens=host_swa,
                links=replace(
                    links, store_bytes_per_s=f["read_bytes_per_s"], store_latency_s=f["lookup_ms"]["p50"] / 1e3
                ),
            ),
            store_bytes,
        )
    modes = (*MODES, *(f"tiers_{s}" for s in figures))
    base = mooncake_requests(args.trace, args.requests, cfg.unit, args.offset, args.sessions)
    scaled = scale_to_load(cost, base, args.load, args.workers, cfg.chunk_size, cfg.max_running)
    runs: dict = {p: {} for p in POLICIES}
    seconds = {}
    t_all = time.perf_counter()
    for pol in POLICIES:
        for mode in modes:
            wc, sb = configs[mode]
            t0 = time.perf_counter()
            res = run_fleet(cost, wc, args.workers, pol, [replace(r) for r in base], store_bytes=sb)
            runs[pol][mode] = _point(res)
            seconds[f"{pol}/{mode}"] = round(time.perf_counter() - t0, 2)

    def r(a, b):
        return round(a / b, 3) if a is not None and b else None

    ratios = {}
    for pol in POLICIES:
        m = runs[pol]
        ratios[f"{pol}_ttft_p90_tiers_vs_recompute"] = r(m["tiers"]["ttft_s"]["p90"], m["recompute"]["ttft_s"]["p90"])
        ratios[f"{pol}_ttft_p50_tiers_vs_recompute"] = r(m["tiers"]["ttft_s"]["p50"], m["recompute"]["ttft_s"]["p50"])
        ratios[f"{pol}_hit_tiers_vs_recompute"] = r(m["tiers"]["hit_tokens"], m["recompute"]["hit_tokens"])
        ratios[f"{pol}_ttft_p90_tiers_vs_free_loads"] = r(m["tiers"]["ttft_s"]["p90"], m["tiers_free"]["ttft_s"]["p90"])
        ratios[f"{pol}_ttft_p90_overlap_vs_no_overlap"] = r(
            m["tiers"]["ttft_s"]["p90"], m["tiers_no_overlap"]["ttft_s"]["p90"]
        )
        names = list(figures)
        for other in names[1:]:
            ratios[f"{pol}_ttft_p90_{other}_vs_{names[0]}"] = r(
                m[f"tiers_{other}"]["ttft_s"]["p90"], m[f"tiers_{names[0]}"]["ttft_s"]["p90"]
            )
    for mode in ("recompute", "tiers"):
        ratios[f"round_robin_vs_affinity_hit_{mode}"] = r(
            runs["round_robin"][mode]["hit_tokens"], runs["affinity"][mode]["hit_tokens"]
        )
    result = {
        "bench": "tier-ttft",
        "config": {
            "trace": args.trace,
            "requests": len(base),
            "sessions": args.sessions,
            "workers": args.workers,
            "load": args.load,
            "rate_per_s": scaled["rate_per_s"],
            **describe(cost, cfg),
            "device_kv_bytes_per_worker": device_bytes,
            "host": {"factor": args.host_factor, "full_tokens": host_full, "swa_tokens": host_swa},
            "store": {"factor": args.store_factor, "bytes": store_bytes, "write": "insert", "kind": "in-process"},
            "store_figures": figures or None,
            "store_figures_source": "measured on this machine over loopback by mimo_epd/bench/store_probe.py "
            "(1 MiB values; tiers_<store> modes price store reads at the measured read bytes/s plus one lookup's "
            "P50 per step that reads the store)"
            if figures
            else None,
            "links": {
                "pcie_gb_per_s_per_gpu": args.pcie_gbps,
                "gpus": gpus,
                "store_gb_per_s_per_worker": args.store_gbps,
                "layers": links.layers,
                "overlap": "tiers: max(compute, load + compute / layers); tiers_no_overlap: compute + load",
            },
        },
        "ratios": ratios,
        "runs": runs,
        "seconds": {"total": round(time.perf_counter() - t_all, 1), **seconds},
    }
    Path(args.out_dir, "bench_tier_ttft.json").write_text(json.dumps(result, indent=1))
    return result


def store_figures(args) -> dict:
    """{scheme: measured transport} of each --kv-store (`local`: throwaway redis-server + mooncake_master)."""
    if not args.kv_store:
        return {}
    from mimo_epd.bench.prefix_cache import local_stores, store_scheme, store_urls
    from mimo_epd.bench.store_probe import measure

    if args.kv_store != "local":
        return {store_scheme(u): measure(u) for u in store_urls(args)}
    with local_stores() as urls:
        return {store_scheme(u): measure(u) for u in urls.split(",")}


def add_arguments(p) -> None:
    add_trace_flags(p, 0.05, ", about 590 requests over the whole hour")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default: 4)")
    p.add_argument("--load", type=float, default=0.8, help="nominal load (default: 0.8)")
    p.add_argument(
        "--host-factor", type=float, default=4.0, help="host tier bytes / device KV bytes, per worker (default: 4)"
    )
    p.add_argument(
        "--store-factor", type=float, default=4.0, help="shared store bytes / one worker's device KV bytes (default: 4)"
    )
    p.add_argument(
        "--pcie-gbps", type=float, default=50.0, help="host -> device GB/s per GPU (default: 50, PCIe Gen5 x16)"
    )
    p.add_argument(
        "--store-gbps", type=float, default=12.5, help="store -> worker GB/s per worker (default: 12.5, 100 Gb/s)"
    )
    p.add_argument(
        "--kv-store",
        default="",
        help="real stores to measure (redis:// and/or mooncake:// URLs, comma-separated, or `local`: throwaway "
        "servers of both): adds a tiers_<store> mode per store, store reads priced at its measured read "
        "bytes/s plus one lookup's latency (default: none)",
    )
    p.add_argument("--out-dir", default=".", help="where bench_tier_ttft.json goes (default: .)")
    p.add_argument(
        "--quick", action="store_true", help="a seconds-long version (CI): 0.5%% of the conversations, 2 workers"
    )
    add_model_flags(p, kv_gib=16.0)
