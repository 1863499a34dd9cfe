"""Video decoding with PyAV: probe, plan, and decode only what the sampled frames need, in parallel.

The plan: a cheap demux pass (no decoding) lists the keyframes; each sampled index belongs to the GOP
of the last keyframe at or before it. A decoder seeks to a GOP's keyframe, decodes forward until its
last sampled frame, and skips the rest of the GOP (it is never decoded). On the way, frames shown before
the next sample that no other frame references (H.264's non-reference B-frames: half the frames of an x264
stream) are not decoded either (`skip_frame = NONREF` for their packets): nothing depends on them, so every
decoded frame is bit-identical to a full decode (about 0.7x the decode time of a full pass on the
one-hour test file). Only sampled frames are converted to RGB, and they are scaled to the target size by the decoder's own scaler (swscale), so
full-resolution RGB frames never exist.

Parallelism: the GOPs that hold samples are dealt to N workers (processes or threads) in small
round-robin blocks, so all workers advance through the timeline together; each worker has its own
bounded queue and the consumer always reads the queue that owns the next index. Frames therefore come
out in order, and memory stays bounded (N queues of `queue_frames`) whatever the video's length.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterator

import numpy as np


class VideoError(ValueError):
    """A video that cannot be decoded; the message says why."""


@dataclass
class VideoInfo:
    frames: int
    fps: float
    duration_s: float
    width: int
    height: int
    codec: str
    keyframes: list[int]  # frame indices of keyframes, ascending

    def summary(self) -> dict:
        return {
            "duration_s": round(self.duration_s, 3),
            "fps": round(self.fps, 3),
            "frames_total": self.frames,
            "resolution": f"{self.width}x{self.height}",
            "codec": self.codec,
            "keyframes": len(self.keyframes),
        }


def _open(path: str):
    import av

    try:
        return av.open(path)
    except av.error.FFmpegError as e:
        raise VideoError(f"not a readable video container ({e.strerror or e})") from None


def _video_stream(container):
    streams = [s for s in container.streams if s.type == "video"]
    if not streams:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise VideoError(f"the file has no video stream (streams: {', '.join(kinds)})")
    return streams[0]


class _Clock:
    """pts <-> frame index for a constant-frame-rate stream."""

    def __init__(self, stream, fps: float):
        self.tb = Fraction(stream.time_base) if stream.time_base else Fraction(1, 90000)
        self.start = stream.start_time or 0
        self.fps = fps

    def index(self, pts: int) -> int:
        return int(round(float((pts - self.start) * self.tb) * self.fps))

    def pts(self, index: int) -> int:
        return int(self.start + round(index / self.fps / self.tb))


def probe(path: str, max_frames_total: int | None = None) -> VideoInfo:
    """Reads the container and every packet header (no decoding) to count frames and find keyframes."""
    import av

    with _open(path) as c:
        st = _video_stream(c)
        fps = float(st.average_rate or st.guessed_rate or 0)
        if fps <= 0:
            raise VideoError("the video stream has no frame rate")
        clock = _Clock(st, fps)
        keyframes, n = [], 0
        try:
            for pkt in c.demux(st):
                if pkt.pts is None or pkt.size == 0:
                    continue
                if pkt.is_keyframe:
                    keyframes.append(clock.index(pkt.pts))
                n += 1
                if max_frames_total and n > max_frames_total:
                    raise VideoError(f"the video has more than {max_frames_total} frames (--max-video-frames-total)")
        except av.error.FFmpegError as e:
            raise VideoError(f"corrupted video data ({e.strerror or e})") from None
        if n == 0:
            raise VideoError("the video stream has no frames")
        if not keyframes:
            raise VideoError("the video stream has no keyframe (truncated or corrupted)")
        keyframes.sort()
        ctx = st.codec_context
        return VideoInfo(
            frames=n,
            fps=fps,
            duration_s=n / fps,
            width=ctx.width,
            height=ctx.height,
            codec=ctx.name,
            keyframes=keyframes,
        )


@dataclass
class Gop:
    keyframe: int
    needed: list[int]

    @property
    def cost(self) -> int:  # frames to decode
        return self.needed[-1] - self.keyframe + 1


def plan(indices: np.ndarray, keyframes: list[int]) -> list[Gop]:
    kf = np.asarray(keyframes)
    owner = np.searchsorted(kf, indices, side="right") - 1
    gops: list[Gop] = []
    for idx, o in zip(indices.tolist(), owner.tolist()):
        key = int(kf[max(o, 0)])
        if gops and gops[-1].keyframe == key:
            gops[-1].needed.append(idx)
        else:
            gops.append(Gop(key, [idx]))
    return gops


def deal(gops: list[Gop], workers: int, block: int = 2) -> list[list[Gop]]:
    """GOPs to workers in round-robin blocks of `block` GOPs (workers advance together)."""
    out: list[list[Gop]] = [[] for _ in range(workers)]
    for b, start in enumerate(range(0, len(gops), block)):
        out[b % workers].extend(gops[start : start + block])
    return out


def decode_gops(path: str, gops: list[Gop], size: tuple[int, int] | None, emit, threads: int = 1) -> None:
    """Decodes the needed frames of `gops`, calling emit(index, frame HxWx3 uint8) in index order.
    `size` (h, w) scales at the decoder; None keeps the full resolution."""
    import av

    with _open(path) as c:
        st = _video_stream(c)
        st.thread_type = "AUTO"
        st.codec_context.thread_count = threads
        clock = _Clock(st, float(st.average_rate or st.guessed_rate))
        h, w = size if size else (None, None)
        cc = st.codec_context
        # Skipping non-reference frames is only exact when the decoder sees each packet's setting as it is
        # fed (one decoding thread); with frame threads the setting would race with the packets in flight.
        skip = threads == 1
        try:
            for gop in gops:
                c.seek(clock.pts(gop.keyframe), stream=st, backward=True, any_frame=False)
                pending = list(gop.needed)
                for packet in c.demux(st):
                    if skip:
                        # a frame shown before the next sample is never emitted: if nothing references it,
                        # it need not be decoded (frames at or after it always are: VFR may emit them)
                        early = packet.pts is not None and clock.index(packet.pts) < pending[0]
                        cc.skip_frame = "NONREF" if early else "DEFAULT"
                    for frame in packet.decode():
                        if frame.pts is None:
                            continue
                        idx = clock.index(frame.pts)
                        if idx < pending[0]:
                            continue
                        arr = (
                            frame.to_ndarray(width=w, height=h, format="rgb24")
                            if size
                            else frame.to_ndarray(format="rgb24")
                        )
                        while pending and pending[0] <= idx:  # a missing frame takes the next one (VFR, drops)
                            emit(pending.pop(0), arr)
                        if not pending:
                            break
                    if not pending:
                        break
                if skip:
                    cc.skip_frame = "DEFAULT"
                for idx in pending:  # the stream ended early (truncated): report it
                    raise VideoError(f"frame {idx} could not be decoded (truncated or corrupted video)")
        except av.error.FFmpegError as e:
            raise VideoError(f"corrupted video data ({e.strerror or e})") from None


# ------------------------------------------------------------------------------- parallel decode
_DONE = ("done", None)


def _worker(path, gops, size, q, threads):
    if multiprocessing.current_process().name != "MainProcess":  # a process, not a thread
        from ..decode_pool import exit_with_parent, ignore_sigint

        ignore_sigint()  # Ctrl-C reaches the whole process group; the consumer stops the decoders
        exit_with_parent()
    try:
        decode_gops(path, gops, size, lambda i, a: q.put(("frame", (i, a))), threads)
        q.put(_DONE)
    except Exception as e:  # noqa: BLE001 - reported to the consumer
        q.put(("error", f"{type(e).__name__}: {e}" if not isinstance(e, VideoError) else str(e)))


def decode_parallel(
    path: str,
    indices: np.ndarray,
    keyframes: list[int],
    size: tuple[int, int] | None,
    workers: int = 2,
    mode: str = "process",
    queue_frames: int = 16,
    codec_threads: int = 1,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yields (index, frame) for every sampled index, in order, decoding with `workers` workers."""
    gops = plan(indices, keyframes)
    workers = max(1, min(workers, len(gops)))
    shares = deal(gops, workers)
    owner = {}
    for w_id, share in enumerate(shares):
        for g in share:
            for i in g.needed:
                owner.setdefault(i, w_id)
    if mode == "process":
        ctx = multiprocessing.get_context("spawn")
        queues = [ctx.Queue(queue_frames) for _ in range(workers)]
        procs = [
            ctx.Process(target=_worker, args=(path, s, size, q, codec_threads), daemon=True)
            for s, q in zip(shares, queues)
        ]
    elif mode == "thread":
        queues = [queue_mod.Queue(queue_frames) for _ in range(workers)]
        procs = [
            threading.Thread(target=_worker, args=(path, s, size, q, codec_threads), daemon=True)
            for s, q in zip(shares, queues)
        ]
    else:
        raise ValueError(f"decode mode must be process or thread, got {mode!r}")
    for p in procs:
        p.start()
    try:
        for idx in sorted(set(indices.tolist())):
            kind, payload = queues[owner[idx]].get(timeout=600)
            if kind == "error":
                raise VideoError(payload)
            if kind == "done":
                raise VideoError(f"frame {idx} was not produced (truncated or corrupted video)")
            got, arr = payload
            if got != idx:
                raise RuntimeError(f"decode order broken: expected frame {idx}, got {got}")
            yield idx, arr
    finally:
        for p in procs:
            if mode == "process" and p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)


