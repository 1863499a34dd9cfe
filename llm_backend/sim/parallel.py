"""Model parallelism in the cost model: a step's seconds on a deployment of TP x DP GPUs with EP experts, and the
deployments of the real shapes this machine cannot run (`mimo-epd bench parallel --sim`).

A deployment is (tp, dp, ep): attention (and the dense MLPs) tensor-parallel over `tp` GPUs, `dp` such groups
each with its own scheduler and requests (data-parallel attention: SGLang's --enable-dp-attention), the routed
experts spread over `ep` GPUs (ep = tp x dp when expert-parallel over the whole replica, or ep = tp: every group
holds all experts, split). One DP rank's step, with the others assumed to run a like step at the same time:

    attention part   max(compute, memory) over tp GPUs: the dense FLOPs and attention FLOPs of the rank's tokens;
                     its dense weights / tp and its KV read
    expert part      max(compute, memory) over ep GPUs: the expert FLOPs of all dp ranks' tokens (dp x tokens);
                     the touched experts' weights / ep
    collectives      per layer, two all-reduces of tokens x hidden over tp (log2(t) latencies, as NCCL's tree /
                     NVLS algorithms take, and 2 (t-1)/t of the bytes at the link's bus bandwidth); per MoE layer, with ep > tp, a dispatch and a
                     combine all-to-all of dp x tokens x top-k x hidden over ep ((e-1)/e of it crosses); inter-node
                     links (bandwidth and latency of their own) once a group spans more GPUs than a node holds
    overhead         the device profile's step and per-segment overhead

No overlap between the parts is assumed (a conservative bound: real engines overlap the all-to-all with the
expert GEMMs in part). Link figures per device kind are stated in `LINKS` (NVLink within a node, 400 Gb/s
InfiniBand per GPU across nodes); they are public specifications derated, not measurements here.

KV capacity follows from memory: each GPU's memory x `mem_fraction`, less its share of the weights (FP8: 1 byte
a parameter), holds KV; the full-attention layers hold every token, the sliding layers either their window only
(window reservation, this product) or every token too (full-KV reservation, what an engine without SWA-aware
pools reserves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel, RooflineProfile, step_features
from .shapes import ModelShape


@dataclass(frozen=True)
class Links:
    """One device kind's figures: memory per GPU, GPUs per node, and the collectives' links (bus bandwidth in bytes
    per second per GPU, latency per hop)."""

    name: str
    memory_bytes: float
    gpus_per_node: int
    intra_bytes_per_s: float
    intra_latency_s: float
    inter_bytes_per_s: float
    inter_latency_s: float


LINKS = {
    # NVLink 4 (900 GB/s bidirectional per GPU; NCCL's all-reduce bus bandwidth reaches ~360 GB/s in practice);
    # ConnectX-7 400 Gb/s per GPU across nodes (~40 GB/s achieved).
    "h200": Links("h200", 141e9, 8, 360e9, 8e-6, 40e9, 20e-6),
    "h100": Links("h100", 80e9, 8, 360e9, 8e-6, 40e9, 20e-6),
}


@dataclass(frozen=True)
class Deployment:
    tp: int
    dp: int = 1
    ep: int = 0  # 0: = tp (every group holds all experts, split over its tp GPUs)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def experts_over(self) -> int:
        return self.ep or self.tp

    def name(self) -> str:
        dp = f"dp{self.dp}_" if self.dp > 1 else ""
        return f"{dp}tp{self.tp}_ep{self.experts_over}"


class ParallelCost(CostModel):
    """A model shape on a roofline device profile (per GPU) split by a deployment (one DP rank's steps)."""

    def __init__(self, shape: ModelShape, profile: RooflineProfile, deploy: Deployment, links: Links):
        super().__init__(shape, profile)
        self.deploy, self.links = deploy, links

    def step_seconds(self, segments) -> float:
        return sum(self.breakdown(segments).values())

    def breakdown(self, segments) -> dict[str, float]:
        """Seconds of one step by part: attention, experts, collectives, overhead."""
        s, p, d = self.shape, self.profile, self.deploy
        f = step_features(s, segments)
        peak = p.peak_flops
        expert_flops = 2.0 * f.tokens * s.moe_layers * s.experts_per_tok * s.expert_params
        dense_flops = f.linear_flops - expert_flops
        attn_compute = dense_flops / (peak * p.mm_efficiency) + (f.attn_full_flops + f.attn_swa_flops) / (
            peak * p.attn_efficiency
        )
        head = (f.sampled > 0) * s.vocab * s.hidden
        attn_memory = ((s.dense_params + head) * s.weight_bytes + f.kv_bytes) / (p.hbm_bytes_per_s * p.bw_efficiency)
        all_tokens = f.tokens * d.dp
        moe_compute = d.dp * expert_flops / (peak * p.mm_efficiency)
        touched = 0.0
        if s.experts and all_tokens:
            touched = s.moe_layers * s.experts * (1.0 - (1.0 - s.experts_per_tok / s.experts) ** all_tokens)
        moe_memory = touched * s.expert_params * s.weight_bytes / (p.hbm_bytes_per_s * p.bw_efficiency)
        return {
            "attention": max(attn_compute, attn_memory) / d.tp,
            "experts": max(moe_compute, moe_memory) / d.experts_over,
            "collectives": self.collective_seconds(f.tokens),
            "overhead": p.step_overhead_s + p.segment_overhead_s * f.segments,
        }

    def collective_seconds(self, tokens: int) -> float:
        s, d = self.shape, self.deploy
        layers = s.full_layers + s.swa_layers
        act = tokens * s.hidden * 2  # bf16 activations
        t = 0.0
        if d.tp > 1:
            reduces = 2 * layers - (s.moe_layers if d.experts_over > d.tp else 0)  # MoE combine: the all-to-all
            t += reduces * self._all_reduce(act, d.tp)
        if d.experts_over > d.tp:
            moved = d.dp * act * s.experts_per_tok / d.experts_over * (d.experts_over - 1) / d.experts_over
            t += s.moe_layers * 2 * self._all_to_all(moved, d.experts_over)
        return t

    def _link(self, group: int) -> tuple[float, float]:
        k = self.links
        if group > k.gpus_per_node:
            return k.inter_bytes_per_s, k.inter_latency_s
        return k.intra_bytes_per_s, k.intra_latency_s

    def _all_reduce(self, nbytes: float, group: int) -> float:
        bw, lat = self._link(group)
        return lat * math.ceil(math.log2(group)) + 2 * (group - 1) / group * nbytes / bw

    def _all_to_all(self, nbytes_per_gpu: float, group: int) -> float:
        bw, lat = self._link(group)
        return lat * math.ceil(math.log2(group)) + nbytes_per_gpu / bw


def weight_bytes_per_gpu(shape: ModelShape, deploy: Deployment, weight_bytes: float = 1.0) -> float:
    """One GPU's weights (FP8: 1 byte a parameter): the dense part, embedding and head over tp, the experts over ep."""
    experts = shape.moe_layers * shape.experts * shape.expert_params
    dense = shape.total_params - experts
    return (dense / deploy.tp + experts / deploy.experts_over) * weight_bytes


def kv_capacity_tokens(
    shape: ModelShape, deploy: Deployment, links: Links, reserve: str, mem_fraction: float = 0.9
) -> int:
    """Tokens of context one DP rank can hold over its tp GPUs. `reserve`: "window" (the sliding layers hold their
    window only: bounded per request, left out here) or "full" (every layer holds every token)."""
    per_token = shape.kv_bytes_full + (shape.kv_bytes_swa if reserve == "full" else 0)
    free = (links.memory_bytes * mem_fraction - weight_bytes_per_gpu(shape, deploy)) * deploy.tp
    return max(0, int(free // max(per_token, 1)))


def prefill_tokens_per_gpu_s(cost: ParallelCost, segments: int, chunk: int, context: int) -> float:
    """Prefill throughput per GPU of one step shape: every DP rank computes `segments` chunks of `chunk` tokens at
    `context` tokens already in KV."""
    step = cost.step_seconds([(context, chunk, False)] * segments)
    return cost.deploy.dp * segments * chunk / step / cost.deploy.gpus


def simulate_deployment(
    shape: ModelShape,
    profile: RooflineProfile,
    deploy: Deployment,
    links: Links,
    requests,
    chunk: int = 8192,
    max_running: int = 64,
) -> dict:
    """The requests through one replica of `deploy`: `dp` simulated workers (the real scheduler, sim/engine.py),
    requests dealt round-robin, each with KV pools sized from its GPUs' memory (window reservation). Returns output
    tokens/s over the makespan, TTFT and TPOT percentiles."""
    from mimo_epd.common.stats import percentile

    from .engine import SimWorker, WorkerConfig, simulate

    cost = ParallelCost(shape, profile, deploy, links)
    full = kv_capacity_tokens(shape, deploy, links, "window")
    cfg = WorkerConfig(
        full_tokens=full, swa_tokens=max_running * (shape.window + 2 * chunk), chunk_size=chunk, max_running=max_running
    )
    workers = [simulate(SimWorker(cost, cfg, f"dp{i}"), requests[i :: deploy.dp]) for i in range(deploy.dp)]
    done = [f for w in workers for f in w.finished]
    span = max(f.finish for f in done) - min(r.arrival for r in requests)
    ttft = [f.first_token - f.arrival for f in done]
    tpot = [(f.finish - f.first_token) / (f.output_len - 1) for f in done if f.output_len > 1]
    return {
        "gpus": deploy.gpus,
        "kv_tokens_per_dp_rank": full,
        "output_tokens_per_s": round(sum(f.output_len for f in done) / span, 1),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p90_s": round(percentile(ttft, 90), 3),
        "tpot_p50_ms": round(percentile(tpot, 50) * 1e3, 2),
        "finished": len(done),
    }


# The deployments `bench parallel --sim` compares: V2-Flash / V2.5's shape on one node of 8, Pro's over two nodes.
SIM_DEPLOYMENTS = {
    "flash_8gpu": ("flash", (Deployment(8), Deployment(4, 2, 8), Deployment(1, 8, 8))),
    "pro_16gpu": ("pro", (Deployment(16), Deployment(8, 2, 16), Deployment(4, 4, 16))),
}
# The seed's chain claim: prefill at half the expert-parallel size once the SWA KV is window-bounded.
EP_TARGET_IN_FLIGHT = 64 * 65536  # prompt tokens a prefill instance keeps in KV (64 prompts of 64K)
EP_CANDIDATES = (Deployment(4, 2, 8), Deployment(8, 2, 16), Deployment(8, 4, 32))


def simulate_modes(args) -> dict:
    """`bench parallel --sim`: each deployment of each shape on the same requests, once time-scaled so the first
    deployment runs at `--sim-load` (TTFT, TPOT) and once all arriving together (capacity: output tokens/s), the
    step breakdowns (where the time goes), and the EP-size comparison."""
    from dataclasses import replace

    from .load import scale_to_load
    from .shapes import SHAPES
    from .trace import long_context_mix

    links, profile = LINKS[args.sim_device], RooflineProfile(name=args.sim_device, gpus=1)
    n = 40 if args.quick else args.sim_requests
    out: dict = {"bench": "parallel", "sim": True, "device": vars(links) | {"profile": profile.to_json()}}
    out["deployments"], ratios = {}, {}
    for group, (shape_name, deploys) in SIM_DEPLOYMENTS.items():
        shape = replace(SHAPES[shape_name], weight_bytes=1)  # FP8 weights, as released
        reqs = long_context_mix(n, 1.0, seed=0, unit=128, shares=(0.9, 0.1, 0.0), output=(64, 512))
        load = scale_to_load(ParallelCost(shape, profile, deploys[0], links), reqs, args.sim_load, 1, 8192, 64)
        burst = [replace(r, arrival=0.0) for r in reqs]  # every request at once: the deployment's capacity
        res = {"shape": shape.describe(), "load": load}
        for d in deploys:
            cost = ParallelCost(shape, profile, d, links)
            res[d.name()] = {
                "at_load": simulate_deployment(shape, profile, d, links, reqs),
                "saturated": simulate_deployment(shape, profile, d, links, burst),
                **_steps(cost),
            }
        first = res[deploys[0].name()]
        for d in deploys[1:]:
            for how in ("saturated", "at_load"):
                key = "tokens_per_s" if how == "saturated" else "ttft_p90"
                ours, base = res[d.name()][how], first[how]
                field = "output_tokens_per_s" if how == "saturated" else "ttft_p90_s"
                ratios[f"{group}_{d.name()}_vs_{deploys[0].name()}_{key}"] = round(
                    ours[field] / max(base[field], 1e-9), 3
                )
        out["deployments"][group] = res
    out["ep_half"] = ep_half(replace(SHAPES["flash"], weight_bytes=1), profile, links)
    ratios["ep_half_window_reservation_vs_full_kv"] = out["ep_half"]["ratio"]
    out["ratios"] = ratios
    return out


def _steps(cost: ParallelCost) -> dict:
    """Where a step's time goes: a decode step (32 sequences at 8K context) and a prefill step (16 chunks of 1024
    tokens at 32K), in ms by part."""
    dec = cost.breakdown([(8192, 1, True)] * 32)
    pre = cost.breakdown([(32768, 1024, False)] * 16)
    return {
        "decode_step_ms": {k: round(v * 1e3, 3) for k, v in dec.items()},
        "prefill_step_ms": {k: round(v * 1e3, 2) for k, v in pre.items()},
    }


def ep_half(shape: ModelShape, profile: RooflineProfile, links: Links) -> dict:
    """The smallest deployment of EP_CANDIDATES whose KV holds EP_TARGET_IN_FLIGHT prompt tokens, with the sliding
    layers' KV window-bounded and with a full-KV reservation, and their prefill throughput per GPU."""
    out: dict = {"target_in_flight_tokens": EP_TARGET_IN_FLIGHT}
    for reserve in ("window", "full"):
        fit = next(
            (d for d in EP_CANDIDATES if d.dp * kv_capacity_tokens(shape, d, links, reserve) >= EP_TARGET_IN_FLIGHT),
            None,
        )
        if fit is None:
            out[reserve] = {"fits": False}
            continue
        cost = ParallelCost(shape, profile, fit, links)
        out[reserve] = {
            "deployment": fit.name(),
            "gpus": fit.gpus,
            "kv_tokens": fit.dp * kv_capacity_tokens(shape, fit, links, reserve),
            "prefill_tokens_per_gpu_s": round(prefill_tokens_per_gpu_s(cost, 16, 1024, 32768), 1),
        }
    w, f = out["window"], out["full"]
    ok = w.get("fits", True) and f.get("fits", True)
    out["ratio"] = round(w["prefill_tokens_per_gpu_s"] / f["prefill_tokens_per_gpu_s"], 3) if ok else None
    return out
