"""`mimo-epd bench prefix-cache` (the shipped Mooncake trace, or `--trace PATH`): prefix-cache hit tokens of
the SWA-aware dual-pool cache vs a cache that keeps full KV for the sliding layers too vs an unbounded cache,
replaying a real request trace at a fixed KV byte budget under the MiMo-V2.5-Pro shape.

The trace (mimo_epd/data/traces/README.md) gives each request's prompt as hash ids of 512-token blocks (equal ids = equal
content). Requests are replayed in trace order, one at a time, through the simulator's worker (`SimWorker`,
llm_backend/sim/engine.py): the engine's own `Scheduler` admits each prompt, matches it in the real `SWARadixCache`
(all but its last token, as the engine), computes the rest in prefill chunks (each chunk's whole pages go into the
tree at once, and the pools evict LRU what the next chunk needs), samples one output token and finishes (its whole
pages stay cached). The trace's outputs are not in its ids, so one output token is run, not `output_length`.

- `swa_aware`: full pool = full-attention layers' KV (10 layers per token), SWA pool = sliding layers' KV
  (60 layers per token) kept only where a window needs it (node ends and, `--swa-checkpoint-interval`, each
  node's last checkpoint); the byte budget is split by `--swa-share`;
- `full_kv`: one pool holding all 70 layers' KV per token, nothing ever released (what serving stacks did
  before they supported SWA): the same bytes hold 7x fewer tokens;
- `unbounded`: the same as `full_kv` with no byte limit — the ideal (~36.6% of blocks).

Tokens are simulated in units of `--token-unit` (default 128 = the window): a block is 4 units, the window one
unit; block boundaries and the window are multiples of it, so window-safe matching at block granularity is
exact. Hit tokens are counted in real tokens (a partial last block counts its real length).

`--tiers` adds the KV tiers below the device pools (llm_backend.kv.tiers, docs/kv-tiers.md), each at the same
device budget as `swa_aware`:

- `l1`: device pools only (the `swa_aware` replay itself);
- `l1_l2`: plus a host tier of `--host-factor` x the device bytes (split like the device pools);
- `l1_l2_swa_backfill_on|off`, `l1_l2_swa_checkpoint_on|off`: `l1_l2` with one hit-rate switch flipped from its
  configured value (`--swa-backfill`, default off; `--swa-checkpoint-interval`, default 512 as the engine's);
- `l1_l2_host_<policy>`, `l1_l2_write_<mode>`: `l1_l2` with the host tier's other eviction policy (`--host-kv-policy`,
  default lru) or its other write mode (`--host-kv-write`, default back: a node is copied when the device evicts
  it; through: when it is inserted), the measurements behind the engine's defaults;
- `l1_l2_l3_round_robin`, `l1_l2_l3_affinity`: 4 workers (`--workers`) in this process, each with its own device
  pools and host tier, sharing one store (an in-process `MemoryKVStore` of `--store-factor` x one worker's device
  bytes, or the Redis at `--kv-store`); requests go round robin or to the longest cached prefix (the router's own
  `RoundRobin` / `Affinity` policies, each worker's predicted match = its cache's read-only peek over device+host);
  pages go to the store as `--kv-store-write` says (default `insert`: when they enter a worker's tree);
- `l1_l2_l3_round_robin_<other>`, `l1_l2_l3_affinity_<other>`: the same with the other write policy (`evict`:
  a page reaches the store when it leaves a worker's tree), the measurement behind the engine's default;
- `l1_l2_l3_round_robin_<scheme>`, `l1_l2_l3_affinity_<scheme>`: with several `--kv-store` URLs (a redis:// and
  a mooncake:// one, or `local` for throwaway servers of both), the same two modes on each further store, side
  by side with the first; `ratios` `l3_<scheme>_vs_<first>` compare their hit tokens, and each mode's `store`
  holds the store's measured read / write bytes per second and per-page load latency (P50 / P99);
- `unbounded`: as above.
Without `--kv-store` the tiers run in bookkeeping mode (slots, pages and bytes are counted, no tensor is copied;
bytes are those of the MiMo shape). A real store needs real values, so with `--kv-store` the tiers copy tiny
tensors (one full + one sliding layer, one head of dim 1, float16); its pages carry those and its byte counters
are theirs (the page counts are comparable). The workers of a mode share one store client in this process (for
Mooncake: one client whose segment, of min(store bytes, 1 GiB), holds every page).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from llm_backend.kv import fit_checkpoint_interval
from llm_backend.kv.build import KVLayout
from llm_backend.models import PRO_SHAPE_CONFIG
from llm_backend.sim.cost import CostModel, load_profile
from llm_backend.sim.engine import SimWorker, WorkerConfig
from llm_backend.sim.shapes import get_shape
from llm_backend.sim.trace import SimRequest
from mimo_epd.bench.kv_capacity import NEVER_RELEASE, token_bytes
from mimo_epd.common.stats import percentile
from mimo_epd.data import MOONCAKE_TRACE, open_text

BLOCK = 512


def load_trace(path: str, limit: int = 0) -> list[dict]:
    """The trace's rows; `path` "mooncake" is the shipped Mooncake conversation trace (mimo_epd.data)."""
    p = Path(MOONCAKE_TRACE if path == "mooncake" else path)
    if not p.is_file():
        raise SystemExit(f"trace {path!r} not found (the shipped Mooncake trace is {MOONCAKE_TRACE})")
    out = []
    with open_text(p) as f:
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
    """One cache configuration replaying the trace through the simulator's worker (llm_backend/sim/engine.py):
    the engine's own Scheduler, RequestKV and SWARadixCache over the given pools, each request run to its first
    output token before the next one is submitted."""

    def __init__(
        self,
        name: str,
        full_units: int,
        swa_units: int,
        window_units: int,
        page_units: int,
        chunk_units: int,
        unit: int,
        tiers: dict | None = None,
        checkpoint_units: int = 0,
    ):
        self.name, self.unit = name, unit
        layout = KVLayout(full_units, swa_units, page_units, window_units, checkpoint_interval=checkpoint_units)
        config = WorkerConfig(chunk_size=chunk_units * unit, max_running=1, fcfs=True, length_buckets=(), unit=unit)
        self.worker = SimWorker(
            replay_cost(), config, name, layout=layout if tiers is None else tiered_layout(layout, **tiers)
        )
        self.full_pool, self.swa_pool, self.cache = self.worker.full_pool, self.worker.swa_pool, self.worker.cache
        if tiers is not None and tiers.get("data"):
            attach_tiny_tensors(self.cache)
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.skipped = 0
        self.tiers = self.worker.tiers  # the tiered cache, or None

    def peek(self, units: list[int]) -> int:
        return self.cache.peek_prefix_length(units)

    def request(self, units: list[int], input_length: int) -> None:
        """Runs one prompt (and its first output token) through the worker; a prompt larger than the whole pool
        is refused by the scheduler and counted as served uncached."""
        self.prompt_tokens += input_length
        w = self.worker
        index = self.prompt_tokens  # any id unique to this replay
        if w.submit(SimRequest(index, w.now, units, input_length, 1), w.now) is None:
            self.skipped += 1
            return
        w.drain()
        done = w.finished[-1]
        if done.index != index:  # the scheduler left it waiting: nothing else runs, so it never fits
            raise AssertionError(f"{self.name}: request {index} did not run on an idle worker")
        self.hit_tokens += done.cached_tokens

    def result(self) -> dict:
        st = self.cache.stats
        return {
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "hit_token_rate": round(self.hit_tokens / max(self.prompt_tokens, 1), 4),
            "pool_units": {"full": self.full_pool.size, "swa": self.swa_pool.size},
            "evicted_units": {"full": st.full_evicted, "swa": st.swa_evicted},
            "repairs": st.repairs,
            "uncacheable_requests": self.skipped,
        }