def decode_floor(path: str, keyframes: list[int], frames: int, workers: int, codec_threads: int = 1) -> int:
    """The decode floor: every frame decoded on `workers` processes (contiguous GOP ranges), frames
    discarded. Returns frames decoded."""
    gops = [
        Gop(k, [min((keyframes[i + 1] - 1) if i + 1 < len(keyframes) else frames - 1, frames - 1)])
        for i, k in enumerate(keyframes)
    ]
    per = -(-len(gops) // workers)
    ctx = multiprocessing.get_context("spawn")
    from ..decode_pool import ignore_sigint

    with ctx.Pool(workers, initializer=ignore_sigint) as pool:
        counts = pool.starmap(
            _count_frames, [(path, gops[i : i + per], codec_threads) for i in range(0, len(gops), per)]
        )
    return sum(counts)


def _count_frames(path: str, gops: list[Gop], threads: int) -> int:
    import av

    n = 0
    with av.open(path) as c:
        st = _video_stream(c)
        st.thread_type = "AUTO"
        st.codec_context.thread_count = threads
        clock = _Clock(st, float(st.average_rate or st.guessed_rate))
        if not gops:
            return 0
        c.seek(clock.pts(gops[0].keyframe), stream=st, backward=True, any_frame=False)
        last = gops[-1].needed[-1]
        for frame in c.decode(st):
            n += 1
            if frame.pts is not None and clock.index(frame.pts) >= last:
                break
    return n
