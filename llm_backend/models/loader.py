"""Loading a MiMo checkpoint directory into the model: every released layout, shard by shard, exactly or not at all.

The plan (`plan_checkpoint`) is made from `config.json` and the safetensors headers alone, before a byte of weight
is read: the config in either layout (released.py), the shards (`model.safetensors.index.json` or every
`*.safetensors`), each checkpoint tensor mapped to the model parameter(s) it fills (`Piece`s), every shape and
dtype checked against the model built on the meta device. A missing shard, a tensor the index names but its file
lacks (or the reverse), a shape the config does not give, a weight the model has no place for, an FP8 weight
without its scales or a scale grid that fits no layout: `LoadError`, one line naming the file and tensor.

Then `load_checkpoint` reads tensor by tensor (positioned reads into the target buffers, so the page cache never
counts against the process: peak RSS is the resident weights plus the largest single tensor where the stored format
is the resident one, plus a few fp32 copies of the largest tensor where it is converted on the way) and fills each
parameter, allocated in its final dtype when first written:
- plain weights are cast to the serving dtype (the router gate and its correction bias stay fp32);
- experts stored one by one (`experts.E.{gate,up,down}_proj`) are packed into `[E, 2I, H]` / `[E, H, I]`;
- `attention_sink_bias` becomes `sinks`;
- a fused, pre-split `qkv_proj` ([Q_0|K_0|V_0|...|Q_n|K_n|V_n], n = num_key_value_heads) is de-interleaved into
  q, k and v by the config's head counts, never by a guess from row counts;
- FP8 weights stay FP8 with their scales (`fp8_weights="keep"`), or are dequantized into the serving dtype here
  (`"dequantize"`); a chunk of a fused QKV is dequantized whole before it is split, since a scale block can
  straddle K and V. Kept FP8, q/k/v carry one scale row per weight row, which is exact for any split;
- `quantization="fp8"` quantizes a bf16 checkpoint's linear layers into 128x128 block FP8 as they are read.

Scale grids of q/k/v: the release tiles them per pre-split chunk (ceil(rows_c / 128) rows each; V2-Flash's full
layers' k_proj: 4 chunks of 192 rows, 8 scale rows, where a plain grid has 6). The loader accepts a plain grid or
the chunked one when the scale rows say which; where both grids have the same row count but differ it refuses.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..kernels.fp8 import FP8, dequantize, mxfp4_dequantize, quantize, row_scales, scale_shape
from ..parallel.comm import SINGLE_RANK, Parallel
from ..parallel.shard import SINGLE, Shard
from .mimo_v2_flash import MiMoV2FlashConfig, MiMoV2FlashForCausalLM
from .quant import BlockFP8Experts, BlockFP8Linear, Fp8Spec, MXFP4Experts
from .released import ConfigError, qkv_chunks, read_config

log = logging.getLogger("mimo_epd.llm.loader")

# Weights of a multimodal checkpoint that the encoder's towers read, not the LLM.
OTHER_TOWERS = (
    "visual.",
    "model.visual.",
    "audio_tower.",
    "model.audio_tower.",
    "audio_encoder.",
    "speech_embeddings.",
)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": FP8,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "BOOL": torch.bool,
    "F8_E5M2": torch.float8_e5m2,
}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv|weight_scale)$"
)
_QKV = re.compile(r"^(.*\.self_attn)\.qkv_proj\.(weight|weight_scale_inv)$")
_SPLIT_QKV = re.compile(r"^(.*\.self_attn)\.(q_proj|k_proj|v_proj)\.(weight|weight_scale_inv)$")
FP8_WEIGHTS = ("keep", "dequantize")


class LoadError(ValueError):
    """A checkpoint that cannot be loaded exactly; one line naming the file and the tensor."""


@dataclass(frozen=True)
class Stored:
    """One tensor as a safetensors header describes it."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class Piece:
    """One checkpoint tensor (`weight`, and its `scale` for FP8) and where it goes: `kind` says how."""

    kind: str  # "plain", "expert", "qkv", "split_qkv"
    target: str  # our parameter name (for "qkv": the attention module's prefix)
    weight: Stored
    scale: Stored | None = None
    expert: int = 0
    part: str = ""  # expert: gate_proj / up_proj / down_proj; split_qkv: q_proj / k_proj / v_proj
    layer: int = 0  # qkv / split_qkv: the layer index in its stack (MTP layers: k - 1)
    mtp: bool = False


@dataclass
class Plan:
    directory: str
    cfg: MiMoV2FlashConfig
    pieces: list[Piece]
    model: MiMoV2FlashForCausalLM  # on the meta device: the shapes and dtypes to fill
    files: list[str] = field(default_factory=list)
    stored_bytes: int = 0
    block: tuple[int, int] = (128, 128)  # the checkpoint's FP8 block (also when dequantized at load)


