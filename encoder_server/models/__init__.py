"""Vision models and their loader.

`load_vision_model("tiny")` loads the tower of the shipped default model (`mimo_epd.data`, docs/model.md): the
real Qwen2.5-VL vision architecture at small sizes (`TINY_VISION_CONFIG`) with deterministic random weights
(seeded; `random_model(TINY_VISION_CONFIG)` builds the same), stored in that checkpoint under `visual.*`, so it
loads through the same path as a user's multimodal checkpoint and runs on a laptop CPU with nothing downloaded.
`tiny-random` builds those weights without reading any file. `load_vision_model(PATH)` loads a checkpoint
directory saved by transformers: a vision model alone (`model_type: qwen2_5_vl_vision`), a full Qwen2.5-VL
checkpoint, or a `mimo_v2_flash` checkpoint with a `vision_config`; only the `visual.*` weights are read. The
tower is chosen by the vision config's `model_type`: `mimovl` (MiMo-V2.5's own ViT, `mimo_vision.py`) or
Qwen2.5-VL's; the tower's kind is the first part of the model id, so no embedding of one tower is ever a cache hit
for the other.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mimo_epd.common.model_names import TINY_RANDOM, resolve_model

from .mimo_vision import MODEL_TYPE as MIMO_VISION_TYPE
from .mimo_vision import MiMoVisionConfig, MiMoVisionTower
from .qwen2_5_vision import Qwen2_5VisionTower, VisionConfig

log = logging.getLogger(__name__)

__all__ = [
    "MiMoVisionConfig",
    "MiMoVisionTower",
    "Qwen2_5VisionTower",
    "VisionConfig",
    "LoadedVisionModel",
    "load_vision_model",
    "TINY_VISION_CONFIG",
    "resolve_dtype",
    "save_checkpoint",
    "save_mimo_checkpoint",
    "random_model",
]

# The embedded default: the real architecture at a size whose forward on a CPU is cheap next to image
# decoding (the balance of a GPU deployment, where the CPU side is the bottleneck). Windowed attention
# in every block keeps the cost linear in the image size; full-attention blocks are exercised by the
# parity tests' configs. Output size 256 = the hidden size of the embedded tiny LLM.
TINY_VISION_CONFIG = VisionConfig(
    depth=4,
    hidden_size=32,
    hidden_act="silu",
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    out_hidden_size=256,
    fullatt_block_indexes=[],
)
TINY_SEED = 0
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose float32, bfloat16 or float16") from None


VisionTower = Qwen2_5VisionTower | MiMoVisionTower


@dataclass
class LoadedVisionModel:
    module: VisionTower
    # Identifies the weights; part of every content key, so a different model never hits the cache.
    model_id: str
    # The checkpoint's preprocessor_config.json, when it has one.
    preprocessor_config: dict | None


def init_random_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic "dummy weights": the same seed gives the same weights on every machine. They are drawn
    in the checkpoint's layout and loaded like a checkpoint (the tower reorders some rows on load)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("ln_q.weight"):
            state[name] = torch.ones(p.shape)
        elif name.endswith("attn.sinks"):  # logits added to a key's: of the order of the logits themselves
            state[name] = torch.randn(p.shape, generator=gen)
        elif name.endswith("bias"):
            state[name] = torch.randn(p.shape, generator=gen) * std * 0.1
        else:
            state[name] = torch.randn(p.shape, generator=gen) * std
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not set(missing) & set(state), (missing, unexpected)


def _read_safetensors(directory: Path, only: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; with `only`, just those whose name contains it (a released MiMo checkpoint
    holds 300 GB of LLM weights beside a 1.5 GB vision tower: only the tower's are read)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if only is None or only in f".{name}":
                    state[name] = fh.get_tensor(name)
    return state


def _vision_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keeps the vision tower's weights, with any prefix up to `visual.` removed
    (`visual.`, `model.visual.` in full checkpoints; none in a vision-only one)."""
    out = {}
    has_visual = any(".visual." in f".{k}" for k in state)
    for k, v in state.items():
        if has_visual:
            pos = f".{k}".find(".visual.")
            if pos < 0:
                continue
            k = k[pos + len("visual.") :]
        out[k] = v
    return out


