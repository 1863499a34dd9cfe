"""`mimo-epd encode-video` (a video file encoded in-process) and `mimo-epd make-test-video`.

Both draw a progress bar (count, rate, ETA) on stderr and print their JSON result on stdout, so
`mimo-epd encode-video x.mp4 | jq` works."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .common import FrameProgress, error, setup_logging


def add_sampling_arguments(p) -> None:
    from encoder_server.video.sampling import VideoSampling

    d, m = VideoSampling(), VideoSampling.mimo(None)
    model = "default: {} ({} for MiMo's tower: its checkpoint's processor_config)"
    p.add_argument(
        "--fps",
        type=float,
        default=None,
        help="frames sampled per second of video (" + model.format(d.fps, m.fps) + ")",
    )
    p.add_argument(
        "--max-frames",
        type=int,
        default=None,
        help="most frames sampled (" + model.format(d.max_frames, m.max_frames) + ")",
    )
    p.add_argument(
        "--min-frames",
        type=int,
        default=None,
        help="fewest frames sampled (" + model.format(d.min_frames, m.min_frames) + ")",
    )
    p.add_argument(
        "--video-min-pixels",
        type=int,
        default=None,
        help="min pixels per frame (" + model.format(d.min_pixels, m.min_pixels) + ")",
    )
    p.add_argument(
        "--video-max-pixels",
        type=int,
        default=None,
        help="max pixels per frame (" + model.format(d.max_pixels, m.max_pixels) + ")",
    )
    p.add_argument(
        "--video-total-pixels",
        type=int,
        default=None,
        help="pixel budget of all sampled frames together (" + model.format(d.total_pixels, m.total_pixels) + ")",
    )


def _sampling_from_args(args, base=None):
    """The sampling the flags ask for over `base` (the model's defaults; Qwen2-VL's without one)."""
    from dataclasses import replace

    from encoder_server.video.sampling import VideoSampling

    given = {
        "fps": args.fps,
        "max_frames": args.max_frames,
        "min_frames": args.min_frames,
        "min_pixels": args.video_min_pixels,
        "max_pixels": args.video_max_pixels,
        "total_pixels": args.video_total_pixels,
    }
    return replace(base or VideoSampling(), **{k: v for k, v in given.items() if v is not None})


def add_encode_video_flags(ev) -> None:
    ev.add_argument("video", help="video file (any container/codec FFmpeg reads)")
    add_sampling_arguments(ev)
    ev.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory (default: tiny)")
    ev.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    ev.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    ev.add_argument("--workers", type=int, default=0, help="parallel decoders, 0 = one per core (default: 0)")
    ev.add_argument(
        "--decode-mode",
        choices=["process", "thread"],
        default="process",
        help="decoders as processes or threads (default: process)",
    )
    ev.add_argument("--max-batch-tokens", type=int, default=16384, help="patches per forward (default: 16384)")
    ev.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = default) (default: 0)")
    ev.add_argument("--out", default="", help="save embedding, grid_thw and timestamps to this .safetensors file")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_encode_video(args) -> int:
    import torch

    from encoder_server.models import load_vision_model
    from encoder_server.preprocess import PreprocessConfig, preset_for_tower
    from encoder_server.video.decode import VideoError
    from encoder_server.video.encode import encode_video
    from encoder_server.video.sampling import VideoSampling

    setup_logging("warning")
    if not Path(args.video).is_file():
        return error(f"no such file: {args.video}")
    try:
        sampling = _sampling_from_args(args)
        sampling.validate()
        info = load_vision_model(args.model, args.device, args.dtype, return_info=True)
    except (ValueError, FileNotFoundError) as e:
        return error(str(e))
    tower = info.module.config
    pre = (
        PreprocessConfig.from_hf_dict(info.preprocessor_config)
        if info.preprocessor_config
        else preset_for_tower(tower.patch_size)
    )
    if pre.exact_floats:  # MiMo's frame rules and its checkpoint's sampling defaults under the flags
        pc = (info.preprocessor_config or {}).get("processor_config")
        try:
            sampling = _sampling_from_args(args, VideoSampling.mimo(pc, pre.factor))
            sampling.validate()
        except ValueError as e:
            return error(str(e))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    with FrameProgress(["decoded", "encoded"], unit="frames", disable=args.no_progress) as bar:

        def progress(decoded: int, encoded: int, total: int) -> None:
            bar.update(total=total, decoded=decoded, encoded=encoded)

        try:
            result = encode_video(
                args.video,
                info.module,
                pre,
                sampling,
                workers=args.workers or os.cpu_count() or 2,
                mode=args.decode_mode,
                max_batch_tokens=args.max_batch_tokens,
                progress=progress,
                device=args.device,
            )
        except VideoError as e:
            return error(f"{args.video}: {e}", 1)
        progress(result.frames_sampled, result.frames_sampled, result.frames_sampled)
    summary = {
        "video": args.video,
        "model": info.model_id,
        "sampling": {"fps": sampling.fps, "min_frames": sampling.min_frames, "max_frames": sampling.max_frames},
        **result.summary(),
    }
    if args.out:
        from safetensors.torch import save_file

        save_file(
            {
                "embedding": result.embedding.contiguous(),
                "grid_thw": torch.tensor(result.grid_thw),
                "timestamps_s": torch.tensor(result.timestamps_s, dtype=torch.float64),
            },
            args.out,
            metadata={"summary": json.dumps(summary)},
        )
        summary["out"] = args.out
    print(json.dumps(summary))
    return 0


def add_make_test_video_flags(mv) -> None:
    mv.add_argument("--minutes", type=float, default=2.0, help="length in minutes (default: 2)")
    mv.add_argument("--seconds", type=float, default=0.0, help="length in seconds; overrides --minutes (default: 0)")
    mv.add_argument("--out", required=True, help="output file (.mp4)")
    mv.add_argument("--width", type=int, default=640, help="width (default: 640)")
    mv.add_argument("--height", type=int, default=360, help="height (default: 360)")
    mv.add_argument("--fps", type=int, default=30, help="frame rate (default: 30)")
    mv.add_argument("--gop", type=int, default=250, help="keyframe interval in frames (default: 250)")
    mv.add_argument("--preset", default="veryfast", help="x264 preset (default: veryfast)")
    mv.add_argument(
        "--with-audio",
        type=int,
        default=0,
        metavar="HZ",
        help="also write a speech-like AAC soundtrack at this sample rate, e.g. 16000 (default: 0, no audio)",
    )
    mv.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_make_test_video(args) -> int:
    from mimo_epd.testing.video_gen import make_test_video

    seconds = args.seconds if args.seconds else args.minutes * 60
    with FrameProgress(["written"], unit="frames", disable=args.no_progress) as bar:
        try:
            info = make_test_video(
                args.out,
                seconds,
                width=args.width,
                height=args.height,
                fps=args.fps,
                gop=args.gop,
                preset=args.preset,
                audio_rate=args.with_audio,
                progress=lambda i, n: bar.update(total=n, written=i),
            )
        except ValueError as e:
            return error(str(e))
        bar.update(total=info["frames"], written=info["frames"])
    print(json.dumps(info))
    return 0


def register(commands) -> None:
    commands.command(
        "encode-video",
        "encode a video file in-process: progress on stderr, JSON summary on stdout",
        setup=add_encode_video_flags,
        run=run_encode_video,
        epilog="example:\n  mimo-epd encode-video clip.mp4 --fps 1 | jq .frames_sampled",
    )
    commands.command(
        "make-test-video",
        "write a realistic H.264 test video with PyAV (progress on stderr)",
        setup=add_make_test_video_flags,
        run=run_make_test_video,
    )
