"""One audio item from its bytes to its embedding: planned parallel decode, features, tower, streamed.

The plan (the video path's, in time instead of GOPs): the file is cut into `chunk_s`-second ranges
(`chunk_s` a multiple of the 30-s window), each decoded by its own decoder that seeks by timestamp
(`decode.decode(start_s, end_s)`); a range's samples are cut into windows and turned into log-mel features
where they were decoded (`chunk_job`, in a decode process) or, with `features_on` a device, by the caller.
Ranges tile the signal exactly, so the windows are those of one sequential decode.

Streaming: at most `lookahead` ranges are decoding at once and every finished range's windows go to the
tower (`encode_windows`) while later ranges decode; ranges are consumed in order, so memory holds the
ranges in flight plus the embeddings, never the whole signal or all the features.

A window yields `tokens_per_window(frames)` embedding rows. A trailing window with too few samples for a
token (under 20 ms) is dropped; an item with no token at all is refused. The result's `window_tokens` says
how many rows each window gave, and `seconds` the time spent decoding (waited for), and encoding.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, ClassVar

import numpy as np
import torch

from ..models.qwen2_audio import conv_lengths, tokens_per_window
from .decode import AudioError, AudioInfo, AudioLimits, decode, plan_ranges, probe
from .features import AudioFeatureConfig, LogMel


@dataclass(frozen=True)
class AudioPlan:
    """How one server (or the CLI) decodes audio."""

    features: AudioFeatureConfig = AudioFeatureConfig()
    limits: AudioLimits = AudioLimits()
    chunk_s: float = 300.0  # seconds per decoded range (a multiple of the window)
    parallel_above_s: float = 120.0  # shorter items are decoded as one range
    lookahead: int = 4  # ranges decoding at once

    def ranges(self, duration_s: float) -> list[tuple[float, float | None]]:
        if duration_s <= self.parallel_above_s:
            return [(0.0, None)]
        return plan_ranges(duration_s, self.chunk_s)

    def validate(self) -> None:
        w = self.features.chunk_length
        if self.chunk_s <= 0 or self.chunk_s % w:
            raise ValueError(f"--audio-chunk-seconds must be a positive multiple of {w}, got {self.chunk_s:g}")
        if self.lookahead < 1:
            raise ValueError("the audio lookahead must be at least 1")


@dataclass
class ChunkFeatures:
    """One decoded range: its windows' features (or its samples, when features are computed elsewhere)."""

    features: np.ndarray | None  # [n, n_mels, window_frames] float32
    frames: list[int]  # valid mel frames per window
    samples: np.ndarray | None = None
    decode_s: float = 0.0
    n_samples: int = 0


def chunk_job(src: str | bytes, start_s: float, end_s: float | None, plan: AudioPlan, features: bool) -> ChunkFeatures:
    """Decodes one range (and computes its features when `features`); runs in a decode process."""
    t0 = time.perf_counter()
    samples = decode(src, plan.features.sampling_rate, plan.limits, start_s, end_s)
    if start_s <= 0 and end_s is None and samples.size / plan.features.sampling_rate > plan.limits.max_seconds:
        raise AudioError(
            f"the audio lasts {samples.size / plan.features.sampling_rate:.1f} s, over the limit of "
            f"{plan.limits.max_seconds:g} s (--max-audio-seconds)"
        )
    if not features:
        return ChunkFeatures(None, [], samples, time.perf_counter() - t0, samples.size)
    torch.set_num_threads(1)  # a decode process is one core's worth of work
    lm = LogMel(plan.features)
    feats, frames = lm.features(samples)
    return ChunkFeatures(feats.numpy(), frames, None, time.perf_counter() - t0, samples.size)


def probe_job(src: str | bytes, plan: AudioPlan) -> AudioInfo:
    return probe(src, plan.limits)


@dataclass
class AudioResult:
    embedding: torch.Tensor  # [tokens, hidden] on the CPU
    window_tokens: list[int]
    info: AudioInfo
    decoded_s: float  # seconds of audio decoded
    seconds: dict[str, float] = field(default_factory=dict)
    codes: torch.Tensor | None = None  # MiMo's audio: the item's codes [frames, quantizers] (cached beside its rows)


