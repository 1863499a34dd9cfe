"""The audio tower's loader.

`load_audio_model(name)`: `tiny` and `tiny-random` give the Qwen2-Audio architecture at small sizes
(`TINY_AUDIO_CONFIG`, projecting into the tiny LLM's 256-wide hidden size) with seeded random weights (the
shipped `tiny` checkpoint has no audio weights of its own, so both names build the same tower without reading a
file). A checkpoint directory loads when its config has an `audio_config` (a Qwen2-Audio checkpoint, or a
MiMo / Omni-style checkpoint that embeds one) or is a `qwen2_audio_encoder`: the tower's weights are read
from `audio_tower.*` (any prefix up to it) and the projector's from `multi_modal_projector.linear.*`.
A checkpoint without an audio tower gives `None`: the server then refuses audio items, naming the reason.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mimo_epd.common.model_names import TINY, TINY_RANDOM, resolve_model

from .mimo_audio import MiMoAudioModel, load_mimo_audio
from .qwen2_audio import QWEN2_AUDIO_7B_CONFIG, AudioTowerConfig, Qwen2AudioTower

log = logging.getLogger(__name__)

TINY_AUDIO_CONFIG = AudioTowerConfig(
    num_mel_bins=128,
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    max_source_positions=1500,
    out_hidden_size=256,
)
TINY_AUDIO_SEED = 0
AUDIO_PRESETS = {"tiny": TINY_AUDIO_CONFIG, "qwen2_audio_7b": QWEN2_AUDIO_7B_CONFIG}


@dataclass
class LoadedAudioModel:
    module: Qwen2AudioTower | None  # Qwen2-Audio's tower (30-s windows of Whisper features, batched with images)
    model_id: str  # part of every audio content key
    mimo: MiMoAudioModel | None = None  # MiMo's tokenizer + encoder instead (`module` is then None)


def random_audio_model(cfg: AudioTowerConfig = TINY_AUDIO_CONFIG, seed: int = TINY_AUDIO_SEED) -> Qwen2AudioTower:
    """A tower of any config with deterministic random weights (LayerNorms at one, the position table
    sinusoidal, everything else small normal draws in a fixed order)."""
    model = Qwen2AudioTower(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "layer_norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.002)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def _audio_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        key = f".{k}"
        if ".audio_tower." in key:
            out[key[key.find(".audio_tower.") + len(".audio_tower.") :]] = v
        elif ".multi_modal_projector.linear." in key:
            out["proj." + key[key.find(".multi_modal_projector.linear.") + len(".multi_modal_projector.linear.") :]] = v
    if not out:  # an encoder saved alone: its own names
        out = {k: v for k, v in state.items() if not k.startswith("lm_head")}
    return out


def load_audio_model(
    name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedAudioModel | None:
    if name_or_path in (TINY, TINY_RANDOM):
        info = LoadedAudioModel(random_audio_model(), f"tiny-qwen2_audio-seed{TINY_AUDIO_SEED}")
    else:
        directory = Path(resolve_model(name_or_path))
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"model {name_or_path!r}: no config.json")
        cfg_dict = json.loads(cfg_path.read_text())
        if "audio_config" not in cfg_dict and cfg_dict.get("model_type") != "qwen2_audio_encoder":
            return None
        from mimo_epd.common.checkpoint import audio_kind

        kind = audio_kind(cfg_dict.get("audio_config")) if "audio_config" in cfg_dict else None
        if kind == "mimo_audio":
            from . import _checkpoint_id

            mimo = load_mimo_audio(str(directory), dtype, device)
            return LoadedAudioModel(
                None, f"mimo_audio:{_checkpoint_id(directory)}/{str(dtype).removeprefix('torch.')}", mimo
            )  # type: ignore[arg-type]
        if kind not in (None, "qwen2_audio_encoder"):
            log.warning(
                "model %s: its audio tower (%s) is not one the encoders run yet: audio refused", name_or_path, kind
            )
            return None
        cfg = AudioTowerConfig.from_hf_dict(cfg_dict)
        model = Qwen2AudioTower(cfg)
        from . import _checkpoint_id, _read_safetensors

        state = _audio_weights(_read_safetensors(directory))
        if "proj.weight" not in state and cfg.out_hidden_size == cfg.d_model:
            state |= {"proj.weight": torch.eye(cfg.d_model), "proj.bias": torch.zeros(cfg.d_model)}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing:
            raise ValueError(
                f"model {name_or_path!r}: checkpoint lacks {len(missing)} audio weights, e.g. {missing[:5]}"
            )
        if unexpected:
            log.warning("model %s: ignoring %d unexpected audio weights", name_or_path, len(unexpected))
        info = LoadedAudioModel(model, "audio:" + _checkpoint_id(directory))
    info.module.to(device=device, dtype=dtype).eval()
    info.model_id = f"{info.model_id}/{str(dtype).removeprefix('torch.')}"
    return info
