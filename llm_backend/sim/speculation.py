"""MTP speculative decoding in the simulator: draft and verify steps priced by the cost model, acceptance drawn
from a profile, so the speed-up can be read for the MiMo-V2-Flash and Pro shapes on the h200 cost model.

- A verifying request's segment is K + 1 target tokens (the scheduler reserves them through its `draft_tokens`
  seam, as live); the runner prices it with the target's cost model like any segment.
- The MTP chain adds K sequential passes of one MTP layer (chain mode: pass j over j + 1 tokens per verifying
  request), each with one layer's share of the roofline's fixed step overhead plus 0.1 ms for the draft's
  sampling (`mtp_profile`), priced on `mtp_shape`: one sliding-window
  attention layer of the target's attention shape, a dense MLP of the target's dense width and `eh_proj` (2H x H),
  with the LM head for one row per request (the draft's logits).
- Catch-up: every MTP layer kept runs over the tokens the step made final (prefill chunks with prefill MTP, and
  each accepted run), priced the same way.
- Acceptance: draft position j is accepted with the conditional probability alpha_j = rate_j / rate_{j-1}
  (rate_j: the share of verify steps whose run reached position j) from a profile: ours (`bench spec` JSON) or
  the model card's figure. MiMo-V2.5 on SGLang (PR #23945) reports an accept length of 3.08 with 3 MTP layers at
  concurrency 1; with one alpha for every position 1 + a + a^2 + a^3 = 3.08 gives a = 0.83.

Only `unit` 1 is supported (per-token decode is what speculation changes).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

from ..engine.sampler import Sampled
from ..engine.scheduler import Segment, SegmentResult
from .cost import CostModel, RooflineProfile
from .runner import SimRunner
from .shapes import ModelShape

MODEL_CARD_ALPHA = 0.83  # accept length 3.08 (3 MTP layers, MiMo-V2.5, SGLang PR #23945): 1 + a + a^2 + a^3


def mtp_shape(shape: ModelShape) -> ModelShape:
    """One MTP layer: a sliding layer of the target's attention, a dense MLP of its dense width, and eh_proj
    (2H x H, counted into the dense width: 3 * H * extra = 2 * H^2)."""
    extra = -(-2 * shape.hidden // 3)
    return replace(
        shape,
        name=f"{shape.name} MTP layer",
        full_layers=0,
        swa_layers=1,
        kv_heads_full=0,
        dense_layers=1,
        dense_intermediate=shape.dense_intermediate + extra,
        moe_layers=0,
        experts=0,
        experts_per_tok=0,
    )


MTP_PASS_OVERHEAD_S = 1e-4  # a draft's sampling and the pass's bookkeeping, beyond its share of the launches


def mtp_profile(cost: CostModel):
    """The device profile of one MTP pass: the roofline's fixed step overhead (launches, sampling, scheduling of a
    whole forward) scaled to one layer of the target's, plus the draft's own sampling."""
    prof = cost.profile
    if isinstance(prof, RooflineProfile):
        layers = cost.shape.full_layers + cost.shape.swa_layers
        return replace(prof, step_overhead_s=prof.step_overhead_s / max(1, layers) + MTP_PASS_OVERHEAD_S)
    return prof


def conditional(rates: list[float]) -> list[float]:
    """Per-position acceptance shares (reached position j) -> conditional probabilities."""
    out, prev = [], 1.0
    for r in rates:
        out.append(min(1.0, r / prev) if prev > 0 else 0.0)
        prev = r
    return out


class SpecSimRunner(SimRunner):
    def __init__(
        self,
        cost: CostModel,
        steps: int,
        alphas: list[float],
        prefill_mtp: bool = True,
        chain: bool = True,
        seed: int = 0,
    ):
        super().__init__(cost, 1)
        self.k, self.alphas, self.prefill_mtp = steps, alphas, prefill_mtp
        self.depth = steps if chain else 1
        self.mtp = CostModel(mtp_shape(cost.shape), mtp_profile(cost))
        self.rng = random.Random(seed)
        self.verifies = self.accepted = 0

    def draft_tokens(self, r) -> int:
        st = self.states.get(r.id)
        return self.k if st is not None and st.decoding and st.kv is r.kv else 0

    def execute(self, segments: list[Segment]) -> list[SegmentResult]:
        plain = [s for s in segments if not s.drafts]
        results = dict(zip((id(s) for s in plain), super().execute(plain))) if plain else {}
        if not plain:
            self.steps += 1
        base_s = self.last_seconds if plain else 0.0
        real, catch, verifying = [], [], []
        for s in plain:
            if s.start < len(s.request.prompt) and not self.prefill_mtp:
                continue  # without prefill MTP the MTP layers never see the prompt
            catch.append((s.start, max(1, s.n), False))
        for s in segments:
            if s.drafts:
                res, run = self._verify(s)
                results[id(s)] = res
                real.append((s.start, s.n, True))
                verifying.append(s.start)
                catch.append((s.start + 1, run, False))
        seconds = base_s
        if real:  # the verify segments join the same forward: price the whole step again with them
            seconds = self.cost.step_seconds(self._plain_real(plain) + real)
        seconds += self._mtp_seconds(verifying, catch)
        self.busy_s += seconds - base_s
        self.last_seconds = seconds
        return [results[id(s)] for s in segments]

    def _plain_real(self, plain: list[Segment]) -> list[tuple[int, int, bool]]:
        return [(s.start, s.n, s.samples) for s in plain]

    def _mtp_seconds(self, verifying: list[int], catch: list[tuple[int, int, bool]]) -> float:
        """The draft chain (K passes) and the catch-up (one pass per kept layer)."""
        t = 0.0
        if verifying:
            for j in range(self.k):
                n = j + 1 if self.depth > 1 else 1
                t += self.mtp.step_seconds([(start + j, n, True) for start in verifying])
        catch = [c for c in catch if c[1] > 0]
        if catch:
            t += self.depth * self.mtp.step_seconds(catch)
        return t

    def _verify(self, seg: Segment) -> tuple[SegmentResult, int]:
        """Draws the accepted run, emits it and the bonus token from the trace; returns (result, accepted)."""
        r = seg.request
        st = self.states[r.id]
        left = st.spec.output_len - st.generated
        k = 0
        while k < seg.drafts and self.rng.random() < self.alphas[min(k, len(self.alphas) - 1)]:
            k += 1
        k = min(k, max(0, left - 1))
        self.verifies += 1
        self.accepted += k
        toks = [Sampled(st.spec.output_unit(len(r.output) + i), 0.0, []) for i in range(k + 1)]
        st.generated += k + 1
        return SegmentResult(toks[-1], [], accepted=tuple(toks[:-1])), k


def _workload(n: int, prompt_len: int, lo: int, hi: int, seed: int):
    from .trace import SimRequest

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 1 << 30) for _ in range(prompt_len)]
        out.append(SimRequest(i, 0.0, prompt, prompt_len, rng.randint(lo, hi)))
    return out


def _run(shape_name: str, gpus: int, mode: dict, reqs, batch: int, alphas: list[float]) -> dict:
    from .cost import load_profile
    from .engine import SimWorker, WorkerConfig, simulate
    from .shapes import get_shape

    cost = CostModel(get_shape(shape_name), load_profile("h200", gpus))
    cfg = WorkerConfig(full_tokens=1 << 20, swa_tokens=1 << 18, max_running=batch, chunk_size=8192)
    runner = None
    if mode["steps"]:
        runner = SpecSimRunner(cost, mode["steps"], alphas, mode.get("prefill_mtp", True), mode.get("chain", True))
    w = simulate(SimWorker(cost, cfg, runner=runner), reqs)
    fin = w.finished
    makespan = max(f.finish for f in fin)
    out_tokens = sum(f.output_len for f in fin)
    tpot = sorted((f.finish - f.first_token) / max(1, f.output_len - 1) for f in fin)
    ttft = sorted(f.first_token - f.arrival for f in fin)
    res = {
        "tokens_per_s": round(out_tokens / makespan, 2),
        "tpot_ms": {
            "p50": round(statistics.median(tpot) * 1e3, 3),
            "p90": round(tpot[int(0.9 * (len(tpot) - 1))] * 1e3, 3),
        },
        "ttft_ms_p50": round(statistics.median(ttft) * 1e3, 2),
    }
    if runner is not None and runner.verifies:
        res["mean_accept_length"] = round((runner.accepted + runner.verifies) / runner.verifies, 3)
    return res


def simulate_modes(args) -> dict:
    """`bench spec --sim`: the modes on the simulator (see bench/spec.py for the live one)."""
    import json

    gpus = {"flash": 8, "pro": 16}[args.shape]
    profiles = {"model_card": [MODEL_CARD_ALPHA] * 3}
    source = (
        f"model card: accept length 3.08 with 3 MTP layers (MiMo-V2.5 on SGLang, PR #23945) -> alpha "
        f"{MODEL_CARD_ALPHA} at every position"
    )
    measured = {}
    if args.accept_profile:
        d = json.load(open(args.accept_profile))
        for _key, modes in d.get("modes", {}).items():
            for m, r in modes.items():
                if "acceptance_by_position" in r:
                    measured.setdefault(m, []).append(r["acceptance_by_position"])
        source = f"measured: {args.accept_profile} (acceptance by draft position, averaged over its workloads)"

    def alphas(mode: str) -> list[float]:
        if mode in measured:
            rows = measured[mode]
            return conditional([statistics.fmean(r[j] for r in rows) for j in range(len(rows[0]))])
        return profiles["model_card"]

    modes = {
        "off": dict(steps=0),
        "k1": dict(steps=1),
        "k2": dict(steps=2),
        "k3": dict(steps=3),
        "k3_no_prefill_mtp": dict(steps=3, prefill_mtp=False),
    }
    if "k3_first_layer" in measured:
        modes["k3_first_layer"] = dict(steps=3, chain=False)
    n = 8 if args.quick else 64
    plen = 512 if args.quick else 4096
    out: dict[str, dict] = {}
    for batch in (1, 16):
        for lo, hi, tag in ((1, 128, "0_128"), (129, 256, "128_256")):
            reqs = _workload(n, plen, lo, hi, seed=batch)
            key = f"b{batch}_{tag}"
            out[key] = {}
            for name, mode in modes.items():
                a = alphas(name if name in measured else "k3")
                out[key][name] = _run(args.shape, gpus, mode, [replace(r) for r in reqs], batch, a)
    ratios = {}
    for key, m in out.items():
        ratios[f"speedup_k3_{key}"] = round(m["k3"]["tokens_per_s"] / m["off"]["tokens_per_s"], 3)
        ratios[f"prefill_mtp_vs_without_{key}"] = round(
            m["k3"]["tokens_per_s"] / m["k3_no_prefill_mtp"]["tokens_per_s"], 3
        )
        if "k3_first_layer" in m:
            ratios[f"all_layers_vs_one_reused_{key}"] = round(
                m["k3"]["tokens_per_s"] / m["k3_first_layer"]["tokens_per_s"], 3
            )
    return {
        "bench": "spec",
        "sim": True,
        "config": {
            "shape": args.shape,
            "profile": f"h200 roofline, {gpus} GPUs",
            "acceptance": source,
            "requests_per_workload": n,
            "prompt_tokens": plen,
            "outputs": "uniform in each bucket, every request generates its full length",
        },
        "modes": out,
        "ratios": ratios,
    }
