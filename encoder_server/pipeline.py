"""The encoder's staged pipeline, read top to bottom:

    request ──▶ [fetch_q] fetch workers ──▶ content key ──▶ cache? ──hit──▶ answer
                                                  │ miss (or first of identical in-flight items)
                                                  ▼
                [decode_q] decode workers (process pool, pixels back through shm; JPEG draft; optional resize)
                ──▶ [preprocess_q] preprocess threads (resize/normalize/patchify on --device)
                ──▶ Batcher (token budget, short wait) ──▶ vision forward (one thread) ──▶ answer + cache

Stages are joined by bounded asyncio queues, so a slow stage pushes back on the one before it and
memory stays bounded; `--max-pending` refuses new work at once instead of queueing without end.
Every item is a `Job`; a stage that fails a job resolves its future with an `ItemError`, and the
later stages skip jobs whose future is already resolved.

Identical items in flight at the same time (same content key) are encoded once: the first is the
leader, later ones attach to it and get its result (reported as cache hits).

Every optimisation has a switch (see config.py): `--no-pipeline` serialises requests, `--no-batching`
runs one item per forward, `--decode-workers 0` decodes in a thread, `--no-jpeg-draft`, `--resize-in`.
With all of them off this is the naive server the benchmark compares against.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from dataclasses import dataclass, field

import grpc
import torch

from mimo_epd.common.content_key import bytes_digest, content_key, normalize_digest

from .batcher import Batcher, BatchItem
from .config import EncoderServerConfig
from .decode_pool import DecodeOptions, DecodePool
from .embedding_cache import CachedEmbedding, EmbeddingLRU, ShmEmbeddingStore
from .errors import DecodeError, ItemError, invalid
from .fetch import FetchLimits, Fetcher, MediaSource, UrlPolicy, parse_networks
from .metrics import EncoderMetrics
from .models import LoadedVisionModel, load_vision_model
from .preprocess import ImageSizeError, PreprocessConfig, preprocess_images, target_size
from .video.decode import VideoError
from .video.encode import encode_video
from .video.sampling import VideoSampling

log = logging.getLogger(__name__)

STAGES = ("fetch", "decode", "preprocess", "queue", "encode")


@dataclass
class ItemRequest:
    source: MediaSource
    modality: str = "image"
    content_hash: str = ""
    # VIDEO: per-item overrides of the server's sampling defaults (0 = default)
    video_fps: float = 0.0
    video_max_frames: int = 0
    video_min_frames: int = 0


@dataclass
class ItemResult:
    content_key: str
    embedding: torch.Tensor  # [num_tokens, hidden] on the CPU
    grid_thw: tuple[int, int, int]
    cache_hit: bool
    timings_ms: dict[str, float]
    meta: dict | None = None  # videos: timestamps_s and the sampled video's description

    @property
    def num_tokens(self) -> int:
        return int(self.embedding.shape[0])


@dataclass(eq=False)
class Job:
    index: int
    request: ItemRequest
    future: asyncio.Future
    timings_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    data: bytes | None = None
    key: str = ""
    pixels: object = None  # decoded HxWx3 uint8
    followers: list["Job"] = field(default_factory=list)
    sampling: object = None  # VideoSampling for video items
    abandoned: bool = False  # its request already failed; finish only if others wait on it

    @property
    def wanted(self) -> bool:
        return not self.future.done() and (not self.abandoned or any(not f.future.done() for f in self.followers))

    def fail(self, err: ItemError) -> None:
        for job in [self, *self.followers]:
            if not job.future.done():
                job.future.set_exception(ItemError(err.code, err.reason, job.index))

    def succeed(self, emb: CachedEmbedding, cache_hit: bool) -> None:
        if not self.future.done():
            self.future.set_result(ItemResult(self.key, emb.embedding, emb.grid_thw, cache_hit, self.timings_ms, emb.meta))
        for f in self.followers:
            if not f.future.done():
                f.future.set_result(ItemResult(f.key, emb.embedding, emb.grid_thw, True, f.timings_ms, emb.meta))


class EncodePipeline:
    def __init__(self, config: EncoderServerConfig, model: LoadedVisionModel | None = None):
        self.config = config
        self.model = model or load_vision_model(config.model, config.device, config.dtype, return_info=True)
        self.preprocess_config = self._preprocess_config()
        self.model_id = self.model.model_id
        self._fingerprint = self.preprocess_config.fingerprint()
        if config.shm_cache_name:
            self.cache = ShmEmbeddingStore(config.shm_cache_name, config.shm_cache_bytes)
        else:
            self.cache = EmbeddingLRU(config.cache_bytes) if config.cache_bytes > 0 else None
        policy = UrlPolicy(allow_private=config.allow_private_urls, allowlist=parse_networks(config.url_allowlist))
        self.fetcher = Fetcher(FetchLimits(max_bytes=config.max_item_bytes, timeout_s=config.fetch_timeout_s,
                                           max_redirects=config.max_redirects,
                                           allowed_local_dir=config.allowed_local_dir or None,
                                           pool_size=config.fetch_concurrency), policy)
        d = config.queue_depth
        self.fetch_q: asyncio.Queue[Job] = asyncio.Queue(d)
        self.decode_q: asyncio.Queue[Job] = asyncio.Queue(d)
        self.preprocess_q: asyncio.Queue[Job] = asyncio.Queue(d)
        self.batcher = Batcher(self._forward, on_done=self._on_encoded, max_batch_tokens=config.max_batch_tokens,
                               max_wait_ms=config.max_wait_ms, queue_depth=d,
                               merge_unit=self.model.module.config.spatial_merge_size ** 2,
                               max_batch_items=None if config.batching else 1,
                               on_batch=self._on_batch)
        resize_in = config.resize_in
        if resize_in == "auto":
            resize_in = "device" if torch.device(config.device).type == "cuda" else "decoder"
        self.resize_in = resize_in
        self.decode_pool = DecodePool(config.decode_workers, DecodeOptions(
            max_pixels=config.max_image_pixels, decoder=config.decoder, jpeg_draft=config.jpeg_draft,
            resize=resize_in == "decoder", patchify=resize_in == "decoder", preprocess=self.preprocess_config,
            device=str(config.device)),
            slot_bytes=config.decode_slot_bytes, inflight=config.decode_inflight)
        self.model.module.patch_embed.set_input_normalization(self.preprocess_config.mean, self.preprocess_config.std)
        self.metrics = EncoderMetrics()
        self._serial = None if config.pipeline else asyncio.Lock()
        self.started_at = time.perf_counter()
        self.busy_s = dict.fromkeys(("fetch", "decode", "preprocess", "encode"), 0.0)
        self.forward_threads = config.torch_threads or 0  # 0 = torch's default; the balancer may change it
        self._inflight: dict[str, Job] = {}
        self._video_sem = asyncio.Semaphore(config.max_concurrent_videos)
        self._video_tasks: set[asyncio.Task] = set()
        self.pending = 0
        self.waiting = 0
        self._tasks: list[asyncio.Task] = []
        self._preprocess_pool = concurrent.futures.ThreadPoolExecutor(config.preprocess_threads, "preprocess")
        self.stats = {"requests": 0, "items": 0, "cache_hits": 0, "errors": 0}

    def _preprocess_config(self) -> PreprocessConfig:
        c = self.config
        if c.preprocess != "auto":
            base = PreprocessConfig.preset(c.preprocess)
        elif self.model.preprocessor_config:
            base = PreprocessConfig.from_hf_dict(self.model.preprocessor_config)
        else:
            patch = self.model.module.config.patch_size
            base = PreprocessConfig.preset("mimo_v2_5" if patch == 16 else "qwen2_5_vl")
        tower = self.model.module.config
        if (base.patch_size, base.merge_size, base.temporal_patch_size) != (
                tower.patch_size, tower.spatial_merge_size, tower.temporal_patch_size):
            raise ValueError(f"preprocessing (patch {base.patch_size}, merge {base.merge_size}) does not match the "
                             f"model (patch {tower.patch_size}, merge {tower.spatial_merge_size})")
        from dataclasses import replace

        return replace(base, min_pixels=c.min_pixels or base.min_pixels, max_pixels=c.max_pixels or base.max_pixels)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.config.torch_threads > 0:
            torch.set_num_threads(self.config.torch_threads)
        await self.fetcher.start()
        await self.decode_pool.start()  # workers start now, not on the first request
        await asyncio.get_running_loop().run_in_executor(self._preprocess_pool, self._warm_up)
        spawn = asyncio.get_running_loop().create_task
        self._tasks += [spawn(self._worker(self.fetch_q, self._fetch_stage, self.decode_q), name=f"fetch-{i}")
                        for i in range(self.config.fetch_concurrency)]
        self._tasks += [spawn(self._worker(self.decode_q, self._decode_stage, self.preprocess_q), name=f"decode-{i}")
                        for i in range(self.decode_pool.max_inflight)]
        self._tasks += [spawn(self._worker(self.preprocess_q, self._preprocess_stage, None), name=f"preprocess-{i}")
                        for i in range(self.config.preprocess_threads)]
        self._tasks.append(spawn(self.batcher.run(), name="batcher"))
        if self.config.torch_threads == 0 and self.config.decode_workers > 0 and torch.device(self.config.device).type == "cpu":
            self._tasks.append(spawn(self._balance_threads(), name="thread-balancer"))
        m = self.metrics
        workers = {"fetch": self.config.fetch_concurrency, "decode": max(1, self.config.decode_workers),
                   "preprocess": self.config.preprocess_threads, "encode": 1}
        for stage, n in workers.items():
            m.workers.labels(stage).set(n)
        for name, q in (("fetch", self.fetch_q), ("decode", self.decode_q), ("preprocess", self.preprocess_q),
                        ("batch", self.batcher.queue)):
            m.queue_depth.labels(name).set_function(q.qsize)
        m.pending.set_function(lambda: self.pending + self.waiting)
        if self.config.metrics_port:
            m.serve(self.config.metrics_port, self.config.host)
        self.started_at = time.perf_counter()

    async def stop(self) -> None:
        for t in [*self._tasks, *self._video_tasks]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.fetcher.close()
        self.batcher.shutdown()
        self.decode_pool.stop()
        self._preprocess_pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self.cache, "close"):
            self.cache.close()

    # ------------------------------------------------------------------ entry point
    async def encode(self, items: list[ItemRequest]) -> list[ItemResult]:
        """Encodes a request's items. Raises the `ItemError` of the first failing item (lowest index)."""
        t0 = time.perf_counter()
        self.metrics.requests.inc()
        self.metrics.items.inc(len(items))
        try:
            if self._serial is None:
                return await self._encode(items)
            self._check_capacity(len(items))
            self.waiting += len(items)  # requests queued for the lock count against --max-pending too
            entered = False
            try:
                async with self._serial:
                    self.waiting -= len(items)
                    entered = True
                    return await self._encode(items)
            finally:
                if not entered:
                    self.waiting -= len(items)
        except ItemError as e:
            self.metrics.errors.labels(e.code.name).inc()
            raise
        finally:
            self.metrics.request_seconds.observe(time.perf_counter() - t0)

    async def _encode(self, items: list[ItemRequest]) -> list[ItemResult]:
        c = self.config
        self.stats["requests"] += 1
        if not items:
            raise invalid("request has no items")
        if len(items) > c.max_items_per_request:
            raise invalid(f"request has {len(items)} items, over the limit of {c.max_items_per_request} "
                          "(--max-items-per-request)")
        self._check_capacity(len(items))
        loop = asyncio.get_running_loop()
        jobs = [Job(i, it, loop.create_future()) for i, it in enumerate(items)]
        self.pending += len(jobs)
        self.stats["items"] += len(jobs)
        try:
            for job in jobs:
                self._admit(job)
            for job in jobs:
                if not job.future.done():
                    await self.fetch_q.put(job)
            results = []
            for job in jobs:  # in index order: the first failure by index is the one reported
                results.append(await job.future)
            return results
        except ItemError as e:
            self.stats["errors"] += 1
            for job in jobs:
                job.abandoned = True
                if not job.future.done():
                    job.future.cancel()
            raise e
        except BaseException:
            for job in jobs:
                job.abandoned = True
                if not job.future.done():
                    job.future.cancel()
            raise
        finally:
            self.pending -= len(jobs)
            for job in jobs:  # an unretrieved exception of a later item is expected, not an error
                if job.future.done() and not job.future.cancelled():
                    job.future.exception()

    def _check_capacity(self, n: int) -> None:
        if self.pending + self.waiting + n > self.config.max_pending:
            raise ItemError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"server is at capacity ({self.pending + self.waiting} items pending, --max-pending "
                            f"{self.config.max_pending}); retry later")

    def _admit(self, job: Job) -> None:
        """Validates an item and answers it from the cache when the client's content_hash allows."""
        req = job.request
        if req.modality == "video":
            try:
                job.sampling = self._video_sampling(req)
            except ValueError as e:
                job.fail(invalid(str(e)))
                return
        elif req.modality != "image":
            job.fail(ItemError(grpc.StatusCode.UNIMPLEMENTED, f"modality {req.modality} is not supported by this server"))
            return
        if req.content_hash:
            try:
                digest = normalize_digest(req.content_hash)
            except ValueError as e:
                job.fail(invalid(str(e)))
                return
            job.key = self._key(digest, job)
            self._lookup(job)

    def _video_sampling(self, req: ItemRequest) -> VideoSampling:
        c = self.config
        if req.video_max_frames > c.video_max_frames:
            raise ValueError(f"max_frames {req.video_max_frames} is over the server's limit of {c.video_max_frames} "
                             "(--video-max-frames)")
        if req.video_fps < 0 or req.video_min_frames < 0 or req.video_max_frames < 0:
            raise ValueError("video options must not be negative")
        s = VideoSampling(fps=req.video_fps or c.video_fps, max_frames=req.video_max_frames or c.video_max_frames,
                          min_frames=req.video_min_frames or c.video_min_frames)
        s.validate()
        return s

    def _key(self, digest: str, job: Job | None = None) -> str:
        extra = f"video:{job.sampling.fingerprint()}" if job is not None and job.sampling is not None else ""
        return content_key(digest, self.model_id, self._fingerprint, extra)

    def _lookup(self, job: Job) -> bool:
        if self.cache is None:
            return False
        hit = self.cache.get(job.key)
        if hit is not None:
            self.stats["cache_hits"] += 1
            self.metrics.cache.labels("hit").inc()
            job.succeed(hit, cache_hit=True)
            return True
        self.metrics.cache.labels("miss").inc()
        return False

    # ------------------------------------------------------------------ stages
    async def _worker(self, inq: asyncio.Queue, stage, outq: asyncio.Queue | None) -> None:
        while True:
            job = await inq.get()
            if not job.wanted:
                continue
            try:
                forward = await stage(job)
            except ItemError as e:
                job.fail(e)
                continue
            except asyncio.CancelledError:
                job.fail(ItemError(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))
                raise
            except Exception as e:  # a bug, not bad input: log it with its traceback, keep serving
                log.exception("stage %s failed on item %d", getattr(stage, "__name__", stage), job.index)
                job.fail(ItemError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
                continue
            if forward and outq is not None and job.wanted:
                await outq.put(job)

    async def _fetch_stage(self, job: Job) -> bool:
        t0 = time.perf_counter()
        video = job.request.modality == "video"
        job.data = await self.fetcher.fetch(job.request.source, self.config.max_video_bytes if video else None)
        digest = bytes_digest(job.data)
        self._account(job, "fetch", t0)
        if job.request.content_hash and normalize_digest(job.request.content_hash) != digest:
            raise invalid(f"content_hash {job.request.content_hash} does not match the item's bytes ({digest})")
        job.key = self._key(digest, job)
        if self._lookup(job):
            return False
        leader = self._inflight.get(job.key)
        if leader is not None and leader.wanted:
            leader.followers.append(job)
            return False
        self._inflight[job.key] = job
        job.future.add_done_callback(lambda _f, j=job: self._inflight.pop(j.key, None) if self._inflight.get(j.key) is j else None)
        if video:  # videos take their own path: parallel decode streaming into the tower
            task = asyncio.get_running_loop().create_task(self._video_job(job))
            self._video_tasks.add(task)
            task.add_done_callback(self._video_tasks.discard)
            return False
        return True

    async def _video_job(self, job: Job) -> None:
        """Decodes and encodes one video (in a worker thread; the decoders are processes or threads)."""
        import tempfile

        async with self._video_sem:
            if not job.wanted:
                return
            data, job.data = job.data, None
            tmpdir = "/dev/shm" if os.path.isdir("/dev/shm") else None
            try:
                with tempfile.NamedTemporaryFile(dir=tmpdir, prefix="mimo-epd-video-", suffix=".bin") as f:
                    f.write(data)
                    f.flush()
                    del data
                    c = self.config
                    result = await asyncio.to_thread(
                        encode_video, f.name, self.model.module, self.preprocess_config, job.sampling,
                        workers=c.video_decode_workers, mode=c.video_decode_mode, max_batch_tokens=c.max_batch_tokens,
                        max_frames_total=c.max_video_frames_total, device=c.device,
                        max_duration_s=c.max_video_seconds)
            except VideoError as e:
                job.fail(invalid(f"video: {e}"))
                return
            except Exception as e:  # noqa: BLE001 - a bug, not bad input
                log.exception("video item %d failed", job.index)
                job.fail(ItemError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
                return
            sec = result.seconds
            job.timings_ms.update(decode=sec["wait_decode"] * 1e3, preprocess=sec["patchify"] * 1e3,
                                  encode=sec["encode"] * 1e3)
            meta = {"timestamps_s": result.timestamps_s, "video": {
                "duration_s": result.info.duration_s, "fps": result.info.fps, "frames_total": result.info.frames,
                "frames_sampled": result.frames_sampled, "width": result.info.width, "height": result.info.height}}
            entry = CachedEmbedding(result.embedding, result.grid_thw, meta)
            if self.cache is not None:
                self.cache.put(job.key, entry)
            job.succeed(entry, cache_hit=False)

    async def _decode_stage(self, job: Job) -> bool:
        t0 = time.perf_counter()
        data, job.data = job.data, None
        try:
            job.pixels = await self.decode_pool.decode(data)
        except DecodeError as e:
            raise invalid(e.reason) from None
        except concurrent.futures.process.BrokenProcessPool:
            raise ItemError(grpc.StatusCode.UNAVAILABLE, "a decoder process died; retry") from None
        self._account(job, "decode", t0)
        return True

    def _account(self, job: Job, stage: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        job.timings_ms[stage] = dt * 1e3
        self.busy_s[stage] += dt
        self.metrics.stage_seconds.labels(stage).observe(dt)
        self.metrics.busy.labels(stage).inc(dt)

    async def _preprocess_stage(self, job: Job) -> bool:
        t0 = time.perf_counter()
        pixels, job.pixels = job.pixels, None
        try:
            pv, grid = await asyncio.get_running_loop().run_in_executor(
                self._preprocess_pool, self._preprocess_one, pixels)
        except ImageSizeError as e:
            raise invalid(str(e).removeprefix("image 0: ")) from None
        self._account(job, "preprocess", t0)
        await self.batcher.submit(BatchItem(pv, tuple(grid[0].tolist()), job))
        return False

    def _warm_up(self) -> None:
        """One small image through preprocess and the tower, so the first request pays no import/compile cost."""
        import numpy as np

        f = self.preprocess_config.factor * 2
        pv, grid = preprocess_images([np.zeros((f, f, 3), np.uint8)], self.preprocess_config, device=self.config.device,
                                     out_dtype=self.model.module.dtype, resize_backend=self.config.resize_backend,
                                     fold_time=True)
        self.model.module(pv, grid)

    def _preprocess_one(self, decoded):
        if decoded.resized == "patches":  # resized and patchified in the decoder; the tower normalises
            t, gh, gw = 1, *(s // self.preprocess_config.patch_size for s in
                             target_size(*decoded.source_size, self.preprocess_config))
            return torch.from_numpy(decoded.pixels).to(self.config.device), torch.tensor([[t, gh, gw]])
        # Already resized in the decoder: the target equals its size, so only normalize+patchify run here.
        backend = "torch" if decoded.resized else self.config.resize_backend
        return preprocess_images([decoded.pixels], self.preprocess_config, device=self.config.device,
                                 out_dtype=self.model.module.dtype, resize_backend=backend,
                                 source_sizes=[decoded.source_size], fold_time=True)

    # ------------------------------------------------------------------ forward (runs in the batcher's thread)
    def _forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        want = self.forward_threads
        if want and want != torch.get_num_threads():
            torch.set_num_threads(want)  # OpenMP's thread count is per calling thread: set it here
        return self.model.module(pixel_values, grid_thw)

    async def _balance_threads(self, window_s: float = 1.5, explore_every: int = 8) -> None:
        """On a CPU the vision forward and the decode processes share the cores, and which split is best
        depends on the model and the load: a small tower runs best on one core next to busy decoders, a
        large one needs every core. So measure it: run each setting (1 thread, all cores) for a window,
        keep the one that encoded more patches per second, and re-check the other now and then."""
        cores = os.cpu_count() or 1
        if cores < 2:
            return
        options = [1, cores]
        rate = {1: None, cores: None}
        current, windows = 1, 0
        self.forward_threads = current
        while True:
            before = self.batcher.stats.patches
            await asyncio.sleep(window_s)
            done = self.batcher.stats.patches - before
            if done == 0:
                continue  # idle: nothing to learn
            rate[current] = done / window_s
            windows += 1
            other = options[1 - options.index(current)]
            if rate[other] is None or windows % explore_every == 0:
                nxt = other  # explore
            else:
                nxt = max(options, key=lambda o: rate[o] or 0.0)  # exploit the better one
            if nxt != current:
                log.debug("forward threads %d -> %d (patches/s: %s)", current, nxt, rate)
                current = self.forward_threads = nxt

    def _on_batch(self, items: int, patches: int, seconds: float) -> None:
        self.busy_s["encode"] += seconds
        self.metrics.busy.labels("encode").inc(seconds)
        self.metrics.batch_items.observe(items)
        self.metrics.batch_patches.observe(patches)

    def _on_encoded(self, item: BatchItem, embedding: torch.Tensor, queue_ms: float, encode_ms: float) -> None:
        job: Job = item.job
        job.timings_ms["queue"] = queue_ms
        job.timings_ms["encode"] = encode_ms
        self.metrics.stage_seconds.labels("queue").observe(queue_ms / 1e3)
        self.metrics.stage_seconds.labels("encode").observe(encode_ms / 1e3)
        entry = CachedEmbedding(embedding, item.grid_thw)
        if self.cache is not None:
            self.cache.put(job.key, entry)
        job.succeed(entry, cache_hit=False)
