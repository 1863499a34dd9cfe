"""Audio decoding with PyAV: probe, decode a time range, resample to the model's rate and mono.

`probe(src, limits)` opens the container (a path or the file's bytes), takes its first audio stream and checks
the stream's sample rate, channel count and duration against `AudioLimits`. `decode(src, rate, limits,
start_s, end_s)` decodes `[start_s, end_s)` and returns float32 mono samples at `rate`: resampled per channel
by PyAV's resampler (FFmpeg's swresample), then the channels averaged (librosa's `to_mono`).

Time ranges (the parallel plan for long audio): a range decoder seeks to `start_s - PREROLL_S` (the demuxer
lands at or before it), resamples from there, and places the output by the first decoded frame's timestamp,
counted from the stream's start time, then keeps exactly the output samples `[round(start_s * rate), round(end_s * rate))`. Consecutive ranges
therefore tile the signal without gaps or overlaps; for an input already at `rate` (no interpolation) the
tiles are bit-identical to one sequential decode; with rate conversion they differ by last-bit rounding
(under 1e-6; the preroll lets the decoder's and the resampler's state settle before the range starts).

Refused, with the reason: no audio stream, a container PyAV cannot open, a decode error (truncated or
corrupt data), a header-declared duration the data falls short of (a truncated file), no samples at all,
a sample rate or channel count outside the limits, a duration over `max_seconds`.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

PREROLL_S = 0.5
# A file whose decoded length falls this far short of the duration its header declares is truncated.
_TRUNCATION_SLACK_S = 0.25
_TRUNCATION_SLACK_FRACTION = 0.02


class AudioError(ValueError):
    """Audio that cannot be decoded under the limits; the message says why."""


@dataclass(frozen=True)
class AudioLimits:
    max_seconds: float = 4 * 3600.0
    min_sample_rate: int = 1000
    max_sample_rate: int = 384_000
    max_channels: int = 32


@dataclass
class AudioInfo:
    duration_s: float  # as the container declares it (0 when it does not)
    sample_rate: int
    channels: int
    codec: str

    def summary(self) -> dict:
        return {
            "duration_s": round(self.duration_s, 3),
            "sample_rate": self.sample_rate,
            "channels": self.channels,
            "codec": self.codec,
        }


def _open(src: str | bytes):
    import av

    try:
        return av.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray, memoryview)) else src)
    except av.error.FFmpegError as e:
        raise AudioError(f"not a readable audio file ({e.strerror or e})") from None


def _audio_stream(container):
    streams = [s for s in container.streams if s.type == "audio"]
    if not streams:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise AudioError(f"the file has no audio stream (streams: {', '.join(kinds)})")
    return streams[0]


def _declared_seconds(container, stream) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1e6
    return 0.0


def _info(container, stream, limits: AudioLimits) -> AudioInfo:
    cc = stream.codec_context
    rate, channels = int(cc.sample_rate or 0), int(cc.channels or 0)
    if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
        raise AudioError(
            f"sample rate {rate} Hz is outside {limits.min_sample_rate}..{limits.max_sample_rate} Hz "
            "(--audio-min-sample-rate, --audio-max-sample-rate)"
        )
    if not 1 <= channels <= limits.max_channels:
        raise AudioError(f"{channels} channels is outside 1..{limits.max_channels} (--audio-max-channels)")
    info = AudioInfo(_declared_seconds(container, stream), rate, channels, cc.name)
    if info.duration_s > limits.max_seconds:
        raise AudioError(
            f"the audio lasts {info.duration_s:.1f} s, over the limit of {limits.max_seconds:g} s (--max-audio-seconds)"
        )
    return info


def probe(src: str | bytes, limits: AudioLimits = AudioLimits()) -> AudioInfo:
    with _open(src) as c:
        return _info(c, _audio_stream(c), limits)


def _wav_declared_seconds(src: str | bytes, info: AudioInfo) -> float:
    """The duration a WAV header's `data` chunk declares (FFmpeg trusts the file's size instead), 0 if unknown."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        head = bytes(src[:4096])
    else:
        with open(src, "rb") as f:
            head = f.read(4096)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return 0.0
    pos, block_align = 12, 0
    while pos + 8 <= len(head):
        cid, size = head[pos : pos + 4], int.from_bytes(head[pos + 4 : pos + 8], "little")
        if cid == b"fmt " and pos + 22 <= len(head):
            block_align = int.from_bytes(head[pos + 20 : pos + 22], "little")
        if cid == b"data":
            if block_align <= 0 or size in (0, 0xFFFFFFFF):
                return 0.0  # a streamed WAV: its length is not declared
            return size / block_align / info.sample_rate
        pos += 8 + size + (size & 1)
    return 0.0