def replay_cost() -> CostModel:
    """The worker's cost model: the MiMo-V2.5-Pro shape on 16 GPUs. The replay counts hits, never time; the
    worker needs a clock all the same."""
    return CostModel(get_shape("pro"), load_profile("h200", 16))


def tiered_layout(
    layout: KVLayout,
    host_full: int,
    host_swa: int,
    unit_bytes: tuple[int, int],
    evict_fraction: float,
    swa_backfill: bool = False,
    store=None,
    data: bool = False,
    store_write: str = "insert",
    policy: str = "lru",
    write: str = "back",
) -> KVLayout:
    """`layout` with the KV tiers below it (bookkeeping mode; `data`: see attach_tiny_tensors)."""
    return replace(
        layout,
        host_full_tokens=host_full,
        host_swa_tokens=host_swa,
        swa_backfill=swa_backfill,
        store=store,
        store_write=store_write,
        policy=policy,
        write_through=write == "through",
        token_bytes=unit_bytes,
        evict_fraction=evict_fraction,
    )


def attach_tiny_tensors(cache) -> None:
    """A Redis store round-trips real values: tiny device tensors, one full and one sliding layer."""
    import torch

    full, swa = cache.full_pool.size, cache.swa_pool.size
    pools = SimpleNamespace(
        k={0: torch.zeros(full, 1, 1, dtype=torch.float16), 1: torch.zeros(swa, 1, 1, dtype=torch.float16)},
        v={0: torch.zeros(full, 1, 1, dtype=torch.float16), 1: torch.zeros(swa, 1, 1, dtype=torch.float16)},
        sliding={0: False, 1: True},
    )
    cache.attach(pools)


