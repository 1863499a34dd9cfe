"""Writes a trained tiny model as a checkpoint directory in the layout of a released one.

- `model.safetensors`: the LLM's weights in bf16 under transformers' names (written by transformers'
  `save_pretrained` from `transformers_twin`, so transformers loads them as `MiMoV2FlashForCausalLM`), plus
  the MTP layers under MiMo's release names (`model.mtp.layers.{i}.*`, sinks as `attention_sink_bias`) in bf16,
  plus the tiny vision tower (`encoder_server.models.TINY_VISION_CONFIG`, seeded random weights, output width =
  the LLM's hidden size) under `visual.*` in fp32: the same weights `random_model(TINY_VISION_CONFIG)` builds;
- `config.json`: the original (release) layout of a `mimo_v2_flash` config (`hybrid_layer_pattern`,
  `sliding_window_size`, `swa_*`, ...; llm_backend/models/released.py), with `num_nextn_predict_layers` and a
  `vision_config` (Qwen2.5-VL vision fields, as in a `qwen2_5_vl` checkpoint). transformers reads the converted
  layout (tests/llm/test_tiny_model.py writes one beside the same files);
- `generation_config.json`, `tokenizer.json`, `tokenizer_config.json` (with the chat template), and a README
  with the model card (what it was trained on, the licence).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

MODEL_CARD = """\
# tiny: mimo-epd's default model

A MiMo-V2-Flash-architecture model ({params:,} parameters: {layers} layers, hidden {hidden}, {experts} experts
top-{topk}, {mtp} MTP layers) trained on a CPU by `mimo-epd train-tiny` on the Python 3.11 documentation
(Debian package `python3.11-doc`, Python Software Foundation License Version 2) and on chat samples built from
it. It is small and often wrong: it exists so that the serving stack has a real model to run. The tiny vision
tower under `visual.*` has seeded random weights. docs/model.md has the recipe, the figures and how to retrain.
"""


def round_to_bf16(model: torch.nn.Module) -> None:
    """Rounds every weight to bf16 and back (what the shipped file stores), leaving the router's bias in fp32."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def _vision(hidden: int):
    """The tiny vision tower's config and weights, its output width the LLM's hidden size."""
    from dataclasses import replace

    from encoder_server.models import TINY_VISION_CONFIG, random_model, save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(random_model(replace(TINY_VISION_CONFIG, out_hidden_size=hidden)), tmp)
        from safetensors.torch import load_file

        cfg = json.loads((Path(tmp) / "config.json").read_text())
        return cfg, load_file(str(Path(tmp) / "model.safetensors"))


def write_checkpoint(model, tokenizer, out: str) -> Path:
    from safetensors.torch import load_file, save_file

    from llm_backend.models import transformers_twin
    from llm_backend.models.released import release_config

    from .tokenizer import save_tokenizer

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    hidden = model.config.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        hf = transformers_twin(model).to(torch.bfloat16)
        hf.save_pretrained(tmp, safe_serialization=True)
        files = sorted(Path(tmp).glob("*.safetensors"))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
    for k, v in model.state_dict().items():
        if k.endswith("e_score_correction_bias"):  # the router's choice bias stays fp32, as the router does
            state[k] = v.float().contiguous()
        if k.startswith("model.mtp.") and not k.endswith("inv_freq"):
            state[k.replace(".self_attn.sinks", ".self_attn.attention_sink_bias")] = v.to(torch.bfloat16).contiguous()
    vision_cfg, vision_state = _vision(hidden)
    state.update({f"visual.{k}": v.float().contiguous() for k, v in vision_state.items()})
    for f in d.glob("*.safetensors"):
        f.unlink()
    save_file(dict(sorted(state.items())), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "model.safetensors").chmod(0o644)
    cfg = release_config(model.config)  # the original layout, as the released checkpoints are written
    cfg["vision_config"] = vision_cfg
    cfg["torch_dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": model.config.bos_token_id,
        "eos_token_id": model.config.eos_token_id,
        "pad_token_id": model.config.bos_token_id,
        "do_sample": False,
    }
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(tokenizer, d, model_max_length=65536)
    (d / "README.md").write_text(
        MODEL_CARD.format(
            params=sum(p.numel() for p in model.parameters()),
            layers=model.config.num_hidden_layers,
            hidden=hidden,
            experts=model.config.n_routed_experts,
            topk=model.config.num_experts_per_tok,
            mtp=model.config.num_nextn_predict_layers,
        )
    )
    shutil.rmtree(d / ".cache", ignore_errors=True)
    return d
