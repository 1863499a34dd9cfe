"""The cost model: how long one engine step takes, from what the step computes.

A step is described by its segments in real tokens, `(start, n, samples)` per request: tokens [start, start+n)
are computed, and `samples` says whether a token is sampled from the last one (one LM-head row). From the model
shape (shapes.py) that gives, per step (`StepFeatures`):

- `linear_flops`: 2 x tokens x active parameters (attention projections, dense MLPs, routers, the top-k experts
  of every MoE layer per token), plus 2 x hidden x vocab per sampled row (LM head);
- `attn_full_flops` / `attn_swa_flops`: query-key and probability-value products, 2 x heads x (head_dim +
  v_head_dim) per (query, key) pair, in full layers over the whole context (position p sees p+1 keys) and in
  sliding layers over min(p+1, window+1) keys;
- `experts_touched`: distinct experts the step's tokens route to, summed over MoE layers (expected value of
  top-k routing spread uniformly: E x (1 - (1 - k/E)^tokens)); each is one expert's weights read;
- `kv_bytes`: KV read (every sequence's context once, sliding layers only their window) and written (new tokens).

A device profile turns features into seconds:
- `LinearProfile` (`cpu-measured`): seconds = c . [1, segments, tokens, linear_flops, attn_full_flops,
  attn_swa_flops, experts_touched], coefficients fitted by least squares on timed steps of the real model
  (`mimo-epd sim calibrate`), non-negative so the model stays monotonic;
- `RooflineProfile` (`h200`): max(compute, memory) + a fixed step overhead, where compute = linear FLOPs at
  `mm_efficiency` and attention FLOPs at `attn_efficiency` of the peak, memory = weights read (dense weights +
  touched experts, bf16) + KV bytes at `bw_efficiency` of the HBM bandwidth, over `gpus` devices.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .shapes import ModelShape

PROFILE_DIR = Path(__file__).parent / "profiles"
FEATURES = ("const", "segments", "tokens", "linear_flops", "attn_full_flops", "attn_swa_flops", "experts_touched")


def _pairs_full(start: int, n: int) -> int:
    """Sum over positions p in [start, start+n) of (p + 1): the keys each query sees in a full layer."""
    return n * start + n * (n + 1) // 2


def _pairs_window(start: int, n: int, w: int) -> int:
    """Sum over p in [start, start+n) of min(p + 1, w + 1)."""
    cap = w + 1
    below_end = min(start + n, max(start, cap - 1))  # positions p with p + 1 < cap
    k = below_end - start
    return _pairs_full(start, k) + (n - k) * cap


@dataclass
class StepFeatures:
    segments: int = 0
    tokens: int = 0
    sampled: int = 0
    linear_flops: float = 0.0
    attn_full_flops: float = 0.0
    attn_swa_flops: float = 0.0
    experts_touched: float = 0.0
    kv_bytes: float = 0.0

    def vector(self) -> np.ndarray:
        return np.array(
            [
                1.0,
                self.segments,
                self.tokens,
                self.linear_flops,
                self.attn_full_flops,
                self.attn_swa_flops,
                self.experts_touched,
            ]
        )


def step_features(shape: ModelShape, segments) -> StepFeatures:
    """`segments`: iterable of (start, n, samples) in real tokens."""
    f = StepFeatures()
    pair = 2 * shape.heads * (shape.head_dim + shape.v_head_dim)
    full_pairs = swa_pairs = 0
    kv_read = 0
    for start, n, samples in segments:
        f.segments += 1
        f.tokens += n
        f.sampled += bool(samples)
        full_pairs += _pairs_full(start, n)
        swa_pairs += _pairs_window(start, n, shape.window)
        end = start + n
        kv_read += end * shape.kv_bytes_full + min(end, shape.window + n) * shape.kv_bytes_swa
    f.linear_flops = 2.0 * f.tokens * shape.active_params + 2.0 * f.sampled * shape.hidden * shape.vocab
    f.attn_full_flops = float(pair * shape.full_layers * full_pairs)
    f.attn_swa_flops = float(pair * shape.swa_layers * swa_pairs)
    if shape.experts and f.tokens:
        frac = 1.0 - (1.0 - shape.experts_per_tok / shape.experts) ** f.tokens
        f.experts_touched = shape.moe_layers * shape.experts * frac
    f.kv_bytes = float(kv_read + f.tokens * (shape.kv_bytes_full + shape.kv_bytes_swa))
    return f


@dataclass
class LinearProfile:
    name: str
    coefficients: dict[str, float]  # seconds per unit of each feature in FEATURES
    fitted_on: dict = field(default_factory=dict)  # model shape, steps, fit error, machine

    kind = "linear"

    def step_seconds(self, f: StepFeatures) -> float:
        c = np.array([self.coefficients.get(k, 0.0) for k in FEATURES])
        return float(max(0.0, c @ f.vector()))

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "coefficients": self.coefficients, "fitted_on": self.fitted_on}


@dataclass
class RooflineProfile:
    """Peak figures are per device (NVIDIA H200 SXM: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e)."""

    name: str = "h200"
    gpus: int = 8
    peak_flops: float = 989e12
    hbm_bytes_per_s: float = 4.8e12
    mm_efficiency: float = 0.6
    attn_efficiency: float = 0.4
    bw_efficiency: float = 0.7
    step_overhead_s: float = 0.003  # launch, sampling, scheduling per step
    segment_overhead_s: float = 2e-5

    kind = "roofline"

    def step_seconds(self, f: StepFeatures, shape: ModelShape | None = None) -> float:
        compute = (
            f.linear_flops / (self.peak_flops * self.mm_efficiency)
            + (f.attn_full_flops + f.attn_swa_flops) / (self.peak_flops * self.attn_efficiency)
        ) / self.gpus
        weights = 0.0
        if shape is not None:
            weights = (
                shape.dense_params
                + f.experts_touched * shape.expert_params
                + (f.sampled > 0) * shape.vocab * shape.hidden
            ) * shape.weight_bytes
        memory = (weights + f.kv_bytes) / (self.hbm_bytes_per_s * self.bw_efficiency * self.gpus)
        return max(compute, memory) + self.step_overhead_s + self.segment_overhead_s * f.segments

    def to_json(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


class CostModel:
    """A model shape on a device profile: `step_seconds(segments)`."""

    def __init__(self, shape: ModelShape, profile):
        self.shape, self.profile = shape, profile

    def features(self, segments) -> StepFeatures:
        return step_features(self.shape, segments)

    def step_seconds(self, segments) -> float:
        f = self.features(segments)
        if isinstance(self.profile, RooflineProfile):
            return self.profile.step_seconds(f, self.shape)
        return self.profile.step_seconds(f)


def profile_from_json(d: dict):
    kind = d.get("kind")
    if kind == "linear":
        return LinearProfile(d["name"], {k: float(v) for k, v in d["coefficients"].items()}, d.get("fitted_on", {}))
    if kind == "roofline":
        return RooflineProfile(**{k: v for k, v in d.items() if k != "kind"})
    raise ValueError(f"device profile: unknown kind {kind!r} (linear or roofline)")


def load_profile(name_or_path: str, gpus: int | None = None):
    """`h200`, `cpu-measured` (the committed fit, profiles/cpu-measured.json) or a profile JSON file."""
    if name_or_path == "h200":
        return RooflineProfile(gpus=gpus or 8)
    path = PROFILE_DIR / f"{name_or_path}.json" if name_or_path == "cpu-measured" else Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"device profile {name_or_path!r}: not h200, cpu-measured or a profile JSON file")
    prof = profile_from_json(json.loads(path.read_text()))
    if gpus and isinstance(prof, RooflineProfile):
        prof.gpus = gpus
    return prof


def fit_linear(name: str, features: list[StepFeatures], seconds: list[float], use=FEATURES) -> LinearProfile:
    """Non-negative least squares of seconds on the features (features never used get 0), by refitting without
    the coefficients that came out negative. Columns are scaled to unit norm for conditioning."""
    X = np.array([f.vector() for f in features])
    y = np.array(seconds)
    cols = [i for i, k in enumerate(FEATURES) if k in use and np.any(X[:, i] != 0)]
    coef = np.zeros(len(FEATURES))
    while cols:
        A = X[:, cols]
        scale = np.linalg.norm(A, axis=0)
        scale[scale == 0] = 1
        sol, *_ = np.linalg.lstsq(A / scale, y, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[cols] = sol
            break
        cols = [c for c, s in zip(cols, sol) if s >= 0] if (sol >= 0).any() else []
        if not cols:
            break
    return LinearProfile(name, {k: float(coef[i]) for i, k in enumerate(FEATURES)})