def _fail(path: str, what: str) -> LoadError:
    return LoadError(f"{path}: {what}")


# ------------------------------------------------------------------------------------------ headers


def read_header(path: str) -> dict[str, Stored]:
    """A safetensors file's tensors, checked to lie inside the file (a truncated shard fails here, by name)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _fail(path, f"truncated: {size} bytes, not a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise _fail(path, f"truncated: its header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError):
            raise _fail(path, "corrupt safetensors header") from None
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or t.get("dtype") not in _DTYPES:
            what = t.get("dtype") if isinstance(t, dict) else t
            raise _fail(path, f"tensor {name}: dtype {what!r} is not one this loader reads")
        try:
            dtype = _DTYPES[t["dtype"]]
            a, b = (int(x) for x in t["data_offsets"])
            shape = tuple(int(x) for x in t["shape"])
        except (KeyError, TypeError, ValueError):
            raise _fail(path, f"tensor {name}: its shape or data_offsets are not readable") from None
        if not 0 <= a <= b:
            raise _fail(path, f"tensor {name}: data_offsets [{a}, {b}] are not a byte range")
        if 8 + n + b > size:
            raise _fail(path, f"truncated: tensor {name} needs bytes up to {8 + n + b}, the file has {size}")
        numel = 1
        for x in shape:
            numel *= x
        if b - a != numel * dtype.itemsize:
            raise _fail(path, f"tensor {name}: {b - a} bytes for shape {list(shape)} {t['dtype']}")
        out[name] = Stored(name, path, dtype, shape, 8 + n + a, b - a)
    return out


def read_headers(directory: str) -> tuple[list[str], dict[str, Stored]]:
    """Every weight of the checkpoint: through `model.safetensors.index.json` when it has one (each shard's
    tensors must be exactly those the index gives it), else every `*.safetensors` in the directory."""
    index = os.path.join(directory, "model.safetensors.index.json")
    tensors: dict[str, Stored] = {}
    if os.path.isfile(index):
        try:
            weight_map = json.loads(open(index, encoding="utf-8").read())["weight_map"]
            by_file: dict[str, set[str]] = {}
            for name, f in weight_map.items():
                by_file.setdefault(f, set()).add(name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise _fail(index, f"not a safetensors index ({e})") from None
        files = [os.path.join(directory, f) for f in sorted(by_file)]
        for f in files:
            if not os.path.isfile(f):
                raise _fail(f, f"missing (named by {os.path.basename(index)})")
            header = read_header(f)
            want = by_file[os.path.basename(f)]
            for name in sorted(want - set(header)):
                raise _fail(f, f"lacks tensor {name}, which {os.path.basename(index)} places there")
            for name in sorted(set(header) - want):
                raise _fail(f, f"holds tensor {name}, which {os.path.basename(index)} does not place there")
            tensors.update(header)
        return files, tensors
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise _fail(os.path.join(directory, "model.safetensors"), "missing: the checkpoint has no *.safetensors")
    for f in files:
        header = read_header(f)
        for name in header:
            if name in tensors:
                raise _fail(f, f"tensor {name} is also in {tensors[name].file}")
        tensors.update(header)
    return files, tensors


# ------------------------------------------------------------------------------------------ the plan


def _fp8_modules(tensors: dict[str, Stored], spec: Fp8Spec, config_file: str) -> frozenset[str]:
    """The linear layers stored FP8 (their weights float8_e4m3fn with `weight_scale_inv`), by our module names;
    an FP8 weight without scales, scales without an FP8 weight, or an FP8 layer the config leaves unquantized
    stops the load."""
    modules = set()
    experts: dict[str, set[bool]] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            w = tensors.get(name[: -len("_scale_inv")])
            if w is None or w.dtype != FP8:
                raise _fail(t.file, f"tensor {name}: scales for a weight that is not stored FP8")
            if t.dtype not in _FLOATS:
                raise _fail(t.file, f"tensor {name}: scales stored as {t.dtype}, not a float type")
            continue
        if name.endswith(".weight_scale"):
            w = tensors.get(name[: -len("_scale")])
            if w is None or w.dtype != torch.uint8 or t.dtype != torch.uint8 or not _EXPERT.match(name):
                raise _fail(t.file, f"tensor {name}: e8m0 scales for a weight that is not an MXFP4 expert")
            continue
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        fp8 = t.dtype == FP8
        if t.dtype == torch.uint8:  # MXFP4 (V2.6's experts): two e2m1 codes a byte
            if not spec.mxfp4_block:
                raise _fail(t.file, f"tensor {name}: packed MXFP4, but {config_file} says store_dtype fp8")
            if not _EXPERT.match(name) or name + "_scale" not in tensors:
                raise _fail(t.file, f"tensor {name}: MXFP4 outside the routed experts or without its weight_scale")
            fp8 = True
        elif _EXPERT.match(name) and spec.mxfp4_block and fp8:
            raise _fail(t.file, f"tensor {name}: FP8, but {config_file} says the experts are MXFP4")
        if fp8 and t.dtype == FP8 and name + "_scale_inv" not in tensors:
            raise _fail(t.file, f"tensor {name}: FP8 without its weight_scale_inv")
        if fp8 and spec.ignores(module):
            raise _fail(t.file, f"tensor {name}: stored FP8, but {config_file} leaves {module} unquantized")
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), set()).add(fp8)
        elif fp8 and module.endswith(".qkv_proj"):
            p = module[: -len(".qkv_proj")]
            modules.update({f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"})
        elif fp8:
            modules.add(module)
    for prefix, kinds in experts.items():
        if len(kinds) > 1:
            raise _fail(config_file, f"{prefix}: some experts stored FP8, some not")
        if True in kinds:
            modules.add(prefix)
    return frozenset(modules)


def _our_name(name: str) -> str:
    return name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")


def _layer_of(prefix: str) -> tuple[int, bool]:
    m = re.match(r"^model\.(layers|mtp\.layers)\.(\d+)\.", prefix + ".")
    if not m:
        return 0, False
    return int(m.group(2)), m.group(1) == "mtp.layers"


def _pieces(tensors: dict[str, Stored], cfg: MiMoV2FlashConfig, directory: str) -> list[Piece]:
    keep_mtp = cfg.num_nextn_predict_layers > 0
    out = []
    for name in sorted(tensors):
        t = tensors[name]
        if name.startswith(OTHER_TOWERS) or (not keep_mtp and name.startswith("model.mtp.")):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the embedding's, by the config
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            continue  # travels with its weight
        scale = (tensors.get(name + "_scale_inv") or tensors.get(name + "_scale")) if name.endswith(".weight") else None
        m = _EXPERT.match(name)
        if m:
            out.append(Piece("expert", m.group(1), t, scale, expert=int(m.group(2)), part=m.group(3)))
            continue
        m = _QKV.match(name)
        if m:
            layer, mtp = _layer_of(m.group(1))
            if cfg.attention_projection_layout != "fused_qkv":
                raise _fail(
                    t.file, f"tensor {name}: a fused qkv_proj, but config.json's attention_projection_layout is 'split'"
                )
            out.append(Piece("qkv", m.group(1), t, scale, layer=layer, mtp=mtp))
            continue
        m = _SPLIT_QKV.match(name)
        if m and cfg.attention_projection_layout == "fused_qkv":
            raise _fail(
                t.file, f"tensor {name}: separate q/k/v, but config.json says attention_projection_layout fused_qkv"
            )
        if m and scale is not None:
            layer, mtp = _layer_of(m.group(1))
            out.append(
                Piece("split_qkv", f"{m.group(1)}.{m.group(2)}", t, scale, part=m.group(2), layer=layer, mtp=mtp)
            )
            continue
        out.append(Piece("plain", _our_name(name), t, scale))
    return out


def plan_checkpoint(
    directory: str, dtype: torch.dtype = torch.float32, fp8_weights: str = "keep", quantization: str = ""
) -> Plan:
    """Everything `load_checkpoint` will do, checked from config.json and the headers (no weight read)."""
    if fp8_weights not in FP8_WEIGHTS:
        raise ValueError(f"fp8_weights must be one of {FP8_WEIGHTS}, got {fp8_weights!r}")
    if quantization not in ("", "fp8"):
        raise ValueError(f"quantization must be '' or 'fp8', got {quantization!r}")
    config_file = os.path.join(directory, "config.json")
    if not os.path.isfile(config_file):
        raise _fail(directory, "not a checkpoint directory with a config.json")
    try:
        d = json.loads(open(config_file, encoding="utf-8").read())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _fail(config_file, f"not a JSON config ({e})") from None
    try:
        cfg = read_config(d, config_file)
    except ConfigError as e:
        raise LoadError(str(e)) from None
    files, tensors = read_headers(directory)
    stored_fp8 = any(t.dtype in (FP8, torch.uint8) for t in tensors.values())  # FP8, or MXFP4 experts
    if stored_fp8 and cfg.quant is None:
        name = next(n for n, t in tensors.items() if t.dtype == FP8)
        raise _fail(tensors[name].file, f"tensor {name} is FP8, but config.json has no quantization_config")
    block = cfg.quant.block if cfg.quant is not None else (128, 128)
    if cfg.quant is not None:
        modules = _fp8_modules(tensors, cfg.quant, config_file)
        cfg.quant = replace(cfg.quant, modules=modules) if fp8_weights == "keep" else None
    if quantization == "fp8" and not stored_fp8:
        cfg.quant = Fp8Spec(block=(128, 128))
    elif quantization == "fp8":
        log.info("%s is stored quantized already: --quantization fp8 changes nothing", directory)
    pieces = _pieces(tensors, cfg, directory)
    with torch.device("meta"), _no_init():
        model = MiMoV2FlashForCausalLM(cfg)
    stored = sum(p.weight.nbytes + (p.scale.nbytes if p.scale else 0) for p in pieces)
    plan = Plan(directory, cfg, pieces, model, files, stored, block)
    _check_plan(plan, dtype)
    return plan


_NO_INIT = threading.Lock()


@contextmanager
def _no_init():
    """Layers built on the meta device skip their random init: the weights come from the files, and a meta
    `normal_` costs a second of one-time tracing imports in every process that loads (transformers does the same).
    torch.nn.init is process-wide: one load at a time swaps it (a model built on another thread meanwhile would get
    uninitialised weights; every build here happens under this lock)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    with _NO_INIT:
        saved = {n: getattr(nn.init, n) for n in names}
        try:
            for n in names:
                setattr(nn.init, n, _keep)
            yield
        finally:
            for n, f in saved.items():
                setattr(nn.init, n, f)


