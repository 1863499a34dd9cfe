"""Every setting of the encoder server: one dataclass, one field per command-line flag.

The CLI builds its flags from these fields (name, type, default, help) through mimo_epd/common/flags.py, the
same way every command does, and docs/cli.md is generated from the parsers, so a default is written once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mimo_epd.common import flags

from .decoders import check_decoder_name

_f = flags.flag


@dataclass
class EncoderServerConfig:
    # --- serving -------------------------------------------------------------------------------
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(50051, "gRPC port (0 = pick a free one; the ready line tells which)")
    model: str = _f(
        "tiny",
        "'tiny' (the shipped default model's tower), 'tiny-random' (seeded random weights) or a transformers "
        "checkpoint directory (Qwen2.5-VL, or mimo_v2_flash with a vision_config)",
    )
    device: str = _f("cpu", "torch device for preprocessing and the vision tower (cpu, cuda, cuda:1)")
    dtype: str = _f("float32", "vision tower dtype: float32, bfloat16 or float16")
    preprocess: str = _f("auto", "preprocessing preset: auto (from the checkpoint), qwen2_5_vl or mimo_v2_5")
    min_pixels: int = _f(0, "override the preset's min_pixels (0 = keep)")
    max_pixels: int = _f(0, "override the preset's max_pixels (0 = keep)")
    resize_backend: str = _f(
        "auto", "auto (PIL on a CPU with pillow-simd, else torch), torch (torchvision on --device) or pil"
    )
    grace_period_s: float = _f(10.0, "on SIGTERM/SIGINT, seconds to let in-flight requests finish")
    max_message_mb: int = _f(256, "largest gRPC message accepted or sent, in MiB")
    log_level: str = _f("info", "debug, info, warning or error")
    # --- limits --------------------------------------------------------------------------------
    max_items_per_request: int = _f(64, "items in one Encode request")
    max_item_bytes: int = _f(64 << 20, "bytes of one item (inline, fetched or read)")
    max_image_pixels: int = _f(8192 * 8192, "decoded pixels of one image (decompression-bomb guard)")
    max_pending: int = _f(1024, "items admitted and not yet answered; beyond it requests get RESOURCE_EXHAUSTED")
    queue_depth: int = _f(256, "capacity of each bounded queue between pipeline stages")
    # --- video ---------------------------------------------------------------------------------
    max_video_bytes: int = _f(1 << 30, "bytes of one video item")
    max_video_seconds: float = _f(4 * 3600.0, "duration of one video")
    max_video_frames_total: int = _f(1_000_000, "frames in one video's stream (checked while probing)")
    video_fps: float = _f(2.0, "default frames sampled per second of video (per item: VideoOptions.fps)")
    video_max_frames: int = _f(768, "default and largest number of frames sampled from one video")
    video_min_frames: int = _f(4, "default fewest frames sampled from one video")
    video_decode_workers: int = _f(2, "parallel decoders per video")
    video_decode_mode: str = _f("process", "video decoders as processes or threads")
    max_concurrent_videos: int = _f(1, "videos encoded at once (each uses --video-decode-workers decoders)")
    # --- audio ---------------------------------------------------------------------------------
    audio_model: str = _f(
        "",
        "the audio tower: empty = from --model (tiny and tiny-random: the tiny Qwen2-Audio tower; a checkpoint: "
        "its audio_config, if any), a checkpoint directory, or 'none' (audio items refused)",
    )
    max_audio_bytes: int = _f(1 << 30, "bytes of one audio item")
    max_audio_seconds: float = _f(4 * 3600.0, "duration of one audio item")
    audio_min_sample_rate: int = _f(1000, "lowest sample rate accepted, in Hz")
    audio_max_sample_rate: int = _f(384_000, "highest sample rate accepted, in Hz")
    audio_max_channels: int = _f(32, "most channels accepted")
    audio_chunk_seconds: float = _f(300.0, "long audio is decoded in ranges of this many seconds (a multiple of 30)")
    audio_parallel_above_s: float = _f(120.0, "audio longer than this is decoded in parallel ranges")
    audio_decode_lookahead: int = _f(4, "ranges of one audio item decoding at once")
    audio_features_in: str = _f(
        "auto", "where log-mel features are computed: decoder (the decode processes), device, or auto (device on CUDA)"
    )
    max_concurrent_audios: int = _f(8, "audio items decoding and encoding at once")
    audio_seconds_in_flight: float = _f(
        7200.0,
        "MiMo's audio: seconds of audio decoded whole and held at once (4 bytes a sample at 24 kHz: 2 h = 0.7 GB); "
        "an item waits until its duration fits (one longer than this runs alone)",
    )
    # --- fetching ------------------------------------------------------------------------------
    fetch_timeout_s: float = _f(10.0, "deadline for fetching one URL, redirects included")
    fetch_concurrency: int = _f(32, "URLs fetched at once (also the connection pool size)")
    fetch_per_host: int = _f(
        8, "URLs fetched at once from one host (of --fetch-concurrency), so one slow host cannot take every fetch slot"
    )
    max_redirects: int = _f(5, "redirects followed per URL (each re-checked against the URL policy)")
    allow_private_urls: bool = _f(
        False,
        "allow URLs that resolve to loopback/private/link-local addresses (cloud metadata addresses stay refused)",
    )
    url_allowlist: str = _f("", "comma-separated IPs/CIDRs that may be fetched even though private, e.g. 127.0.0.1/32")
    allowed_local_dir: str = _f("", "directory under which MediaItem.path may read files (empty = paths disabled)")
    # --- pipeline (each optimisation has a switch, so benchmarks can compare them) -----------------
    pipeline: bool = _f(True, "overlap requests and stages; off = one request at a time, stage after stage")
    batching: bool = _f(True, "batch items across requests into one forward; off = one item per forward")
    decode_workers: int = _f(2, "decoder processes, pixels handed back through shared memory (0 = decode in a thread)")
    decoder: str = _f(
        "turbo",
        "image decoder: turbo (libjpeg-turbo straight into numpy via simplejpeg, pixels identical "
        "to pil), pil (pillow-simd when installed), torchvision (decode_jpeg) or dali (NVIDIA "
        "DALI, CPU pipeline; needs the dali extra); non-JPEG images always use PIL",
    )
    jpeg_draft: bool = _f(True, "decode JPEGs at a reduced DCT scale when the target is at most half the source")
    resize_in: str = _f(
        "auto",
        "where images are resized: device (torch on --device), decoder (PIL/pillow-simd in "
        "the decode processes) or auto (decoder on a CPU, device on CUDA)",
    )
    decode_inflight: int = _f(
        2,
        "decode jobs in flight per decoder process: one decoding, the next already "
        "queued, so a process never waits on the server between images",
    )
    decode_slot_bytes: int = _f(
        32 << 20, "size of each shared-memory slot for decoded pixels (bigger images come back pickled)"
    )
    torch_threads: int = _f(
        0,
        "intra-op threads for the vision forward (0 = auto: on a CPU with decode processes, the forward tuner "
        "gives the forward the cores the decoders leave while it is the bottleneck, from measured stage busy "
        "fractions, and keeps the setting that measures more throughput)",
    )
    forward_workers: int = _f(
        0,
        "vision forwards run at once, each on its own batch and thread (0 = auto: on a CPU with decode processes "
        "the forward tuner measures one and two and keeps the faster; on --device cuda one per visible GPU, worker "
        "i on GPU i mod N with its own stream; else 1)",
    )
    metrics_port: int = _f(0, "serve Prometheus metrics on this port at /metrics (0 = off)")
    preprocess_threads: int = _f(1, "threads running resize/normalize/patchify")
    max_batch_tokens: int = _f(16384, "vision patches per forward (a single larger item runs alone)")
    max_wait_ms: float = _f(5.0, "how long the batcher waits for more items once it has one")
    batch_follow_queue: bool = _f(
        True,
        "grow the batch's token budget and wait while the forward is behind its queue (bigger batches amortise "
        "it), back to --max-batch-tokens / --max-wait-ms when it keeps up; off = fixed",
    )
    max_batch_tokens_peak: int = _f(65536, "the most vision patches per forward the following budget grows to")
    max_wait_ms_peak: float = _f(20.0, "the longest wait the following budget grows to")
    cache_bytes: int = _f(
        512 << 20, "in-process embedding cache size in bytes, used without --shm-cache-name (0 = no cache)"
    )
    shm_cache_name: str = _f(
        "",
        "node-local shared-memory embedding cache to use, created or attached by name (empty = the in-process cache)",
    )
    shm_cache_bytes: int = _f(1 << 30, "size of the shared-memory cache when this process creates it")
    embedding_store: str = _f(
        "",
        "the fleet's embedding cache (L3) on Mooncake Store: mooncake://MASTER_HOST[:PORT][?metadata=URL&protocol=..."
        "] (empty = none; a miss here is looked up there before encoding, and what this encoder encodes is written "
        "there)",
    )
    embedding_store_segment_bytes: int = _f(1 << 30, "memory this encoder contributes to the embedding store's pool")
    embedding_store_max_item_bytes: int = _f(64 << 20, "larger embeddings are not written to the embedding store")
    embedding_lease: str = _f(
        "",
        "redis:// URL of the fleet-wide encode lease (concurrent misses of one item anywhere encode it once; empty = "
        "none; serve passes its --router-state)",
    )
    embedding_lease_ms: int = _f(30000, "how long an encode lease lasts at most (a dead holder costs this long)")
    embedding_transfer: str = _f(
        "",
        "send embeddings to LLM workers that ask for it (their --encoder-transfer) over Mooncake's transfer engine: "
        "tcp or rdma (empty = always as bytes in the gRPC reply)",
    )
    embedding_transfer_device: str = _f("", "RDMA device names for --embedding-transfer rdma (empty = auto)")
    embedding_transfer_staging_bytes: int = _f(
        1 << 30,
        "registered memory holding rows until their worker's Transfer (an item that finds no room goes as bytes)",
    )
    embedding_transfer_hold_s: float = _f(30.0, "held rows that no Transfer took within this long are freed")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
        flags.add_arguments(parser, cls, only=only)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EncoderServerConfig":
        cfg = flags.from_args(cls, args)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        positive = [
            "max_video_bytes",
            "max_video_seconds",
            "max_video_frames_total",
            "video_decode_workers",
            "max_concurrent_videos",
            "decode_inflight",
            "decode_slot_bytes",
            "shm_cache_bytes",
            "max_items_per_request",
            "max_item_bytes",
            "max_image_pixels",
            "max_pending",
            "queue_depth",
            "fetch_concurrency",
            "max_batch_tokens",
            "max_batch_tokens_peak",
            "preprocess_threads",
            "max_message_mb",
            "max_audio_bytes",
            "max_audio_seconds",
            "audio_min_sample_rate",
            "audio_max_channels",
            "audio_decode_lookahead",
            "max_concurrent_audios",
            "audio_seconds_in_flight",
            "embedding_store_segment_bytes",
            "embedding_store_max_item_bytes",
            "embedding_lease_ms",
            "embedding_transfer_staging_bytes",
            "embedding_transfer_hold_s",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in (
            "decode_workers",
            "torch_threads",
            "forward_workers",
            "metrics_port",
            "max_redirects",
            "cache_bytes",
            "min_pixels",
            "max_pixels",
            "max_wait_ms",
            "max_wait_ms_peak",
            "fetch_timeout_s",
            "grace_period_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.embedding_transfer not in ("", "tcp", "rdma"):
            raise ValueError(f"--embedding-transfer must be tcp, rdma or empty, got {self.embedding_transfer!r}")
        if self.video_decode_mode not in ("process", "thread"):
            raise ValueError(f"--video-decode-mode must be process or thread, got {self.video_decode_mode!r}")
        if self.video_fps <= 0 or self.video_min_frames < 1 or self.video_max_frames < self.video_min_frames:
            raise ValueError("need --video-fps > 0 and 1 <= --video-min-frames <= --video-max-frames")
        if self.audio_features_in not in ("auto", "decoder", "device"):
            raise ValueError(f"--audio-features-in must be auto, decoder or device, got {self.audio_features_in!r}")
        if self.audio_max_sample_rate < self.audio_min_sample_rate:
            raise ValueError("need --audio-min-sample-rate <= --audio-max-sample-rate")
        if self.audio_chunk_seconds <= 0 or self.audio_chunk_seconds % 30:
            raise ValueError(
                f"--audio-chunk-seconds must be a positive multiple of 30, got {self.audio_chunk_seconds:g}"
            )
        if self.max_batch_tokens_peak < self.max_batch_tokens or self.max_wait_ms_peak < self.max_wait_ms:
            raise ValueError(
                "need --max-batch-tokens-peak >= --max-batch-tokens and --max-wait-ms-peak >= --max-wait-ms"
            )
        check_decoder_name(self.decoder)  # the decoders package's registry is the one list of names
        if self.resize_in not in ("auto", "device", "decoder"):
            raise ValueError(f"--resize-in must be auto, device or decoder, got {self.resize_in!r}")
        if self.resize_backend not in ("auto", "torch", "pil"):
            raise ValueError(f"--resize-backend must be auto, torch or pil, got {self.resize_backend!r}")
        if self.preprocess not in ("auto", "qwen2_5_vl", "mimo_v2_5"):
            raise ValueError(f"--preprocess must be auto, qwen2_5_vl or mimo_v2_5, got {self.preprocess!r}")
