"""Tiny checkpoints saved the way users bring theirs: transformers' `save_pretrained` of a `mimo_v2_flash` LLM (text
only, or with a Qwen2.5-VL vision tower's `vision_config` and `visual.*` weights beside it, as MiMo-V2.5 is laid
out), and of a `qwen2_5_vl` model; with or without the shipped tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mimo_epd.data import TINY_MODEL


def mimo_checkpoint(d: Path, hidden: int = 64, vision_width: int | None = None, tokenizer: bool = True) -> Path:
    """A `mimo_v2_flash` checkpoint in `d` (4096-token vocabulary, the shipped tokenizer's); `vision_width`: with a
    tiny vision tower of that output width (config.json `vision_config`, `visual.*` weights)."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    torch.manual_seed(0)
    cfg = MiMoV2FlashConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window_size=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
    )
    MiMoV2FlashForCausalLM(cfg).eval().save_pretrained(d)
    if vision_width is not None:
        _add_vision_tower(d, vision_width)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(TINY_MODEL, name), d / name)
    return d


def _add_vision_tower(d: Path, width: int) -> None:
    from dataclasses import replace

    from safetensors.torch import save_file

    from encoder_server.models import TINY_VISION_CONFIG, random_model

    tower = random_model(replace(TINY_VISION_CONFIG, out_hidden_size=width))
    save_file({f"visual.{k}": v.contiguous() for k, v in tower.state_dict().items()}, str(d / "visual.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    vision = tower.config.to_dict()
    vision["model_type"] = "qwen2_5_vl_vision"
    cfg["vision_config"] = vision
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    index = d / "model.safetensors.index.json"
    if index.is_file():  # a sharded save: name the tower's file in the index too
        idx = json.loads(index.read_text())
        idx["weight_map"].update({f"visual.{k}": "visual.safetensors" for k in tower.state_dict()})
        index.write_text(json.dumps(idx))


def qwen_vl_checkpoint(d: Path, width: int = 64) -> Path:
    """A tiny `qwen2_5_vl` checkpoint (its vision tower's output width `width`) saved by transformers."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=512,
            hidden_size=width,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=width, fullatt_block_indexes=[]
        ),
    )
    Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(d)
    return d
