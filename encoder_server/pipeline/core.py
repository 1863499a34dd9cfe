"""`EncodePipeline`: wires admission, the stages, the batcher and the video and audio paths together.

Stages are joined by bounded asyncio queues, so a slow stage pushes back on the one before it and
memory stays bounded; `--max-pending` refuses new work at once instead of queueing without end.
A stage returns where the job goes next (`Next`); `_route` puts it there. A stage that fails a job
resolves its future with an `ItemError`, and later stages skip jobs whose future is already resolved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import replace

import grpc
import torch

from mimo_epd.common.malloc import keep_freed_memory
from mimo_epd.common.proc_stat import usable_cores

from ..audio.decode import AudioLimits
from ..audio.encode import AudioPlan
from ..audio.features import MIMO_AUDIO_FEATURES, AudioFeatureConfig, LogMel
from ..batch_budget import BatchBudget, QueueFollowingBudget
from ..batcher import Batcher, BatchItem
from ..config import EncoderServerConfig
from ..decode_pool import DecodeOptions, DecodePool
from ..embedding_cache import CachedEmbedding, EmbeddingLRU, ShmEmbeddingStore
from ..errors import ItemError, from_client_input, invalid
from ..fetch import FairFetchScheduler, Fetcher, FetchLimits, UrlPolicy, parse_networks, url_host
from ..metrics import EncoderMetrics
from ..models import LoadedVisionModel, load_vision_model, resolve_dtype
from ..models.audio_loader import LoadedAudioModel, load_audio_model
from ..preprocess import PreprocessConfig, preprocess_images, preset_for_tower
from ..video.sampling import VideoSampling
from .admission import Admission, InflightTable
from .audio_path import AudioPath
from .jobs import ItemRequest, ItemResult, Job, Next, ReplyBudget
from .lanes import ForwardLanes, lane_devices
from .stages import Stages
from .tuner import ForwardPolicy, ForwardTuner
from .video_path import TowerOnForwardThread, VideoPath

log = logging.getLogger(__name__)


class EncodePipeline:
    def __init__(self, config: EncoderServerConfig, model: LoadedVisionModel | None = None):
        self.config = config
        self.model = model or load_vision_model(config.model, config.device, config.dtype, return_info=True)
        self.preprocess_config = self._preprocess_config()
        self.model_id = self.model.model_id
        self.audio_model = self._load_audio_model()
        self.audio_features = self._audio_feature_config()
        self.metrics = EncoderMetrics()
        self.cache = self._make_cache()
        self.fetcher = self._make_fetcher()
        d = config.queue_depth
        # URL fetches only; inline bytes, data: URIs and paths are read where they arrive (`_route`).
        self.fetches = FairFetchScheduler(self._fetch, config.fetch_concurrency, config.fetch_per_host)
        self.decode_q: asyncio.Queue[Job] = asyncio.Queue(d)
        self.preprocess_q: asyncio.Queue[Job] = asyncio.Queue(d)
        self.max_forward_workers, tuned = self._forward_workers()
        self.lanes = ForwardLanes(self.model.module, config.device, self.max_forward_workers)
        self.batcher = Batcher(
            self._forward,
            on_done=self._on_encoded,
            max_batch_tokens=config.max_batch_tokens,
            max_wait_ms=config.max_wait_ms,
            queue_depth=d,
            merge_unit=self.model.module.config.spatial_merge_size**2,
            max_batch_items=None if config.batching else 1,
            on_batch=self._on_batch,
            max_workers=self.max_forward_workers,
            workers=lambda: self.tuner.workers,
            budget=self._batch_budget(),
            forwards={"audio": self._audio_forward},
        )
        self.resize_in = config.resize_in
        if self.resize_in == "auto":
            self.resize_in = "device" if torch.device(config.device).type == "cuda" else "decoder"
        self.decode_pool = self._make_decode_pool()
        # Set once here; the video path only checks it (the tower is never reconfigured per call).
        self.model.module.patch_embed.set_input_normalization(self.preprocess_config.mean, self.preprocess_config.std)
        self.admission = Admission(config.max_pending, serial=not config.pipeline)
        self.inflight = InflightTable()
        stats = self.batcher.stats
        self.tuner = ForwardTuner(
            lambda: (stats.busy_s, stats.patches, stats.batches),
            self.decode_pool.worker_pids,
            ForwardPolicy(usable_cores(), self.max_forward_workers, 1 if tuned else self.max_forward_workers),
            config.torch_threads or 0,
        )
        self.tuner.workers = 1 if tuned else self.max_forward_workers
        self._preprocess_pool = concurrent.futures.ThreadPoolExecutor(config.preprocess_threads, "preprocess")
        self.stages = Stages(
            config=config,
            fetcher=self.fetcher,
            decode_pool=self.decode_pool,
            cache=self.cache,
            metrics=self.metrics,
            inflight=self.inflight,
            preprocess_config=self.preprocess_config,
            preprocess_pool=self._preprocess_pool,
            model_id=self.model_id,
            tower_dtype=self.model.module.dtype,
            hidden=self.model.module.config.out_hidden_size,
            merge_unit=self.model.module.config.spatial_merge_size**2,
            audio_model_id=self.audio_model.model_id if self.audio_model else "",
            audio_fingerprint=self.audio_features.fingerprint(),
            video_base=self._video_base(),
        )
        self.audio = self._make_audio_path()
        self.video = self._make_video_path()
        self._tasks: list[asyncio.Task] = []

    def _make_cache(self):
        """The node's shm embedding store when it has one, else a process-local LRU (none with --cache-bytes 0); in
        front of the fleet's store with --embedding-store (cluster_cache.py)."""
        c = self.config
        if c.shm_cache_name:
            local = ShmEmbeddingStore(c.shm_cache_name, c.shm_cache_bytes)
        else:
            local = EmbeddingLRU(c.cache_bytes) if c.cache_bytes > 0 else None
        if not c.embedding_store:
            return local
        import os
        import socket

        from ..cluster_cache import ClusterEmbeddingCache, EmbeddingLease, MooncakeEmbeddingStore

        store = MooncakeEmbeddingStore(c.embedding_store, c.embedding_store_segment_bytes)
        owner = f"{socket.gethostname()}:{os.getpid()}"
        lease = EmbeddingLease(c.embedding_lease, owner, c.embedding_lease_ms) if c.embedding_lease else None
        cache = ClusterEmbeddingCache(local, store, lease, c.embedding_store_max_item_bytes)
        self.metrics.watch_cluster(cache)
        return cache

    def _make_fetcher(self) -> Fetcher:
        c = self.config
        policy = UrlPolicy(allow_private=c.allow_private_urls, allowlist=parse_networks(c.url_allowlist))
        limits = FetchLimits(
            max_bytes=c.max_item_bytes,
            timeout_s=c.fetch_timeout_s,
            max_redirects=c.max_redirects,
            allowed_local_dir=c.allowed_local_dir or None,
            pool_size=c.fetch_concurrency,
        )
        return Fetcher(limits, policy)

    def _make_decode_pool(self) -> DecodePool:
        """The decode processes; they resize and patchify too when `resize_in` is the decoder."""
        c, in_decoder = self.config, self.resize_in == "decoder" and not self.preprocess_config.exact_floats
        options = DecodeOptions(
            max_pixels=c.max_image_pixels,
            decoder=c.decoder,
            jpeg_draft=c.jpeg_draft and not self.preprocess_config.exact_floats,
            resize=in_decoder,
            patchify=in_decoder,
            preprocess=self.preprocess_config,
            device=str(c.device),
        )
        return DecodePool(c.decode_workers, options, slot_bytes=c.decode_slot_bytes, inflight=c.decode_inflight)

    def _load_audio_model(self) -> LoadedAudioModel | None:
        c = self.config
        name = c.audio_model or c.model
        if name == "none":
            return None
        return load_audio_model(name, c.device, resolve_dtype(c.dtype))

    def _make_audio_path(self) -> AudioPath:
        c = self.config
        mimo = self.audio_model.mimo if self.audio_model else None
        return AudioPath(
            self._audio_plan(),
            self.decode_pool,
            self.batcher,
            self.cache,
            c.max_concurrent_audios,
            self._features_on(),
            mimo,
            c.audio_seconds_in_flight,
            self.metrics,
        )

    def _audio_feature_config(self) -> AudioFeatureConfig:
        """What audio items are decoded at and what their content keys name: MiMo's or Qwen2-Audio's settings."""
        mimo = self.audio_model is not None and self.audio_model.mimo is not None
        return MIMO_AUDIO_FEATURES if mimo else AudioFeatureConfig()

    def _audio_plan(self) -> AudioPlan:
        c = self.config
        plan = AudioPlan(
            self.audio_features,
            AudioLimits(c.max_audio_seconds, c.audio_min_sample_rate, c.audio_max_sample_rate, c.audio_max_channels),
            chunk_s=c.audio_chunk_seconds,
            parallel_above_s=c.audio_parallel_above_s,
            lookahead=c.audio_decode_lookahead,
        )
        plan.validate()
        return plan

    def _features_on(self) -> LogMel | None:
        """Where features are computed: None = in the decode processes (a CPU server's default); MiMo's audio
        computes its own on the forward thread (audio_path.py)."""
        if self.audio_model is not None and self.audio_model.mimo is not None:
            return None
        where = self.config.audio_features_in
        if where == "auto":
            where = "device" if torch.device(self.config.device).type == "cuda" else "decoder"
        return LogMel(self.audio_features, self.config.device) if where == "device" else None

    def _batch_budget(self) -> BatchBudget:
        c = self.config
        if c.batching and c.batch_follow_queue:
            return QueueFollowingBudget(c.max_batch_tokens, c.max_wait_ms, c.max_batch_tokens_peak, c.max_wait_ms_peak)
        return BatchBudget(c.max_batch_tokens, c.max_wait_ms)

    def _tunes(self) -> bool:
        """The forward tuner runs on a CPU with decode processes and no fixed --torch-threads."""
        c = self.config
        return c.torch_threads == 0 and c.decode_workers > 0 and torch.device(c.device).type == "cpu"

    def _forward_workers(self) -> tuple[int, bool]:
        """(forward workers at most, whether the tuner chooses between 1 and that): a fixed
        --forward-workers; else on a CPU the tuner measures 1 and 2; on CUDA one per lane device."""
        c = self.config
        if c.forward_workers > 0:
            return c.forward_workers, False
        if not c.batching:
            return 1, False  # one item per forward, one forward at a time: the comparison baseline
        if torch.device(c.device).type == "cuda":
            return len(set(lane_devices(c.device, max(1, torch.cuda.device_count())))), False
        return (2, True) if self._tunes() and usable_cores() >= 2 else (1, False)

    def _make_video_path(self) -> VideoPath:
        tower = TowerOnForwardThread(self.batcher.call_on_forward_thread, self._forward, self.preprocess_config)
        return VideoPath(self.config, self.preprocess_config, tower, self.cache)

    def _video_base(self) -> VideoSampling:
        """The video sampling an item's options override: MiMo's from its checkpoint's `processor_config` (the
        processor's own defaults without one), else the server's --video-* flags."""
        pre = self.preprocess_config
        if pre.exact_floats:
            pc = (self.model.preprocessor_config or {}).get("processor_config")
            return VideoSampling.mimo(pc, pre.factor)
        c = self.config
        return VideoSampling(fps=c.video_fps, max_frames=c.video_max_frames, min_frames=c.video_min_frames)

    def _preprocess_config(self) -> PreprocessConfig:
        c = self.config
        if c.preprocess != "auto":
            base = PreprocessConfig.preset(c.preprocess)
        elif self.model.preprocessor_config:
            base = PreprocessConfig.from_hf_dict(self.model.preprocessor_config)
        else:
            base = preset_for_tower(self.model.module.config.patch_size)
        tower = self.model.module.config
        if (base.patch_size, base.merge_size, base.temporal_patch_size) != (
            tower.patch_size,
            tower.spatial_merge_size,
            tower.temporal_patch_size,
        ):
            raise ValueError(
                f"preprocessing (patch {base.patch_size}, merge {base.merge_size}) does not match the "
                f"model (patch {tower.patch_size}, merge {tower.spatial_merge_size})"
            )
        return replace(base, min_pixels=c.min_pixels or base.min_pixels, max_pixels=c.max_pixels or base.max_pixels)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        c = self.config
        if c.torch_threads > 0:
            torch.set_num_threads(c.torch_threads)
        keep_freed_memory()  # each forward allocates the same activations again (mimo_epd/common/malloc.py)
        await self.fetcher.start()
        await self.decode_pool.start()  # workers start now, not on the first request
        # The warm-up runs the tower too, so it runs where every tower call runs: the batcher's forward thread.
        await asyncio.wrap_future(self.batcher.call_on_forward_thread(self._warm_up))
        spawn = asyncio.get_running_loop().create_task
        st = self.stages
        self._tasks += [
            spawn(self._worker(self.decode_q, st.decode), name=f"decode-{i}")
            for i in range(self.decode_pool.max_inflight)
        ]
        self._tasks += [
            spawn(self._worker(self.preprocess_q, st.preprocess), name=f"preprocess-{i}")
            for i in range(c.preprocess_threads)
        ]
        self._tasks.append(spawn(self.batcher.run(), name="batcher"))
        if self._tunes():
            self._tasks.append(spawn(self.tuner.run(), name="forward-tuner"))
        m = self.metrics
        workers = {
            "fetch": c.fetch_concurrency,
            "decode": max(1, c.decode_workers),
            "preprocess": c.preprocess_threads,
        }
        started = time.monotonic()
        for stage, n in workers.items():
            m.workers.labels(stage).set(n)
            m.worker_seconds.labels(stage).set_function(lambda n=n: n * (time.monotonic() - started))
        m.workers.labels("encode").set_function(lambda: self.tuner.workers)
        m.worker_seconds.labels("encode").set_function(self.tuner.worker_seconds)
        m.forward_threads.set_function(lambda: self.tuner.threads)
        m.batch_budget.set_function(lambda: self.batcher.budget.tokens)
        for name, q in (
            ("fetch", self.fetches),
            ("decode", self.decode_q),
            ("preprocess", self.preprocess_q),
            ("batch", self.batcher.queue),
        ):
            m.queue_depth.labels(name).set_function(q.qsize)
        m.pending.set_function(lambda: self.admission.load)
        if c.metrics_port:
            m.serve(c.metrics_port, c.host)

    async def stop(self) -> None:
        self.video.cancel()
        self.audio.cancel()
        await self.fetches.close()
        for t in self._tasks:
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
            c = self.config
            if not items:
                raise invalid("request has no items")
            if len(items) > c.max_items_per_request:
                raise invalid(
                    f"request has {len(items)} items, over the limit of {c.max_items_per_request} "
                    "(--max-items-per-request)"
                )
            async with self.admission.admit(len(items)):
                return await self._encode(items)
        except ItemError as e:
            self.metrics.errors.labels(e.code.name).inc()
            raise
        finally:
            self.metrics.request_seconds.observe(time.perf_counter() - t0)

    async def _encode(self, items: list[ItemRequest]) -> list[ItemResult]:
        loop = asyncio.get_running_loop()
        reply = ReplyBudget(self.config.max_message_mb << 20)
        fetches: dict = {}  # one download per URL for the request's items
        jobs = [Job(i, it, loop.create_future(), reply=reply, fetches=fetches) for i, it in enumerate(items)]
        try:
            for job in jobs:
                await self._step(job, self.stages.check)
            results = []
            for job in jobs:  # in index order: the first failure by index is the one reported
                results.append(await job.future)
            return results
        except BaseException:
            for job in jobs:  # a leader among them keeps going while identical items of others wait on it
                if not job.future.done():
                    job.future.cancel()
            raise
        finally:
            for job in jobs:  # an unretrieved exception of a later item is expected, not an error
                if job.future.done() and not job.future.cancelled():
                    job.future.exception()

    # ------------------------------------------------------------------ running stages and routing jobs
    async def _worker(self, inq: asyncio.Queue, stage) -> None:
        while True:
            job = await inq.get()
            if job.wanted:
                await self._step(job, stage)

    async def _step(self, job: Job, stage) -> None:
        """Runs one stage on `job` and sends the job where the stage says; a failure fails the job."""
        try:
            nxt = stage(job)
            if asyncio.iscoroutine(nxt):
                nxt = await nxt
        except ItemError as e:
            job.fail(e)
            return
        except asyncio.CancelledError:
            job.fail(ItemError(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))
            raise
        except (OSError, ValueError) as e:  # the standard library refusing the client's input (a path, a name)
            log.info("stage %s refused item %d", getattr(stage, "__name__", stage), job.index, exc_info=True)
            job.fail(from_client_input(e))
            return
        except Exception as e:  # a bug, not bad input: log it with its traceback, keep serving
            log.exception("stage %s failed on item %d", getattr(stage, "__name__", stage), job.index)
            job.fail(ItemError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
            return
        if job.wanted:
            await self._route(job, nxt)

    async def _fetch(self, job: Job) -> None:
        await self._step(job, self.stages.acquire)

    async def _route(self, job: Job, nxt: Next) -> None:
        if nxt is Next.FETCH:
            src = job.request.source
            if src.kind == "url" and not str(src.value)[:5].lower() == "data:":
                try:
                    host = url_host(str(src.value)).lower()
                except (ValueError, TypeError):
                    host = ""  # malformed: the fetch refuses it with the reason, at once
                self.fetches.submit(job, host)
            else:  # bytes at hand or on a local disk: never queued behind slow downloads
                await self._step(job, self.stages.acquire)
        elif nxt is Next.DECODE:
            await self.decode_q.put(job)
        elif nxt is Next.PREPROCESS:
            await self.preprocess_q.put(job)
        elif nxt is Next.BATCH:
            item, job.batch_item = job.batch_item, None
            await self.batcher.submit(item)
        elif nxt is Next.VIDEO:
            self.video.start(job)
        elif nxt is Next.AUDIO:
            self.audio.start(job)
        elif nxt not in (Next.ANSWERED, Next.ATTACHED):  # pragma: no cover - a new Next without a route
            raise AssertionError(f"no route for {nxt}")

    # ------------------------------------------------------------------ the forward (on the batcher's thread)
    def _warm_up(self) -> None:
        """One small image through preprocess and the tower, so the first request pays no import/compile cost."""
        import numpy as np

        f = self.preprocess_config.factor * 2
        pv, grid = preprocess_images(
            [np.zeros((f, f, 3), np.uint8)],
            self.preprocess_config,
            device=self.config.device,
            out_dtype=self.model.module.dtype,
            resize_backend=self.config.resize_backend,
            fold_time=True,
        )
        self.model.module(pv, grid)

    def _forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """On the calling forward thread's lane, with the tuner's intra-op threads (OpenMP's count is per thread)."""
        return self.lanes.run(pixel_values, grid_thw, self.tuner.threads)

    def _audio_forward(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        if self.audio_model is None or self.audio_model.module is None:  # pragma: no cover - never batched then
            raise RuntimeError("no windowed audio tower")
        return self.audio_model.module(features, frames)

    def _on_batch(self, items: int, patches: int, seconds: float) -> None:
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