def _keep(tensor, *args, **kwargs):
    return tensor


def _target_dtype(name: str, param: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if param.dtype == FP8 or not param.dtype.is_floating_point or name.endswith("_scale_inv"):
        return param.dtype
    if name.endswith(".mlp.gate.weight") or name.endswith("e_score_correction_bias"):
        return torch.float32  # the router stays fp32 (bf16 rounding changes the top-k among many experts)
    return dtype


def _check_plan(plan: Plan, dtype: torch.dtype) -> None:
    """Every piece fits its parameter and every parameter is filled by some piece."""
    params = dict(plan.model.named_parameters()) | dict(plan.model.named_buffers())
    persistent = set(plan.model.state_dict())
    filled: set[str] = set()
    cfg = plan.cfg
    for p in plan.pieces:
        w = p.weight
        mxfp4 = p.kind == "expert" and w.dtype == torch.uint8 and p.scale is not None
        if w.dtype not in _FLOATS and not (w.dtype == FP8 and p.scale is not None) and not mxfp4:
            raise _fail(w.file, f"tensor {w.name}: stored as {w.dtype}, not a weight format this loader reads")
        if p.kind == "plain":
            target = params.get(p.target)
            if target is None or p.target not in persistent:
                raise _fail(w.file, f"tensor {w.name}: the model has no such weight (config.json says no such layer)")
            _same_shape(w, target.shape)
            if w.dtype == FP8 and not isinstance(_module_of(plan.model, p.target), BlockFP8Linear):
                if cfg.quant is not None:  # a layer kept FP8 must be built FP8 (dequantized: cfg.quant is None)
                    raise _fail(w.file, f"tensor {w.name}: stored FP8 where the model expects {target.dtype}")
            filled.add(p.target)
            if p.target + "_scale_inv" in params:  # an FP8 layer: kept as stored, or quantized at load
                filled.add(p.target + "_scale_inv")
            if p.scale is not None and cfg.quant is not None:
                _same_shape(p.scale, params[p.target + "_scale_inv"].shape)
            elif p.scale is not None:
                _same_shape(p.scale, scale_shape(*w.shape, plan.block))
        elif p.kind == "expert":
            packed = params.get(f"{p.target}.{'down_proj' if p.part == 'down_proj' else 'gate_up_proj'}")
            if packed is None or p.expert >= cfg.n_routed_experts:
                raise _fail(w.file, f"tensor {w.name}: the model has no such expert")
            i, h = cfg.moe_intermediate_size, cfg.hidden_size
            rows, cols = (h, i) if p.part == "down_proj" else (i, h)
            if w.dtype == torch.uint8 and p.scale is not None:  # MXFP4
                _same_shape(w, (rows, cols // 2))
                _same_shape(p.scale, (rows, -(-cols // 32)))
            else:
                _same_shape(w, (rows, cols))
                if p.scale is not None:
                    _same_shape(p.scale, scale_shape(rows, cols, plan.block))
            filled.add(f"{p.target}.{p.part}")  # counted per expert below
        else:
            _check_qkv(plan, p)
            names = ("q_proj", "k_proj", "v_proj") if p.kind == "qkv" else (p.part,)
            prefix = p.target if p.kind == "qkv" else p.target.rsplit(".", 1)[0]
            for n in names:
                filled.add(f"{prefix}.{n}.weight")
                if isinstance(_module_of(plan.model, f"{prefix}.{n}.weight"), BlockFP8Linear):
                    filled.add(f"{prefix}.{n}.weight_scale_inv")
    experts = _expert_counts(plan)
    for prefix, counts in experts.items():
        for part, seen in counts.items():
            if len(seen) != cfg.n_routed_experts:
                missing = sorted(set(range(cfg.n_routed_experts)) - seen)[:3]
                raise _fail(plan.directory, f"{prefix}: {part} of experts {missing} missing")
        mod = _module_of(plan.model, f"{prefix}.gate_up_proj")
        filled.update({f"{prefix}.gate_up_proj", f"{prefix}.down_proj"})
        if isinstance(mod, BlockFP8Experts):
            filled.update({f"{prefix}.gate_up_proj_scale_inv", f"{prefix}.down_proj_scale_inv"})
        if isinstance(mod, MXFP4Experts):
            filled.update({f"{prefix}.gate_up_proj_scale", f"{prefix}.down_proj_scale"})
    for name in sorted(persistent - filled):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("e_score_correction_bias"):
            continue  # zeros when absent (checkpoints trained without the aux-free bias)
        raise _fail(plan.directory, f"the checkpoint lacks {name} (config.json's layers need it)")


def _expert_counts(plan: Plan) -> dict[str, dict[str, set[int]]]:
    out: dict[str, dict[str, set[int]]] = {}
    for p in plan.pieces:
        if p.kind == "expert":
            out.setdefault(p.target, {}).setdefault(p.part, set()).add(p.expert)
    return out


def _same_shape(t: Stored, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise _fail(t.file, f"tensor {t.name}: shape {list(t.shape)}, config.json gives {list(shape)}")


def _module_of(model: nn.Module, param: str) -> nn.Module:
    return model.get_submodule(param.rsplit(".", 1)[0])


def _qkv_cfg(cfg: MiMoV2FlashConfig, mtp: bool) -> MiMoV2FlashConfig:
    from .mimo_v2_flash_mtp import mtp_config

    return mtp_config(cfg) if mtp else cfg


def _check_qkv(plan: Plan, p: Piece) -> None:  # noqa: D103
    cfg = _qkv_cfg(plan.cfg, p.mtp)
    if p.layer >= cfg.num_hidden_layers:
        raise _fail(p.weight.file, f"tensor {p.weight.name}: the model has no such layer")
    n, rq, rk, rv = qkv_chunks(cfg, p.layer)
    rows = {"q_proj": rq, "k_proj": rk, "v_proj": rv}.get(p.part, rq + rk + rv)
    h = cfg.hidden_size
    _same_shape(p.weight, (n * rows, h))
    if p.scale is not None:
        _scale_layout(p, n, rows, plan.block)


def _scale_layout(p: Piece, n: int, chunk_rows: int, block: tuple[int, int]) -> str:
    """Which grid the scales of a q/k/v (or fused qkv) weight use: "chunked" (each of the n pre-split chunks with
    its own ceil(rows / bn) scale rows, the release's), or "plain"; refused when neither fits or both fit apart."""
    assert p.scale is not None
    bn, bk = block
    rows, cols = p.weight.shape
    chunked = n * -(-chunk_rows // bn)
    plain = -(-rows // bn)
    got_rows, got_cols = p.scale.shape
    if got_cols != -(-cols // bk):
        raise _fail(p.scale.file, f"tensor {p.scale.name}: {got_cols} scale columns for {cols} columns")
    if p.kind == "qkv":
        if got_rows != chunked:
            raise _fail(
                p.scale.file,
                f"tensor {p.scale.name}: {got_rows} scale rows; the config's pre-split {n} x {chunk_rows} rows needs "
                f"{n} x {-(-chunk_rows // bn)} = {chunked}",
            )
        return "chunked"
    if chunked == plain:
        if chunk_rows % bn and n > 1:
            raise _fail(
                p.scale.file,
                f"tensor {p.scale.name}: {got_rows} scale rows fit a per-chunk and a plain grid that differ ({n} "
                f"chunks of {chunk_rows} rows): refused rather than guessed",
            )
        if got_rows == plain:
            return "plain"
    elif got_rows == chunked:
        return "chunked"
    elif got_rows == plain:
        return "plain"
    raise _fail(
        p.scale.file,
        f"tensor {p.scale.name}: {got_rows} scale rows fit neither {plain} (plain grid) nor {chunked} ({n} chunks)",
    )


# ------------------------------------------------------------------------------------------ reading


class _Reader:
    """Positioned reads of whole tensors, one open file at a time, with progress on stderr."""

    def __init__(self, total: int, label: str, progress: bool):
        self.total, self.done, self.label, self.progress = max(total, 1), 0, label, progress
        self.t0 = self.last = time.monotonic()
        self.files: dict[str, int] = {}
        self.tty = sys.stderr.isatty()

    def read(self, t: Stored, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's bytes, into `into` when given (a contiguous tensor of its dtype and size: no copy)."""
        fd = self.files.get(t.file)
        if fd is None:
            fd = self.files[t.file] = os.open(t.file, os.O_RDONLY)
        buf = into.view(torch.uint8).reshape(-1) if into is not None else torch.empty(t.nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        got = 0
        while got < t.nbytes:
            n = os.preadv(fd, [view[got:]], t.start + got)
            if n <= 0:
                raise _fail(t.file, f"tensor {t.name}: the file ended while reading it")
            got += n
        self.done += t.nbytes
        self._report()
        return buf.view(t.dtype).view(t.shape) if t.shape else buf.view(t.dtype).reshape(())

    def _report(self, final: bool = False) -> None:
        now = time.monotonic()
        if not self.progress or now - self.t0 < 2.0:  # a load that takes under 2 s says nothing
            return
        if not final and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        gb, rate = self.done / 1e9, self.done / 1e9 / max(now - self.t0, 1e-9)
        line = f"loading {self.label}: {gb:.2f} / {self.total / 1e9:.2f} GB ({100 * self.done / self.total:.0f} %), {rate:.2f} GB/s"
        print(
            ("\r" + line) if self.tty else line,
            end="\n" if (final or not self.tty) else "",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        self._report(final=True)
        for fd in self.files.values():
            os.close(fd)


class _Targets:
    """The model's parameters, allocated in their final dtype on first write. `shard`: one rank of a model-parallel
    replica (llm_backend/parallel/shard.py): `model` has that rank's shapes, and each whole tensor written through
    `put` / `put_expert` keeps only this rank's part (a rank holds one whole tensor at a time, the one being read)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, shard: Shard = SINGLE, cfg=None):
        self.model = model  # on the meta device: this rank's modules (their FP8 blocks)
        self.meta = dict(model.named_parameters()) | dict(model.named_buffers())
        self.dtype = dtype
        self.out: dict[str, torch.Tensor] = {}
        self.shard, self.cfg = shard, cfg

    def put(self, name: str, whole: torch.Tensor) -> None:
        """Parameter `name` from its whole value (this rank's part of it kept)."""
        self.get(name).copy_(self.shard.take(name, whole, self.cfg))

    def put_scale(self, weight: str, weight_shape: tuple[int, ...], whole: torch.Tensor) -> None:
        """The block scales of FP8 weight `weight` (its whole shape `weight_shape`), cut with it block for block."""
        self.get(f"{weight}_scale_inv").copy_(self.shard.take_scale(weight, weight_shape, whole, self.cfg))

    def holds(self, expert: int) -> bool:
        held = self.shard.experts(self.cfg.n_routed_experts) if self.cfg is not None else None
        return held is None or held.start <= expert < held.stop

    def put_expert(self, packed: str, expert: int, part: str, value: torch.Tensor, inter: int) -> None:
        """One expert's gate_proj / up_proj [I, H] or down_proj [H, I] into the packed parameter `packed` (`inter` =
        I). Split: also an FP8 expert's scales (`packed` ending in `_scale_inv`), cut in blocks of the same rows."""
        t = self.get(packed)
        sh = self.shard
        if sh.single:
            rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}[part]
            t[expert, rows] = value
            return
        e = expert - sh.experts(self.cfg.n_routed_experts).start
        if part == "down_proj":
            t[e] = value if sh.expert_parallel else _cut_blocks(value, 1, inter, sh, packed)
            return
        local = t.shape[1] // 2
        offset = 0 if part == "gate_proj" else local
        t[e, offset : offset + local] = value if sh.expert_parallel else _cut_blocks(value, 0, inter, sh, packed)

    def get(self, name: str) -> torch.Tensor:
        t = self.out.get(name)
        if t is None:
            m = self.meta[name]
            t = self.out[name] = torch.empty(m.shape, dtype=_target_dtype(name, m, self.dtype))
        return t


def _cut_blocks(value: torch.Tensor, dim: int, inter: int, shard: Shard, name: str) -> torch.Tensor:
    """This rank's part of an expert's intermediate dimension `dim` of `value`: the weight's own rows / columns
    (size `inter`), or its scales' blocks of them (size inter / block), refused off a block edge."""
    n = value.shape[dim]
    block = -(-inter // n)
    r = shard.part(inter)
    if r.start % block or r.stop % block:
        raise ValueError(
            f"{name}: this rank's part {r.start}..{r.stop} of the intermediate size {inter} does not fall on the FP8 "
            f"block of {block}; use --fp8-weights dequantize or --enable-expert-parallel at this size"
        )
    return value.narrow(dim, r.start // block, (r.stop - r.start) // block)


def load_checkpoint(
    directory: str,
    dtype: torch.dtype = torch.float32,
    fp8_weights: str = "keep",
    quantization: str = "",
    progress: bool = True,
    par: Parallel = SINGLE_RANK,
) -> MiMoV2FlashForCausalLM:
    """The checkpoint's model with its weights, on the CPU, in `dtype` (FP8 layers kept FP8: see the module).
    `par`: one rank of a tensor- / expert-parallel replica: only that rank's part is kept (an expert another rank
    holds is not even read); a shape the rank count cannot split is refused naming the field."""
    plan = plan_checkpoint(directory, dtype, fp8_weights, quantization)
    model = plan.model
    if not par.shard.single:
        try:
            par.shard.check(plan.cfg)
        except ValueError as e:
            raise _fail(directory, str(e)) from None
        with torch.device("meta"), _no_init():
            model = MiMoV2FlashForCausalLM(plan.cfg, par)
    targets = _Targets(model, dtype, par.shard, plan.cfg)
    pieces = [p for p in plan.pieces if p.kind != "expert" or targets.holds(p.expert)]
    stored = sum(p.weight.nbytes + (p.scale.nbytes if p.scale else 0) for p in pieces)
    reader = _Reader(stored, os.path.basename(os.path.normpath(directory)), progress)
    try:
        for p in pieces:
            _fill(plan, p, reader, targets)
    finally:
        reader.close()
    return _assemble(plan, targets, model)


def _direct(plan: Plan, p: Piece, targets: _Targets) -> torch.Tensor | None:
    """Where the piece's stored bytes can land as they are (same dtype, a contiguous slice), or None."""
    if not targets.shard.single:
        return None  # read whole, this rank's part kept
    if p.kind == "plain" and p.scale is None and f"{p.target}_scale_inv" not in targets.meta:
        out = targets.get(p.target)
    elif p.kind == "expert":
        packed = f"{p.target}.{'down_proj' if p.part == 'down_proj' else 'gate_up_proj'}"
        quantized = f"{packed}_scale_inv" in targets.meta or f"{packed}_scale" in targets.meta
        if (p.scale is None) == quantized:
            return None  # dequantized or quantized on the way
        i = plan.cfg.moe_intermediate_size
        rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}[p.part]
        out = targets.get(packed)[p.expert, rows]
    else:
        return None
    ok = out.dtype == p.weight.dtype and out.is_contiguous() and tuple(out.shape) == p.weight.shape
    return out if ok else None


def _fill(plan: Plan, p: Piece, reader: _Reader, targets: _Targets) -> None:
    cfg = plan.cfg
    direct = _direct(plan, p, targets)
    if direct is not None and p.kind == "plain":
        reader.read(p.weight, into=direct)
        return
    w = reader.read(p.weight, into=direct)
    s = reader.read(p.scale) if p.scale is not None else None
    block = plan.block
    if p.kind == "plain":
        _put(targets, p.target, w, s, block)
    elif p.kind == "expert":
        packed = f"{p.target}.{'down_proj' if p.part == 'down_proj' else 'gate_up_proj'}"
        fp8 = f"{packed}_scale_inv" in targets.meta
        i = cfg.moe_intermediate_size
        rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}[p.part]
        if f"{packed}_scale" in targets.meta:  # MXFP4 kept: codes and e8m0 scales row for row
            if direct is None:
                targets.get(packed)[p.expert, rows] = w
            targets.get(f"{packed}_scale")[p.expert, rows] = s
        elif fp8:
            mod = _module_of(targets.model, packed)
            assert isinstance(mod, BlockFP8Experts)
            bn = (mod.down_block if p.part == "down_proj" else mod.gate_up_block)[0]
            w, s = _fp8_pair(w, s, block)
            if not targets.shard.single:  # this rank's rows / columns, and their scales block for block
                targets.put_expert(packed, p.expert, p.part, w, i)
                srows = row_scales(s, w.shape[0], block[0]) if bn == 1 else s
                targets.put_expert(f"{packed}_scale_inv", p.expert, p.part, srows, i)
                return
            if direct is None:
                targets.get(packed)[p.expert, rows] = w
            srows = row_scales(s, w.shape[0], block[0]) if bn == 1 else s
            if bn != 1 and p.part == "up_proj":
                rows = slice(i // bn, 2 * i // bn)
            elif bn != 1 and p.part == "gate_proj":
                rows = slice(0, i // bn)
            targets.get(f"{packed}_scale_inv")[p.expert, rows] = srows
        elif direct is None:
            targets.put_expert(packed, p.expert, p.part, _plain(w, s, block, targets.get(packed).dtype), i)
    else:
        _fill_qkv(plan, p, w, s, block, targets)


def _fp8_pair(w: torch.Tensor, s: torch.Tensor | None, block) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as FP8 with scales: as stored, or quantized now (--quantization fp8)."""
    if w.dtype == FP8:
        assert s is not None
        return w, s.float()
    assert w.is_floating_point(), f"only a float weight is quantized at load, not {w.dtype}"
    return quantize(w, block)


def _plain(w: torch.Tensor, s: torch.Tensor | None, block, dtype: torch.dtype) -> torch.Tensor:
    """A weight in the serving dtype: dequantized when stored FP8 or MXFP4."""
    if w.dtype == torch.uint8 and s is not None:
        return mxfp4_dequantize(w, s, 32, dtype)
    return dequantize(w, s, block, dtype) if w.dtype == FP8 and s is not None else w.to(dtype)


def _put(targets: _Targets, name: str, w: torch.Tensor, s: torch.Tensor | None, block) -> None:
    if f"{name}_scale_inv" in targets.meta:  # an FP8 layer: kept or quantized now
        mod = _module_of(targets.model, name)
        q, sc = _fp8_pair(w, s, block)
        if getattr(mod, "block", block)[0] == 1 and sc.shape[0] != q.shape[0]:  # row-granular target
            sc = row_scales(sc, q.shape[0], block[0])
        targets.put(name, q)
        targets.put_scale(name, tuple(q.shape), sc)
    else:
        targets.put(name, _plain(w, s, block, targets.get(name).dtype))


def _fill_qkv(plan: Plan, p: Piece, w: torch.Tensor, s: torch.Tensor | None, block, targets: _Targets) -> None:
    """De-interleave a fused pre-split qkv (or place a q/k/v whose scales are tiled per chunk). Scales become one
    row per weight row (exact), or the chunk is dequantized whole before it is split."""
    cfg = _qkv_cfg(plan.cfg, p.mtp)
    n, rq, rk, rv = qkv_chunks(cfg, p.layer)
    if p.kind == "qkv":
        parts, chunk = (("q_proj", rq), ("k_proj", rk), ("v_proj", rv)), rq + rk + rv
        prefix = p.target
    else:
        parts, chunk = ((p.part, {"q_proj": rq, "k_proj": rk, "v_proj": rv}[p.part]),), 0
        chunk = parts[0][1]
        prefix = p.target.rsplit(".", 1)[0]
    if s is not None:
        layout = _scale_layout(p, n, chunk, block)
        per_row = (
            row_scales(s.float(), w.shape[0], block[0])
            if layout == "plain"
            else torch.cat([row_scales(c, chunk, block[0]) for c in s.float().chunk(n, dim=0)])
        )
    deq = None
    if s is not None and not any(f"{prefix}.{name}.weight_scale_inv" in targets.meta for name, _ in parts):
        deq = dequantize(w, per_row, (1, block[1]), targets.dtype)  # once, whole chunks with their own scales
    for name, rows in parts:
        offset = sum(r for nm, r in parts[: [x[0] for x in parts].index(name)])
        sel = torch.cat([torch.arange(i * chunk + offset, i * chunk + offset + rows) for i in range(n)])
        target = f"{prefix}.{name}.weight"
        if s is None:  # stored bf16: as is, or quantized now (--quantization fp8)
            _put(targets, target, w[sel], None, block)
        elif f"{target}_scale_inv" in targets.meta:  # kept FP8: rows and their own scale rows
            targets.put(target, w[sel])
            targets.put_scale(target, (len(sel), w.shape[1]), per_row[sel])
        else:  # dequantized (above): each chunk whole with its own scales, then split
            assert deq is not None
            targets.put(target, deq[sel])


def _assemble(plan: Plan, targets: _Targets, model: MiMoV2FlashForCausalLM) -> MiMoV2FlashForCausalLM:
    state = dict(targets.out)
    for name, m in targets.meta.items():
        if name not in state and name in model.state_dict():
            if name.endswith("e_score_correction_bias"):
                state[name] = torch.zeros(m.shape, dtype=torch.float32)
    if plan.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if plan.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise _fail(plan.directory, f"{name} was not loaded")
    for prm in model.parameters():
        prm.requires_grad_(False)
    return model
