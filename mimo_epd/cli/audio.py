"""`mimo-epd encode-audio` (an audio file encoded in-process) and `mimo-epd make-test-audio`.

Both draw a progress bar on stderr and print their JSON result on stdout, so
`mimo-epd encode-audio talk.mp3 | jq` works."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .common import FrameProgress, error, setup_logging


def add_encode_audio_flags(p) -> None:
    p.add_argument("audio", help="audio file (WAV, FLAC, MP3, Ogg/Opus, AAC/M4A: anything PyAV decodes)")
    p.add_argument(
        "--model", default="tiny", help="'tiny' or a checkpoint directory with an audio tower (default: tiny)"
    )
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    p.add_argument("--workers", type=int, default=0, help="parallel range decoders, 0 = one per core (default: 0)")
    p.add_argument("--chunk-seconds", type=float, default=300.0, help="seconds per decoded range (default: 300)")
    p.add_argument(
        "--parallel-above-s", type=float, default=120.0, help="decode in parallel ranges above this (default: 120)"
    )
    p.add_argument("--max-batch-windows", type=int, default=8, help="30-s windows per tower forward (default: 8)")
    p.add_argument("--max-seconds", type=float, default=4 * 3600.0, help="longest audio accepted (default: 14400)")
    p.add_argument("--out", default="", help="save embedding and window_tokens to this .safetensors file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_encode_audio(args) -> int:
    import torch

    from encoder_server.audio.decode import AudioError, AudioLimits
    from encoder_server.audio.encode import AudioPlan, encode_audio_file
    from encoder_server.models import resolve_dtype
    from encoder_server.models.audio_loader import load_audio_model

    setup_logging("warning")
    if not Path(args.audio).is_file():
        return error(f"no such file: {args.audio}")
    try:
        plan = AudioPlan(
            limits=AudioLimits(max_seconds=args.max_seconds),
            chunk_s=args.chunk_seconds,
            parallel_above_s=args.parallel_above_s,
        )
        plan.validate()
        model = load_audio_model(args.model, args.device, resolve_dtype(args.dtype))
    except (ValueError, FileNotFoundError) as e:
        return error(str(e))
    if model is None:
        return error(f"model {args.model!r} has no audio tower (no audio_config)")
    if model.module is None:
        return error(
            f"model {args.model!r}: MiMo's audio is served by the encoder (`serve` / `encoder`); this command runs "
            "Qwen2-Audio's streamed 30-s windows only"
        )
    with FrameProgress(["encoded"], unit="s", disable=args.no_progress) as bar:
        try:
            result = encode_audio_file(
                args.audio,
                model.module,
                plan,
                workers=args.workers or os.cpu_count() or 2,
                max_batch_windows=args.max_batch_windows,
                progress=lambda done, total: bar.update(total=int(total), encoded=int(done)),
                device=args.device,
            )
        except AudioError as e:
            return error(f"{args.audio}: {e}", 1)
    summary = {
        "audio": args.audio,
        "model": model.model_id,
        "info": result.info.summary(),
        "decoded_s": round(result.decoded_s, 3),
        "windows": len(result.window_tokens),
        "num_tokens": int(result.embedding.shape[0]),
        "hidden": int(result.embedding.shape[1]),
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
    }
    if args.out:
        from safetensors.torch import save_file

        save_file(
            {"embedding": result.embedding.contiguous(), "window_tokens": torch.tensor(result.window_tokens)},
            args.out,
            metadata={"summary": json.dumps(summary)},
        )
        summary["out"] = args.out
    print(json.dumps(summary))
    return 0


def add_make_test_audio_flags(p) -> None:
    p.add_argument("--minutes", type=float, default=1.0, help="length in minutes (default: 1)")
    p.add_argument("--seconds", type=float, default=0.0, help="length in seconds; overrides --minutes (default: 0)")
    p.add_argument("--out", required=True, help="output file: .wav, .flac, .mp3, .ogg or .m4a")
    p.add_argument("--rate", type=int, default=16000, help="sample rate in Hz (default: 16000)")
    p.add_argument("--channels", type=int, default=1, choices=[1, 2], help="channels (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="the signal's seed (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_make_test_audio(args) -> int:
    from mimo_epd.testing.audio_gen import make_test_audio

    seconds = args.seconds if args.seconds else args.minutes * 60
    with FrameProgress(["written"], unit="s", disable=args.no_progress) as bar:
        try:
            info = make_test_audio(
                args.out,
                seconds,
                rate=args.rate,
                seed=args.seed,
                channels=args.channels,
                progress=lambda done: bar.update(total=int(seconds), written=int(done)),
            )
        except ValueError as e:
            return error(str(e))
    print(json.dumps(info))
    return 0


def register(commands) -> None:
    commands.command(
        "encode-audio",
        "encode an audio file in-process: progress on stderr, JSON summary on stdout",
        setup=add_encode_audio_flags,
        run=run_encode_audio,
        epilog="example:\n  mimo-epd encode-audio talk.mp3 | jq .num_tokens",
    )
    commands.command(
        "make-test-audio",
        "write a reproducible speech-like test signal with PyAV (progress on stderr)",
        setup=add_make_test_audio_flags,
        run=run_make_test_audio,
    )