def usable_windows(frames: list[int]) -> int:
    """How many leading windows yield tokens (only the last can be too short)."""
    n = len(frames)
    while n and int(tokens_per_window(torch.tensor(frames[n - 1]))) <= 0:
        n -= 1
    return n


async def decoded_ranges(
    src: str | bytes, plan: AudioPlan, run: Callable[..., Awaitable], ranges, features: bool
) -> AsyncIterator[ChunkFeatures]:
    """Each range's `chunk_job` result, in order, with at most `plan.lookahead` ranges decoding at once (the rest
    are cancelled when the consumer stops early)."""
    pending: list[asyncio.Future] = []

    def start(i: int) -> None:
        a, b = ranges[i]
        pending.append(asyncio.ensure_future(run(chunk_job, src, a, b, plan, features)))

    try:
        for i in range(min(plan.lookahead, len(ranges))):
            start(i)
        for i in range(len(ranges)):
            chunk: ChunkFeatures = await pending[i]
            pending[i] = None  # type: ignore[call-overload]  # its samples are the consumer's now
            if i + plan.lookahead < len(ranges):
                start(i + plan.lookahead)
            yield chunk
    finally:
        for f in pending:
            if f is not None:
                f.cancel()


async def encode_audio(
    src: str | bytes,
    plan: AudioPlan,
    run: Callable[..., Awaitable],
    encode_windows: Callable[[torch.Tensor, list[int]], Awaitable[list[torch.Tensor]]],
    features_on: LogMel | None = None,
) -> AudioResult:
    """`run(fn, *args)` runs a job where decoding happens (a decode process); `encode_windows(features,
    frames)` returns each window's embedding; `features_on`, when given, computes features there instead of
    in the decoders (on the device)."""
    t0 = time.perf_counter()
    info: AudioInfo = await run(probe_job, src, plan)
    ranges = plan.ranges(info.duration_s)
    out: list[torch.Tensor] = []
    window_tokens: list[int] = []
    waited = encode_s = 0.0
    decoded = 0
    rate = plan.features.sampling_rate
    tw = time.perf_counter()
    i = 0
    async for chunk in decoded_ranges(src, plan, run, ranges, features_on is None):
        waited += time.perf_counter() - tw
        decoded += chunk.n_samples
        if chunk.samples is not None:
            feats, frames = await asyncio.to_thread(features_on.features, chunk.samples)  # type: ignore[union-attr]
        else:
            feats, frames = torch.from_numpy(chunk.features), chunk.frames
        chunk = None  # type: ignore[assignment]
        n = usable_windows(frames) if i == len(ranges) - 1 else len(frames)
        i += 1
        if n:
            te = time.perf_counter()
            embs = await encode_windows(feats[:n], frames[:n])
            encode_s += time.perf_counter() - te
            out += embs
            window_tokens += [int(e.shape[0]) for e in embs]
        tw = time.perf_counter()
    if not out:
        raise AudioError("the audio is too short for one token (it needs at least 20 ms)")
    emb = torch.cat(out) if len(out) > 1 else out[0]
    total = time.perf_counter() - t0
    return AudioResult(
        emb, window_tokens, info, decoded / rate, {"total": total, "wait_decode": waited, "encode": encode_s}
    )