def _checkpoint_id(directory: Path) -> str:
    h = hashlib.sha256()
    h.update((directory / "config.json").read_bytes())
    for f in sorted(directory.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return f"{directory.name}@{h.hexdigest()[:16]}"


def load_vision_model(
    name_or_path: str,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    return_info: bool = False,
):
    """Loads a vision tower; returns the module (or a `LoadedVisionModel` with `return_info=True`).

    The module's `forward(pixel_values, grid_thw)` returns `[total_tokens_after_merge, out_dim]`.
    """
    torch_dtype = resolve_dtype(dtype)
    if name_or_path == TINY_RANDOM:
        model = Qwen2_5VisionTower(TINY_VISION_CONFIG)
        init_random_weights(model, TINY_SEED)
        info = LoadedVisionModel(model, f"tiny-qwen2_5_vl-vision-seed{TINY_SEED}", None)
    else:
        directory = Path(resolve_model(name_or_path))
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"model {name_or_path!r}: not {TINY_RANDOM!r} and not a checkpoint directory with a config.json"
            )
        cfg_dict = json.loads((directory / "config.json").read_text())
        model_type = cfg_dict.get("model_type", "")
        if model_type not in ("qwen2_5_vl", "qwen2_5_vl_vision", MIMO_VISION_TYPE) and "vision_config" not in cfg_dict:
            raise ValueError(
                f"model {name_or_path!r}: model_type {model_type!r} is not a Qwen2.5-VL checkpoint "
                "(expected qwen2_5_vl or qwen2_5_vl_vision) and its config has no vision_config"
            )
        model = _tower_for(cfg_dict)
        state = _vision_weights(_read_safetensors(directory, only=".visual."))
        if not state:  # a vision-only checkpoint: names without a prefix
            state = _vision_weights(_read_safetensors(directory))
        from mimo_epd.common.checkpoint import load_weights

        missing, unexpected = load_weights(model, state, directory)
        if missing:
            raise ValueError(
                f"model {name_or_path!r}: checkpoint lacks {len(missing)} vision weights, e.g. {missing[:5]}"
            )
        if unexpected:
            log.warning(
                "model %s: ignoring %d unexpected weights, e.g. %s", name_or_path, len(unexpected), unexpected[:5]
            )
        pp = directory / "preprocessor_config.json"
        kind = "mimovl" if isinstance(model, MiMoVisionTower) else "qwen2_5_vl"
        pre = json.loads(pp.read_text()) if pp.is_file() else None
        if isinstance(model, MiMoVisionTower):  # MiMo's processor settings live in config.json
            pre = mimo_preprocessor_config(cfg_dict)
        info = LoadedVisionModel(model, f"{kind}:{_checkpoint_id(directory)}", pre)
    model.to(device=device, dtype=torch_dtype).eval()
    info.model_id = f"{info.model_id}/{str(torch_dtype).removeprefix('torch.')}"
    return info if return_info else model


def mimo_preprocessor_config(cfg_dict: dict) -> dict:
    """A MiMo checkpoint's preprocessing, in `preprocessor_config.json`'s spelling (`PreprocessConfig.from_hf_dict`):
    MiMo's processor rules, its vision_config's geometry, the pixel bounds of its config's `processor_config`."""
    from ..preprocess import PreprocessConfig

    p = PreprocessConfig.mimo(cfg_dict.get("vision_config", cfg_dict), cfg_dict.get("processor_config"))
    return {
        "patch_size": p.patch_size,
        "merge_size": p.merge_size,
        "temporal_patch_size": p.temporal_patch_size,
        "min_pixels": p.min_pixels,
        "max_pixels": p.max_pixels,
        "image_mean": list(p.mean),
        "image_std": list(p.std),
        "processor": p.processor,
        "processor_config": cfg_dict.get("processor_config") or {},  # its video sampling (video/sampling.py)
    }


def _tower_for(cfg_dict: dict) -> VisionTower:
    """The tower a checkpoint's config names (its `vision_config`, or the config itself for a vision-only one)."""
    vision = cfg_dict.get("vision_config", cfg_dict)
    if vision.get("model_type") == MIMO_VISION_TYPE:
        return MiMoVisionTower(MiMoVisionConfig.from_hf_dict(vision))
    return Qwen2_5VisionTower(VisionConfig.from_hf_dict(cfg_dict))


def random_model(config: VisionConfig | MiMoVisionConfig, seed: int = TINY_SEED) -> VisionTower:
    """A tower of any config with deterministic random weights."""
    model: VisionTower = MiMoVisionTower(config) if isinstance(config, MiMoVisionConfig) else Qwen2_5VisionTower(config)
    init_random_weights(model, seed)
    return model.eval()


def save_checkpoint(model: Qwen2_5VisionTower, directory: str | Path) -> Path:
    """Writes `config.json` + `model.safetensors` in the layout transformers saves a
    `Qwen2_5_VisionTransformerPretrainedModel` in (loadable by transformers and by `load_vision_model`)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    rope_theta = cfg.pop("rope_theta")
    cfg.update(
        model_type="qwen2_5_vl_vision",
        num_heads=model.config.num_heads,
        rope_parameters={"rope_type": "axial", "rope_theta": rope_theta},
    )
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    return d


def save_mimo_checkpoint(model: MiMoVisionTower, directory: str | Path) -> Path:
    """Writes a vision-only MiMo checkpoint: `config.json` is the released `vision_config` (model_type mimovl) and
    `model.safetensors` with the tower's weights under `visual.` (the released names and row order)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))  # model_type mimovl
    state = {f"visual.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(d / "model.safetensors"))
    return d