def decode(
    src: str | bytes,
    rate: int = 16000,
    limits: AudioLimits = AudioLimits(),
    start_s: float = 0.0,
    end_s: float | None = None,
) -> np.ndarray:
    """Float32 mono samples at `rate` of `[start_s, end_s)` (the whole file by default)."""
    import av

    with _open(src) as c:
        stream = _audio_stream(c)
        info = _info(c, stream, limits)
        # Resampled per channel, then averaged: the mean down-mix of librosa's `to_mono`, which Qwen2-Audio's
        # own examples load audio with (FFmpeg's default mix would scale two equal channels by sqrt(2)).
        resampler = av.AudioResampler(format="fltp", rate=rate)
        first = round(start_s * rate)
        last = None if end_s is None else round(end_s * rate)
        origin = stream.start_time or 0  # timestamps count from the stream's start (MP3 and Opus start late)
        if start_s > 0:
            c.seek(origin + max(0, int((start_s - PREROLL_S) / stream.time_base)), stream=stream, backward=True)
        parts: list[np.ndarray] = []
        got = 0
        pos: int | None = None if start_s > 0 else 0
        try:
            for frame in c.decode(stream):
                if pos is None:
                    pos = round(float((frame.pts - origin) * frame.time_base) * rate) if frame.pts is not None else 0
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
                    got += parts[-1].size
                if last is not None and pos + got >= last + rate:
                    break
            else:
                for out in resampler.resample(None):
                    parts.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
        except av.error.FFmpegError as e:
            raise AudioError(f"the audio data is corrupt or truncated ({e.strerror or e})") from None
        samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if start_s <= 0 and end_s is None:
        _check_complete(src, info, samples.size / rate)
    lo = first - (pos or 0)
    out = samples[max(0, lo) : None if last is None else max(0, last - (pos or 0))]
    if lo < 0:  # the demuxer landed after the range's start (a stream whose first timestamp is late)
        out = np.concatenate([np.zeros(-lo, np.float32), out])
    if out.size == 0:
        raise AudioError("the audio has no samples" if start_s <= 0 else f"no samples at {start_s:.2f} s")
    return np.ascontiguousarray(out, dtype=np.float32)


def _check_complete(src: str | bytes, info: AudioInfo, decoded_s: float) -> None:
    declared = _wav_declared_seconds(src, info) or info.duration_s
    slack = max(_TRUNCATION_SLACK_S, declared * _TRUNCATION_SLACK_FRACTION)
    if declared > 0 and decoded_s + slack < declared:
        raise AudioError(f"truncated: {decoded_s:.2f} s of audio decoded, the header declares {declared:.2f} s")


def plan_ranges(duration_s: float, chunk_s: float) -> list[tuple[float, float | None]]:
    """Consecutive `[start, end)` ranges of `chunk_s` seconds covering the file; the last one is open-ended
    (it runs to the end of the data, whatever the header declared)."""
    n = max(1, math.ceil(duration_s / chunk_s))
    return [(i * chunk_s, (i + 1) * chunk_s if i < n - 1 else None) for i in range(n)]
