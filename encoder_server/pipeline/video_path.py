"""The video side path: a video's frames are decoded in parallel (its own decoder processes) and streamed
into the tower in chunks. The decoding loop runs in a worker thread; every tower call is handed to the
batcher's forward thread, so the tower only ever runs on that one thread and image batches and video
chunks take turns on it instead of competing for the cores."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import tempfile
from typing import Callable

import grpc
import torch

from ..config import EncoderServerConfig
from ..embedding_cache import CachedEmbedding
from ..errors import ItemError, invalid
from ..preprocess import PreprocessConfig
from ..video.decode import VideoError
from ..video.encode import encode_video
from .jobs import Job

log = logging.getLogger(__name__)


class _FixedNormalization:
    """encode_video sets the tower's input normalization before it starts; the pipeline set it once at
    start-up from the same preprocessing config, so here it is only checked, never changed per call."""

    def __init__(self, mean, std):
        self._expected = (tuple(float(x) for x in mean), tuple(float(x) for x in std))

    def set_input_normalization(self, mean, std) -> None:
        if (tuple(float(x) for x in mean), tuple(float(x) for x in std)) != self._expected:
            raise RuntimeError("a video asked for another input normalization than the server's")


class TowerOnForwardThread:
    """Looks like the tower to encode_video; each call runs on the forward thread (blocking the caller,
    a video's own worker thread, until it is done)."""

    def __init__(self, submit: Callable[..., concurrent.futures.Future], forward: Callable, pre: PreprocessConfig):
        self._submit = submit
        self._forward = forward
        self.patch_embed = _FixedNormalization(pre.mean, pre.std)

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self._submit(self._forward, pixel_values, grid_thw).result()


class VideoPath:
    def __init__(self, config: EncoderServerConfig, pre: PreprocessConfig, tower: TowerOnForwardThread, cache):
        self.config = config
        self.pre = pre
        self.tower = tower
        self.cache = cache
        self._sem = asyncio.Semaphore(config.max_concurrent_videos)
        self._tasks: set[asyncio.Task] = set()

    def start(self, job: Job) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def _run(self, job: Job) -> None:
        async with self._sem:
            if not job.wanted:
                return
            data, job.data = job.data, None
            tmpdir = "/dev/shm" if os.path.isdir("/dev/shm") else None
            c = self.config
            try:
                with tempfile.NamedTemporaryFile(dir=tmpdir, prefix="mimo-epd-video-", suffix=".bin") as f:
                    f.write(data)
                    f.flush()
                    del data
                    result = await asyncio.to_thread(
                        encode_video,
                        f.name,
                        self.tower,
                        self.pre,
                        job.sampling,
                        workers=c.video_decode_workers,
                        mode=c.video_decode_mode,
                        max_batch_tokens=c.max_batch_tokens,
                        max_frames_total=c.max_video_frames_total,
                        device=c.device,
                        max_duration_s=c.max_video_seconds,
                    )
            except VideoError as e:
                job.fail(invalid(f"video: {e}"))
                return
            except concurrent.futures.CancelledError:  # the forward thread was shut down under it
                job.fail(ItemError(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))
                return
            except Exception as e:  # noqa: BLE001 - a bug, not bad input
                log.exception("video item %d failed", job.index)
                job.fail(ItemError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
                return
            sec = result.seconds
            job.timings_ms.update(
                decode=sec["wait_decode"] * 1e3, preprocess=sec["patchify"] * 1e3, encode=sec["encode"] * 1e3
            )
            meta = {
                "timestamps_s": result.timestamps_s,
                "end_s": result.end_s,
                "video": {
                    "duration_s": result.info.duration_s,
                    "fps": result.info.fps,
                    "frames_total": result.info.frames,
                    "frames_sampled": result.frames_sampled,
                    "width": result.info.width,
                    "height": result.info.height,
                },
            }
            entry = CachedEmbedding(result.embedding, result.grid_thw, meta)
            if self.cache is not None:
                self.cache.put(job.key, entry)
            job.succeed(entry, cache_hit=False)