TIER_KEYS = (
    "hit_device",
    "hit_host",
    "hit_store",
    "pages_d2h",
    "pages_h2d",
    "pages_s2d",
    "pages_to_store",
    "swa_d2h",
    "swa_h2d",
    "swa_s2d",
    "bytes_d2h",
    "bytes_h2d",
    "bytes_s2d",
    "host_evictions",
    "backfills",
    "fallbacks",
)


def combine(name: str, replays: list[Replay], unit: int, store=None) -> dict:
    """One mode's result over its workers: hit tokens summed, the tiers' counters summed (units -> tokens)."""
    out = {"hit_tokens": sum(r.hit_tokens for r in replays), "prompt_tokens": sum(r.prompt_tokens for r in replays)}
    out["hit_token_rate"] = round(out["hit_tokens"] / max(out["prompt_tokens"], 1), 4)
    out["workers"] = len(replays)
    if len(replays) > 1:
        out["hit_tokens_per_worker"] = [r.hit_tokens for r in replays]
    out["uncacheable_requests"] = sum(r.skipped for r in replays)
    out["evicted_units"] = {
        "full": sum(r.cache.stats.full_evicted for r in replays),
        "swa": sum(r.cache.stats.swa_evicted for r in replays),
    }
    tiers = [r.tiers for r in replays if r.tiers is not None]
    if tiers:
        t = {k: sum(getattr(x.tier_stats, k) for x in tiers) for k in TIER_KEYS}
        for k in ("hit_device", "hit_host", "hit_store", "swa_d2h", "swa_h2d", "swa_s2d"):
            t[k] *= unit  # units -> tokens (a page is one unit: page counts are pages of --page-size tokens)
        out["tiers"] = t
        out["host_units"] = {
            "full": tiers[0].host_full.size if tiers[0].host_full else 0,
            "swa": tiers[0].host_swa.size if tiers[0].host_swa else 0,
        }
    if store is not None:
        store.flush()
        out["store"] = store_figures(store)
    return out


def store_figures(store) -> dict:
    """The store's counters plus, for a real one, its measured read / write bytes per second (bytes over the
    seconds spent in its calls) and the load latency per page (a lookup's time over the pages it asked for)."""
    out = store.stats.as_dict()
    if not hasattr(store, "load_ms"):
        return out
    lat = sorted(store.load_ms)

    out["read_bytes_per_s"] = round(out["bytes_read"] / out["read_s"]) if out["read_s"] else None
    out["write_bytes_per_s"] = round(out["bytes_written"] / out["write_s"]) if out["write_s"] else None
    out["load_ms_per_page"] = {
        "p50": percentile(lat, 50, 4) if lat else None,
        "p99": percentile(lat, 99, 4) if lat else None,
        "samples": len(lat),
    }
    return out


def main(args) -> dict:
    if args.kv_store != "local":
        return replay_all(args)
    with local_stores() as urls:
        args.kv_store = urls
        try:
            return replay_all(args)
        finally:
            args.kv_store = "local"


@contextlib.contextmanager
def local_stores():
    """`--kv-store local`: a throwaway redis-server and mooncake_master on free loopback ports (the test
    fixtures' servers), as a "redis://...,mooncake://..." list; stopped afterwards."""
    import shutil
    import tempfile

    from mimo_epd.testing.mooncake_master import MooncakeMaster, master_binary
    from mimo_epd.testing.redis_server import RedisServer

    if shutil.which("redis-server") is None or master_binary() is None:
        raise SystemExit("--kv-store local needs redis-server (Debian) and the mooncake-transfer-engine wheel")
    with tempfile.TemporaryDirectory(prefix="bench-stores-") as d:
        redis, master = RedisServer(d), MooncakeMaster(d)
        redis.start()
        try:
            master.start()
            try:
                yield f"{redis.url},{master.url}"
            finally:
                master.stop(graceful=True)
        finally:
            redis.stop(graceful=True)


