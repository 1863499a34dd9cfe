"""The stages an item passes through (what differs by modality is its `MediaKind`, `kinds.py`). Each takes a `Job`, does one step, and returns where the job
goes next (`Next`); a failure raises `ItemError` (the worker fails the job with it).

    check ──FETCH──▶ acquire ──DECODE──▶ decode ──PREPROCESS──▶ preprocess ──BATCH──▶ batcher
      │                 ├──VIDEO──▶ video path
      │                 ├──AUDIO──▶ audio path (decode processes, windows into the batcher)
      └──ANSWERED       ├──ANSWERED (cache hit)
                        └──ATTACHED (an identical item is in flight)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field, replace

import grpc
import torch

from mimo_epd.common.content_key import bytes_digest, content_key, normalize_digest

from ..batcher import BatchItem
from ..cluster_cache import ClusterEmbeddingCache
from ..config import EncoderServerConfig
from ..decode_pool import DecodePool
from ..errors import DecodeError, ItemError, invalid
from ..fetch import Fetcher
from ..media_kind import mismatch
from ..metrics import EncoderMetrics
from ..preprocess import ImageSizeError, PreprocessConfig, preprocess_images, target_size
from ..video.sampling import VideoSampling
from .admission import InflightTable
from .jobs import Job, Next
from .kinds import kind_of


@dataclass
class Stages:
    config: EncoderServerConfig
    fetcher: Fetcher
    decode_pool: DecodePool
    cache: object  # EmbeddingLRU | ShmEmbeddingStore | None
    metrics: EncoderMetrics
    inflight: InflightTable
    preprocess_config: PreprocessConfig
    preprocess_pool: concurrent.futures.ThreadPoolExecutor
    model_id: str
    tower_dtype: torch.dtype
    hidden: int  # embedding width (the tower's out_hidden_size)
    merge_unit: int  # patches per embedding row (spatial_merge_size ** 2)
    audio_model_id: str = ""  # empty: no audio tower
    audio_fingerprint: str = ""  # the audio feature settings
    video_base: VideoSampling = field(default_factory=VideoSampling)  # what an item's VideoOptions override
    _fallbacks_seen: int = 0

    def __post_init__(self):
        self.fingerprint = self.preprocess_config.fingerprint()

    # ------------------------------------------------------------------ keys and the cache
    def key(self, digest: str, job: Job) -> str:
        model_id, fingerprint = kind_of(job.request.modality).key_parts(self)
        return content_key(digest, model_id, fingerprint, job.key_extra)

    def lookup(self, job: Job) -> bool:
        """Answers `job` from the cache when its key is there."""
        if self.cache is None:
            return False
        hit = self.cache.get(job.key)
        if hit is not None:
            self.metrics.cache.labels("hit").inc()
            job.succeed(hit, cache_hit=True)
            return True
        self.metrics.cache.labels("miss").inc()
        return False

    def account(self, job: Job, stage: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        job.timings_ms[stage] = dt * 1e3
        self.metrics.stage_seconds.labels(stage).observe(dt)
        self.metrics.busy.labels(stage).inc(dt)

    # ------------------------------------------------------------------ stages
    def check(self, job: Job) -> Next:
        """Validates an item on arrival and answers it from the cache when the client's content_hash allows."""
        req = job.request
        job.key_extra = kind_of(req.modality).prepare(self, job)
        if req.content_hash:
            try:
                digest = normalize_digest(req.content_hash)
            except ValueError as e:
                raise invalid(str(e)) from None
            job.key = self.key(digest, job)
            if self.lookup(job):
                return Next.ANSWERED
        return Next.FETCH

    def video_sampling(self, req) -> VideoSampling:
        c = self.config
        if req.video_max_frames > c.video_max_frames:
            raise ValueError(
                f"max_frames {req.video_max_frames} is over the server's limit of {c.video_max_frames} "
                "(--video-max-frames)"
            )
        if req.video_fps < 0 or req.video_min_frames < 0 or req.video_max_frames < 0:
            raise ValueError("video options must not be negative")
        b = self.video_base
        s = replace(
            b,
            fps=req.video_fps or b.fps,
            max_frames=req.video_max_frames or min(b.max_frames, c.video_max_frames),
            min_frames=req.video_min_frames or min(b.min_frames, c.video_max_frames),
        )
        s.validate()
        return s

    async def acquire(self, job: Job) -> Next:
        """Gets the item's bytes (fetch, read or inline), keys them, and answers from the cache or an
        identical item in flight when it can."""
        t0 = time.perf_counter()
        kind = kind_of(job.request.modality)
        job.data = await self.read(job, kind.max_bytes(self.config))
        digest = bytes_digest(job.data)
        self.account(job, "fetch", t0)
        if job.request.content_hash and normalize_digest(job.request.content_hash) != digest:
            raise invalid(f"content_hash {job.request.content_hash} does not match the item's bytes ({digest})")
        wrong = mismatch(job.data, job.request.modality)  # PNG bytes as a video, an MP4 as an image
        if wrong:
            raise invalid(wrong)
        job.key = self.key(digest, job)
        if self.lookup(job):
            return Next.ANSWERED
        if not self.inflight.lead_or_follow(job):
            return Next.ATTACHED
        if isinstance(self.cache, ClusterEmbeddingCache) and await self.fleet_lookup(job):
            return Next.ANSWERED
        return kind.route

    async def fleet_lookup(self, job: Job) -> bool:
        """A node miss: the fleet's store, then the encode lease (another encoder's entry may arrive while it is
        held); answers `job` (and the identical items attached to it) on a hit."""
        assert isinstance(self.cache, ClusterEmbeddingCache)
        entry = await self.cache.fetch(job.key) or await self.cache.lead(job.key)
        if entry is None:
            return False
        self.metrics.cache.labels("fleet_hit").inc()
        job.succeed(entry, cache_hit=True)
        return True

    async def read(self, job: Job, max_bytes: int | None) -> bytes:
        """The item's bytes. Items of one request with the same URL (a video and its soundtrack, under
        use_audio_in_video; the same image twice) share one download, and its failure."""
        src, memo = job.request.source, job.fetches
        if memo is None or src.kind != "url":
            return await self.fetcher.fetch(src, max_bytes)
        key = (src.value, max_bytes)
        fut = memo.get(key)
        if fut is None:
            fut = memo[key] = asyncio.ensure_future(self.fetcher.fetch(src, max_bytes))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody waits
        return await asyncio.shield(fut)  # one item giving up does not cancel the others' download

    async def decode(self, job: Job) -> Next:
        t0 = time.perf_counter()
        data, job.data = job.data, None
        try:
            job.pixels = await self.decode_pool.decode(data)
        except DecodeError as e:
            raise invalid(e.reason) from None
        except concurrent.futures.process.BrokenProcessPool:
            raise ItemError(grpc.StatusCode.UNAVAILABLE, "a decoder process died; retry") from None
        finally:
            self._count_fallbacks()
        self.account(job, "decode", t0)
        return Next.PREPROCESS

    def _count_fallbacks(self) -> None:
        """Images too large for a shm slot come back pickled; the pool counts them, the metric follows."""
        seen = self.decode_pool.fallbacks
        if seen > self._fallbacks_seen:
            self.metrics.decode_fallbacks.inc(seen - self._fallbacks_seen)
            self._fallbacks_seen = seen

    async def preprocess(self, job: Job) -> Next:
        t0 = time.perf_counter()
        pixels, job.pixels = job.pixels, None
        try:
            pv, grid = await asyncio.get_running_loop().run_in_executor(
                self.preprocess_pool, self._preprocess_one, pixels
            )
        except ImageSizeError as e:
            raise invalid(str(e).removeprefix("image 0: ")) from None
        self.account(job, "preprocess", t0)
        grid_thw = tuple(grid[0].tolist())
        if job.reply is not None:  # the embedding's size is known now: refuse an unsendable reply before the forward
            rows = grid_thw[0] * grid_thw[1] * grid_thw[2] // self.merge_unit
            size = self.tower_dtype.itemsize
            try:
                job.reply.charge(
                    job,
                    rows * self.hidden * size,
                    f"{rows} tokens x {self.hidden} x {size} bytes ({str(self.tower_dtype).removeprefix('torch.')})",
                )
            except ItemError as e:
                job.fail_self(e)  # identical items of other requests attached to it still get it
        job.batch_item = BatchItem(pv, grid_thw, job)
        return Next.BATCH

    def _preprocess_one(self, decoded):
        if decoded.resized == "patches":  # resized and patchified in the decoder; the tower normalises
            t, gh, gw = (
                1,
                *(
                    s // self.preprocess_config.patch_size
                    for s in target_size(*decoded.source_size, self.preprocess_config)
                ),
            )
            return torch.from_numpy(decoded.pixels).to(self.config.device), torch.tensor([[t, gh, gw]])
        # Already resized in the decoder: the target equals its size, so only normalize+patchify run here.
        backend = "torch" if decoded.resized else self.config.resize_backend
        return preprocess_images(
            [decoded.pixels],
            self.preprocess_config,
            device=self.config.device,
            out_dtype=self.tower_dtype,
            resize_backend=backend,
            source_sizes=[decoded.source_size],
            fold_time=True,
        )