@dataclass(eq=False)
class AudioWindowItem:
    """One 30-s window in the cross-request batcher (the batcher's item protocol: `kind`, `num_patches`,
    `job`, `enqueued_at`, `run_group`, `complete`). It costs the budget its transformer positions.
    It is its own `job`: wanted while its item is, and a failed forward fails its future."""

    features: torch.Tensor  # [n_mels, window_frames]
    frames: int
    owner: object  # the item's pipeline job (`.wanted`)
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.perf_counter)
    kind: ClassVar[str] = "audio"

    @property
    def num_patches(self) -> int:
        return int(conv_lengths(torch.tensor(self.frames)))

    @property
    def job(self) -> "AudioWindowItem":
        return self

    @property
    def wanted(self) -> bool:
        """False once its item is no longer wanted; the window's future is then cancelled, so the item's
        encoding (awaiting it) stops too."""
        if not self.future.done() and not self.owner.wanted:  # type: ignore[attr-defined]
            self.future.cancel()
        return not self.future.done()

    def fail(self, err: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(err)

    @staticmethod
    def run_group(forward: Callable, items: list["AudioWindowItem"], merge_unit: int) -> list[torch.Tensor]:
        del merge_unit  # a vision notion
        feats = torch.stack([b.features for b in items])
        frames = torch.tensor([b.frames for b in items])
        out = forward(feats, frames)
        return [t.to("cpu").clone() for t in out.split(tokens_per_window(frames).tolist())]

    def complete(self, batcher, embedding: torch.Tensor, queue_ms: float, encode_ms: float) -> None:
        if not self.future.done():
            self.future.set_result(embedding)


def encode_audio_file(
    src: str | bytes,
    tower,
    plan: AudioPlan = AudioPlan(),
    workers: int = 2,
    max_batch_windows: int = 8,
    progress: Callable[[float, float], None] | None = None,
    device: str = "cpu",
) -> AudioResult:
    """One file in-process (`mimo-epd encode-audio`, the benchmark): ranges decoded and featurised by
    `workers` processes (0 = in threads), windows through `tower` in batches of `max_batch_windows`.
    `progress(seconds_encoded, seconds_total)` is called as windows finish."""
    window_s = plan.features.chunk_length
    state = {"done": 0.0, "total": 0.0}

    async def main() -> AudioResult:
        run, pool = _decode_runner(workers)

        def forward(feats: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
            out = []
            for i in range(0, len(frames), max_batch_windows):
                f = torch.tensor(frames[i : i + max_batch_windows])
                emb = tower(feats[i : i + max_batch_windows], f)
                out += [t.to("cpu").clone() for t in emb.split(tokens_per_window(f).tolist())]
            return out

        async def encode_windows(feats: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
            out = await asyncio.to_thread(forward, feats, frames)
            state["done"] += len(frames) * window_s
            if progress is not None:
                progress(min(state["done"], state["total"]), state["total"])
            return out

        async def probing_run(fn, *args):
            res = await run(fn, *args)
            if fn is probe_job:
                state["total"] = res.duration_s
            return res

        try:
            features_on = LogMel(plan.features, device) if torch.device(device).type == "cuda" else None
            return await encode_audio(src, plan, probing_run, encode_windows, features_on)
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    return asyncio.run(main())


def _decode_runner(workers: int):
    """(`run(fn, *args)` on `workers` spawned decode processes, or in threads for 0; the pool to shut down)."""
    import concurrent.futures
    import multiprocessing

    from ..decode_pool import ignore_sigint

    pool = (
        concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=ignore_sigint
        )
        if workers > 0
        else None
    )

    async def run(fn, *args):
        if pool is None:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    return run, pool


def encode_mimo_audio_file(src: str | bytes, model, plan: AudioPlan, workers: int = 2) -> AudioResult:
    """One file in-process through MiMo's streamed path (the encoder server's, pipeline/audio_path.py): ranges
    decoded at 24 kHz `plan.lookahead` ahead by `workers` processes (0 = threads), pushed in order into a
    `MiMoAudioStream` (`model`: a MiMoAudioModel) in this thread."""
    from ..models.mimo_audio import MiMoAudioStream

    async def main() -> AudioResult:
        run, pool = _decode_runner(workers)
        t0 = time.perf_counter()
        try:
            info = await run(probe_job, src, plan)
            stream, rows, decoded, waited, tw = MiMoAudioStream(model), [], 0, 0.0, time.perf_counter()
            async for chunk in decoded_ranges(src, plan, run, plan.ranges(info.duration_s), False):
                waited += time.perf_counter() - tw
                decoded += chunk.n_samples
                rows += await asyncio.to_thread(stream.push, torch.from_numpy(chunk.samples))
                tw = time.perf_counter()
            rows += stream.finish()
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        total = time.perf_counter() - t0
        emb = torch.cat(rows)
        seconds = {"total": total, "wait_decode": waited, "encode": total - waited}
        return AudioResult(emb, [int(emb.shape[0])], info, decoded / plan.features.sampling_rate, seconds)

    return asyncio.run(main())