def check_units(args, cfg) -> None:
    """--token-unit must divide every size the replay works in; the checkpoint interval must be a multiple of it
    and of the page above the window."""
    unit, page, K = args.token_unit, args.page_size, args.swa_checkpoint_interval
    if BLOCK % unit or cfg.window % unit or page % unit or args.chunk_size % unit:
        raise SystemExit(
            f"--token-unit {unit} must divide the block (512), the window ({cfg.window}), "
            f"--page-size ({page}) and --chunk-size ({args.chunk_size})"
        )
    if K % unit or K % page or 0 < K <= cfg.window:
        raise SystemExit(
            f"--swa-checkpoint-interval {K} must be 0 or a multiple of --token-unit ({unit}) and --page-size "
            f"({page}) larger than the window ({cfg.window})"
        )


def replay_modes(args, reqs, budget: int, full_b: int, swa_b: int, w: int, c: int, p: int) -> dict[str, Replay]:
    """The three caches of one budget (in token units): SWA-aware (the budget split by --swa-share, sliding
    layers released outside the window), full KV (every layer kept), and unbounded (the hit ceiling)."""
    unit, K, all_full_b = args.token_unit, args.swa_checkpoint_interval, full_b + swa_b
    swa_units = int(budget * args.swa_share) // (swa_b * unit)
    full_units = (budget - swa_units * swa_b * unit) // (full_b * unit)
    return {
        "swa_aware": Replay("swa_aware", full_units, max(swa_units, w + c), w, p, c, unit, checkpoint_units=K // unit),
        "full_kv": Replay(
            "full_kv",
            budget // (all_full_b * unit),
            budget // (all_full_b * unit),
            NEVER_RELEASE,
            p,
            c,
            unit,
        ),
        "unbounded": Replay(
            "unbounded",
            sum(len(u) for u, _ in reqs) + c + p,
            sum(len(u) for u, _ in reqs) + c,
            NEVER_RELEASE,
            p,
            c,
            unit,
        ),
    }


def replay_all(args) -> dict:
    cfg = PRO_SHAPE_CONFIG
    check_units(args, cfg)
    unit, page, K = args.token_unit, args.page_size, args.swa_checkpoint_interval
    quick = 300 if args.tiers else 1000
    trace = load_trace(args.trace, quick if args.quick and not args.requests else args.requests)
    reqs = [(prompt_units(r, unit), r["input_length"]) for r in trace]
    unique_blocks = len({h for r in trace for h in r["hash_ids"]})
    esz = 2  # bf16
    full_b, swa_b = token_bytes(cfg, False, esz), token_bytes(cfg, True, esz)
    all_full_b = full_b + swa_b  # every layer's KV per token
    unique_full_kv_bytes = unique_blocks * BLOCK * all_full_b
    budget = int(unique_full_kv_bytes * args.budget_fraction)
    w, c, p = cfg.window // unit, args.chunk_size // unit, page // unit
    modes = replay_modes(args, reqs, budget, full_b, swa_b, w, c, p)
    results, seconds = {}, {}
    for name, replay in modes.items():
        t0 = time.perf_counter()
        for units, length in reqs:
            replay.request(units, length)
        results[name] = replay.result()
        seconds[name] = round(time.perf_counter() - t0, 2)
    tier_config = None
    if args.tiers:
        stamps = [float(r.get("timestamp", 0)) / 1e3 for r in trace]  # Mooncake timestamps are milliseconds
        tier_config = run_tiers(
            args, reqs, stamps, results, seconds, modes["swa_aware"], unit, w, c, p, full_b, swa_b, cfg
        )
    rate = {k: v["hit_token_rate"] for k, v in results.items()}
    hits = {k: v["hit_tokens"] for k, v in results.items()}

    def ratio(a, b):
        return round(hits[a] / max(hits[b], 1), 3)

    ratios = {
        "swa_aware_vs_full_kv": ratio("swa_aware", "full_kv"),
        "swa_aware_vs_unbounded": ratio("swa_aware", "unbounded"),
    }
    if args.tiers:
        ratios.update(tier_ratios(args, ratio))
    out = {
        "bench": "prefix-cache",
        "config": {
            "trace": args.trace,
            "requests": len(reqs),
            "unique_blocks": unique_blocks,
            "shape": "MiMo-V2.5-Pro (10 full + 60 sliding layers, 8 KV heads, head dims 192/128, window 128)",
            "kv_bytes_per_token": {"full_layers": full_b, "sliding_layers": swa_b, "all_layers": all_full_b},
            "unique_full_kv_bytes": unique_full_kv_bytes,
            "budget_fraction": args.budget_fraction,
            "budget_bytes": budget,
            "swa_share": args.swa_share,
            "token_unit": unit,
            "page_size": page,
            "chunk_size": args.chunk_size,
            "swa_checkpoint_interval": K,
            "replay": "trace order, one request at a time, through the simulator's worker (the engine's scheduler), "
            "each prompt and one output token",
        },
        "hit_token_rate": rate,
        "ratios": ratios,
        "modes": results,
        "seconds": seconds,
    }
    if tier_config is not None:
        out["config"]["tiers"] = tier_config
    return out


def tier_ratios(args, ratio) -> dict:
    """The --tiers ratios of hit tokens (`ratio(a, b)`: mode a's over mode b's)."""
    return {
        "l1_l2_vs_unbounded": ratio("l1_l2", "unbounded"),
        "l1_vs_unbounded": ratio("l1", "unbounded"),
        "l1_l2_vs_l1": ratio("l1_l2", "l1"),
        "l3_round_robin_vs_affinity": ratio("l1_l2_l3_round_robin", "l1_l2_l3_affinity"),
        f"l3_round_robin_vs_affinity_{OTHER_WRITE[args.kv_store_write]}": ratio(
            f"l1_l2_l3_round_robin_{OTHER_WRITE[args.kv_store_write]}",
            f"l1_l2_l3_affinity_{OTHER_WRITE[args.kv_store_write]}",
        ),
        "l3_affinity_vs_unbounded": ratio("l1_l2_l3_affinity", "unbounded"),
        **store_ratios(args, ratio),
        "swa_backfill_on_vs_off": ratio(*switch_modes(args, "swa_backfill")),
        "swa_checkpoint_on_vs_off": ratio(*switch_modes(args, "swa_checkpoint")),
        f"host_{args.host_kv_policy}_vs_{OTHER_POLICY[args.host_kv_policy]}": ratio(
            "l1_l2", f"l1_l2_host_{OTHER_POLICY[args.host_kv_policy]}"
        ),
        f"write_{args.host_kv_write}_vs_{OTHER_HOST_WRITE[args.host_kv_write]}": ratio(
            "l1_l2", f"l1_l2_write_{OTHER_HOST_WRITE[args.host_kv_write]}"
        ),
    }


class FluidLoad:
    """Each worker's queued prefill tokens over trace time, for the routing policies' load signal: a worker
    drains `rate` tokens/s and gains each request's uncached tokens. The replay is one request at a time, so
    without this every worker looks idle and affinity would send everything to the first worker holding the
    trace's shared first block. `rate` is set so the fleet runs at `--fleet-load` of its prefill capacity."""

    def __init__(self, workers: int, rate: float):
        self.rate, self.backlog, self.t = rate, [0.0] * workers, 0.0

    def at(self, t: float) -> list[int]:
        dt, self.t = max(0.0, t - self.t), max(t, self.t)
        self.backlog = [max(0.0, b - self.rate * dt) for b in self.backlog]
        return [int(b) for b in self.backlog]

    def add(self, worker: int, tokens: int) -> None:
        self.backlog[worker] += tokens


OTHER_WRITE = {"insert": "evict", "evict": "insert"}
OTHER_POLICY = {"lru": "fifo", "fifo": "lru"}
OTHER_HOST_WRITE = {"back": "through", "through": "back"}
SWITCHES = ("swa_backfill", "swa_checkpoint")
DEFAULT_CHECKPOINT = 512  # the engine's --swa-checkpoint-interval default


def switch_on(args, switch: str) -> bool:
    return bool(args.swa_backfill if switch == "swa_backfill" else args.swa_checkpoint_interval)


def switch_modes(args, switch: str) -> tuple[str, str]:
    """(mode with `switch` on, mode with it off): one is `l1_l2` (as configured), the other flips the switch."""
    if switch_on(args, switch):
        return "l1_l2", f"l1_l2_{switch}_off"
    return f"l1_l2_{switch}_on", "l1_l2"


def tiers_config(args, sizes: dict, urls: list[str], store_bytes: int, K: int, switch_k: int, unit, data, rate) -> dict:
    """What the --tiers replay ran with (the JSON's `config.tiers`)."""
    return {
        "device_bytes": sizes["device_bytes"],
        "host_factor": args.host_factor,
        "host_bytes": sizes["host_bytes"],
        "host_units": {"full": sizes["host_full"], "swa": sizes["host_swa"]},
        "host_kv_policy": args.host_kv_policy,
        "host_kv_write": args.host_kv_write,
        "workers": args.workers,
        "store": urls[0] if urls else "memory",
        "stores": {store_scheme(u): u for u in urls} or None,
        "store_modes": "the l1_l2_l3_* modes use the first store; l1_l2_l3_<policy>_<scheme> the others",
        "store_bytes": None if args.kv_store else store_bytes,
        "store_factor": args.store_factor,
        "store_write": args.kv_store_write,
        "swa_backfill": args.swa_backfill,
        "swa_checkpoint_interval": args.swa_checkpoint_interval,
        "swa_checkpoint_interval_switch": 0 if K else switch_k * unit,
        "data_mode": data,
        "fleet_load": args.fleet_load,
        "prefill_tokens_per_s_per_worker": round(rate, 1),
        "routing": "round_robin = the router's RoundRobin (request i to worker i % workers); affinity = the "
        "router's Affinity on each worker's peeked prefix and its simulated queued prefill tokens",
        "page_counts": "pages of --page-size tokens; swa_* and hit_* in tokens",
    }


def replay_fleet(workers: list[Replay], policy, store, reqs, stamps, unit: int, load: "FluidLoad") -> None:
    """The trace through `workers` sharing `store`, each request placed by the router's `policy` on the workers'
    peeked prefixes and their simulated queued prefill (`load`)."""
    from mimo_epd.router.policies import Candidate, RequestView

    names = [str(i) for i in range(len(workers))]
    for (units, length), t in zip(reqs, stamps):
        view = RequestView(length, BLOCK)
        queued = load.at(t)
        cands = [
            Candidate(n, matched_tokens=min(wk.peek(units) * unit, length), queued_tokens=q)
            for n, wk, q in zip(names, workers, queued)
        ]
        pick = policy.rank(view, cands)[0]
        policy.observe(view, pick)
        wk = workers[int(pick)]
        before = wk.hit_tokens
        wk.request(units, length)
        load.add(int(pick), length - (wk.hit_tokens - before))
        store.flush()  # the replay is one request at a time: its pages are stored before the next one


def single_worker_modes(args, K: int, switch_k: int) -> list[tuple[str, dict]]:
    """The one-worker tiered modes, each a name and what it changes: L1+L2 as configured; each hit-rate switch
    flipped from its configured value (`switch_modes`: on vs off, all else equal); the host tier's two policy
    flags, each flipped (the measurement behind the engine's defaults)."""
    flipped = {
        "swa_backfill": dict(swa_backfill=not args.swa_backfill),
        "swa_checkpoint": dict(k=0 if K else switch_k),
    }
    modes: list[tuple[str, dict]] = [("l1_l2", {})]
    modes += [(f"l1_l2_{sw}_{'off' if switch_on(args, sw) else 'on'}", flipped[sw]) for sw in SWITCHES]
    other_policy, other_write = OTHER_POLICY[args.host_kv_policy], OTHER_HOST_WRITE[args.host_kv_write]
    modes.append((f"l1_l2_host_{other_policy}", dict(policy=other_policy)))
    modes.append((f"l1_l2_write_{other_write}", dict(write=other_write)))
    return modes


def run_tiers(args, reqs, stamps, results, seconds, l1: Replay, unit, w, c, p, full_b, swa_b, cfg) -> dict:
    """The tiered modes (module docstring); adds them to `results` / `seconds`, returns their config."""
    from mimo_epd.router.policies import Affinity, RoundRobin

    if args.host_factor <= 0 or args.store_factor <= 0 or args.workers < 1 or args.fleet_load <= 0:
        raise SystemExit("--host-factor, --store-factor and --fleet-load must be positive, --workers at least 1")
    span = max(stamps) - min(stamps)
    prompt_tokens = sum(length for _, length in reqs)
    rate = prompt_tokens / span / args.workers / args.fleet_load if span > 0 else 0.0
    ubytes = (full_b * unit, swa_b * unit)  # the tiers count a unit as a token: per-unit bytes
    dev_full, dev_swa = l1.full_pool.size * ubytes[0], l1.swa_pool.size * ubytes[1]
    device_bytes = dev_full + dev_swa
    host_bytes = int(device_bytes * args.host_factor)
    share = dev_full / max(device_bytes, 1)  # the host bytes split like the device pools' (as engine.LLM does)
    host_full, host_swa = int(host_bytes * share) // ubytes[0], int(host_bytes * (1 - share)) // ubytes[1]
    K = args.swa_checkpoint_interval // unit
    # The switch comparison's K when the flag is 0: the engine's default (one trace block), as the engine fits it
    # (a page multiple above the window).
    switch_k = K or fit_checkpoint_interval(DEFAULT_CHECKPOINT // unit, w, p)
    data = bool(args.kv_store)

    base = dict(
        host_full=host_full,
        host_swa=host_swa,
        unit_bytes=ubytes,
        evict_fraction=args.evict_fraction,
        swa_backfill=args.swa_backfill,
        data=data,
        store_write=args.kv_store_write,
        policy=args.host_kv_policy,
        write=args.host_kv_write,
    )

    def replay(name, store=None, k=K, **over) -> Replay:
        """One tiered worker: the L1 pools of the swa_aware replay, `base` with `over` changed."""
        tiers = {**base, **over, "store": store}
        return Replay(name, l1.full_pool.size, l1.swa_pool.size, w, p, c, unit, tiers=tiers, checkpoint_units=k)

    def timed(name, fn):
        t0 = time.perf_counter()
        results[name] = fn()
        seconds[name] = round(time.perf_counter() - t0, 2)

    def single(r: Replay):
        for units, length in reqs:
            r.request(units, length)
        return combine(r.name, [r], unit)

    results["l1"] = combine("l1", [l1], unit)  # the swa_aware replay: device pools only
    seconds["l1"] = seconds["swa_aware"]
    for name, over in single_worker_modes(args, K, switch_k):
        timed(name, lambda name=name, over=over: single(replay(name, **over)))
    store_bytes = int(device_bytes * args.store_factor)

    urls = store_urls(args)

    def fleet(name, policy, write, url):
        store = new_store(url, store_bytes, cfg, p)
        try:
            workers = [replay(f"{name}[{i}]", store=store, store_write=write) for i in range(args.workers)]
            replay_fleet(workers, policy, store, reqs, stamps, unit, FluidLoad(args.workers, rate))
            return combine(name, workers, unit, store)
        finally:
            store.close()

    # Both policies with the configured write mode, with the other one, then on every further store.
    first, other = urls[0] if urls else "", OTHER_WRITE[args.kv_store_write]
    fleets = [("", args.kv_store_write, first), (f"_{other}", other, first)]
    fleets += [(f"_{store_scheme(u)}", args.kv_store_write, u) for u in urls[1:]]
    for suffix, write, url in fleets:
        for policy_name, policy in (("round_robin", RoundRobin), ("affinity", Affinity)):
            name = f"l1_l2_l3_{policy_name}{suffix}"
            timed(name, lambda n=name, pol=policy, wr=write, u=url: fleet(n, pol(), wr, u))
    sizes = {"device_bytes": device_bytes, "host_bytes": host_bytes, "host_full": host_full, "host_swa": host_swa}
    return tiers_config(args, sizes, urls, store_bytes, K, switch_k, unit, data, rate)


def store_scheme(url: str) -> str:
    from llm_backend.kv.tiers import store_scheme as scheme

    return scheme(url)


def store_urls(args) -> list[str]:
    """--kv-store as a list of URLs (comma-separated), each checked; `local` = throwaway servers (module doc)."""
    if not args.kv_store:
        return []
    urls = [u.strip() for u in args.kv_store.split(",") if u.strip()]
    for u in urls:
        try:
            store_scheme(u)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if len({store_scheme(u) for u in urls}) != len(urls):
        raise SystemExit(f"--kv-store {args.kv_store}: at most one store per kind (redis, mooncake)")
    return urls


def store_ratios(args, ratio) -> dict:
    """Each further store's hit tokens over the first store's, under round robin (the mode whose hits depend
    on the store) and affinity: `l3_<scheme>_vs_<first scheme>`."""
    urls = store_urls(args)
    out = {}
    for u in urls[1:]:
        a, b = store_scheme(u), store_scheme(urls[0])
        out[f"l3_{a}_vs_{b}"] = ratio(f"l1_l2_l3_round_robin_{a}", "l1_l2_l3_round_robin")
        out[f"l3_affinity_{a}_vs_{b}"] = ratio(f"l1_l2_l3_affinity_{a}", "l1_l2_l3_affinity")
    return out


def new_store(url: str, capacity: int, cfg, page: int):
    from llm_backend.kv.tiers import MemoryKVStore, open_store

    if not url:
        return MemoryKVStore(capacity)
    import uuid

    # A namespace of its own per run: the pages of an earlier run (or another fleet mode) are never hit.
    store = open_store(
        url,
        f"bench-prefix-cache:{uuid.uuid4().hex}:{cfg.window}:{page}:float16",
        ttl_s=3600,
        max_queue=1 << 20,
        segment_bytes=max(64 << 20, min(capacity, 1 << 30)),
        buffer_bytes=16 << 20,
    )
    try:
        if hasattr(store, "client") and hasattr(store.client, "ping"):
            store.client.ping()
        elif not store.wait_connected(30):
            raise RuntimeError("did not connect within 30 s")
    except Exception as e:  # noqa: BLE001 - a bench with an unreachable store says so
        store.close()
        raise SystemExit(f"--kv-store {url}: {e}") from None
    return store


def add_arguments(p) -> None:
    p.add_argument(
        "--trace",
        default="mooncake",
        help="mooncake (the shipped Mooncake conversation trace) or a Mooncake-format JSONL path, plain, .xz or "
        ".gz (default: mooncake)",
    )
    p.add_argument("--requests", type=int, default=0, help="replay only the first N requests, 0 = all (default: 0)")
    p.add_argument(
        "--budget-fraction",
        type=float,
        default=0.05,
        help="KV bytes as a fraction of the trace's unique full-attention KV bytes (default: 0.05)",
    )
    p.add_argument(
        "--swa-share",
        type=float,
        default=0.3,
        help="share of the budget for the SWA pool in the SWA-aware cache (default: 0.3)",
    )
    p.add_argument("--page-size", type=int, default=128, help="full-pool page, tokens (default: 128)")
    p.add_argument("--chunk-size", type=int, default=8192, help="prefill chunk, tokens (default: 8192)")
    p.add_argument("--token-unit", type=int, default=128, help="tokens per simulated slot (default: 128)")
    p.add_argument(
        "--evict-fraction",
        type=float,
        default=0.01,
        help="--tiers: the host tier evicts at least this fraction of its pool at a time (the device pools evict as the "
        "engine's scheduler does: what the next chunk needs) (default: 0.01)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a seconds-long version (CI): the first 1000 requests (300 with --tiers)"
    )
    p.add_argument(
        "--tiers",
        action="store_true",
        help="also replay with the KV tiers: L1, L1+L2, L1+L2+L3 over --workers workers (round robin and "
        "affinity), the hit-rate switches on and off (docs/kv-tiers.md)",
    )
    add_tier_arguments(p)


def add_tier_arguments(p) -> None:
    """The flags of the --tiers replay: tier sizes, fleet, host policy, stores."""
    p.add_argument(
        "--host-factor", type=float, default=4.0, help="--tiers: host tier bytes / device bytes (default: 4)"
    )
    p.add_argument(
        "--store-factor",
        type=float,
        default=4.0,
        help="--tiers: in-process shared store bytes / one worker's device bytes (default: 4)",
    )
    p.add_argument("--workers", type=int, default=4, help="--tiers: workers sharing the L3 store (default: 4)")
    p.add_argument(
        "--host-kv-policy",
        choices=("lru", "fifo"),
        default="lru",
        help="--tiers: host tier eviction, as the engine's flag (the other policy runs as l1_l2_host_<policy>; "
        "default: lru)",
    )
    p.add_argument(
        "--host-kv-write",
        choices=("back", "through"),
        default="back",
        help="--tiers: host tier writes, as the engine's flag (the other runs as l1_l2_write_<mode>; default: back)",
    )
    p.add_argument(
        "--fleet-load",
        type=float,
        default=0.7,
        help="--tiers: offered prompt tokens / the fleet's simulated prefill capacity, which sets the "
        "queued-token load the affinity policy weighs against the prefix match (default: 0.7)",
    )
    p.add_argument(
        "--kv-store",
        default="",
        help="--tiers: real shared stores instead of an in-process one: a redis:// and/or a mooncake:// URL, "
        "comma-separated (the L3 modes run on each, side by side; ratios l3_<second>_vs_<first>), or `local`: "
        "a throwaway redis-server and mooncake_master on free loopback ports",
    )
    p.add_argument(
        "--kv-store-write",
        choices=("insert", "evict"),
        default="insert",
        help="--tiers: when pages go to the shared store in the L1+L2+L3 modes (the other policy runs too as "
        "*_<policy> modes; default: insert, as the engine's --kv-store-write)",
    )
    p.add_argument(
        "--swa-backfill",
        action="store_true",
        help="--tiers: SWA back-fill on in the L1+L2 and L1+L2+L3 modes (the switch comparison flips it)",
    )
    p.add_argument(
        "--swa-checkpoint-interval",
        type=int,
        default=DEFAULT_CHECKPOINT,
        help="denser SWA checkpoints (the engine's flag): the SWA-aware modes keep the window before the last "
        "multiple of K tokens inside each cached span; --tiers flips it for the switch comparison "
        f"(0 = off, then {DEFAULT_CHECKPOINT} for the comparison; default: {DEFAULT_CHECKPOINT})",
    )
