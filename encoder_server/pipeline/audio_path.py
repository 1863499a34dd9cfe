"""The audio side path: an audio item's ranges are decoded (and featurised) in the decode processes, and
its 30-s windows go through the cross-request batcher, sharing its token budget with images; the audio
tower runs on the batcher's forward thread like every tower call. A short item is one range; a long one is
decoded in parallel ranges, streamed window by window (`audio.encode.encode_audio`). Large items are
handed to the decoders as a file in /dev/shm (each range's decoder opens and seeks it), small ones as bytes.

MiMo's audio (`mimo`: its tokenizer and encoder) takes another road from the decoded samples on: the item's ranges
(one for a short item, `--audio-chunk-seconds` each for a long one, decoded ahead in the decode processes as above)
are pushed in order into a `MiMoAudioStream` on the batcher's forward thread (as every tower call is), which computes
each minute-long segment's log-mel, codes and rows as soon as its samples are in (models/mimo_audio.py): memory holds
the ranges decoding and one segment, whatever the item's length. `--audio-seconds-in-flight` bounds the seconds held
(a short item's duration, a long one's ranges in flight). Its tokens are groups of code frames, not 30-s windows:
`window_tokens` is one entry, the item's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import tempfile

import grpc
import torch

from mimo_epd.common.content_key import codes_key

from ..audio.decode import AudioError
from ..audio.encode import AudioPlan, AudioResult, AudioWindowItem, decoded_ranges, encode_audio, probe_job
from ..audio.features import LogMel
from ..embedding_cache import CachedEmbedding
from ..errors import ItemError, invalid
from ..models.mimo_audio import MiMoAudioModel, MiMoAudioStream
from .jobs import Job

log = logging.getLogger(__name__)

INLINE_BYTES = 8 << 20  # items up to this size travel to the decoders as bytes, larger ones as a file


class SecondsBudget:
    """Seconds of audio held at once (MiMo's items are decoded whole): `hold(s)` waits until `s` more fit under
    `limit`, or until nothing else is held (an item longer than the limit runs alone, never starves)."""

    def __init__(self, limit: float):
        self.limit, self.held = limit, 0.0
        self._cond = asyncio.Condition()

    async def acquire(self, seconds: float) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.held == 0 or self.held + seconds <= self.limit)
            self.held += seconds

    async def release(self, seconds: float) -> None:
        async with self._cond:
            self.held -= seconds
            self._cond.notify_all()


class AudioPath:
    def __init__(
        self,
        plan: AudioPlan,
        decode_pool,
        batcher,
        cache,
        max_concurrent: int,
        features_on: LogMel | None,
        mimo: MiMoAudioModel | None = None,
        seconds_in_flight: float = 7200.0,
        metrics=None,
    ):
        self.plan = plan
        self.mimo = mimo
        self.budget = SecondsBudget(seconds_in_flight)
        self.decode_pool = decode_pool
        self.batcher = batcher
        self.cache = cache
        self.features_on = features_on
        self._sem = asyncio.Semaphore(max_concurrent)
        self._tasks: set[asyncio.Task] = set()
        self.metrics = metrics  # EncoderMetrics: codes hits and stores are cache lookups' `codes_hit`, `codes_stored`

    def start(self, job: Job) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def _windows(self, job: Job, feats: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        loop = asyncio.get_running_loop()
        items = [AudioWindowItem(feats[i], frames[i], job, loop.create_future()) for i in range(len(frames))]
        for it in items:
            await self.batcher.submit(it)
        return list(await asyncio.gather(*(it.future for it in items)))

    async def _encode(self, job: Job, src):
        if self.mimo is not None:
            return await self._encode_mimo(src)
        return await encode_audio(
            src, self.plan, self.decode_pool.run, lambda f, n: self._windows(job, f, n), self.features_on
        )

    async def _encode_mimo(self, src) -> AudioResult:
        import time

        assert self.mimo is not None
        t0 = time.perf_counter()
        info = await self.decode_pool.run(probe_job, src, self.plan)
        ranges = self.plan.ranges(info.duration_s)
        if len(ranges) > 1:  # streamed: the ranges decoding ahead
            held = min(info.duration_s, self.plan.lookahead * self.plan.chunk_s)
        else:  # decoded whole; an undeclared duration is held alone
            held = info.duration_s if info.duration_s > 0 else self.budget.limit
        await self.budget.acquire(held)
        stream, rows, decoded, waited, tw = MiMoAudioStream(self.mimo), [], 0, 0.0, time.perf_counter()
        try:
            async for chunk in decoded_ranges(src, self.plan, self.decode_pool.run, ranges, False):
                waited += time.perf_counter() - tw
                decoded += chunk.n_samples
                samples, chunk = torch.from_numpy(chunk.samples), None
                rows += await self._on_forward_thread(stream.push, samples)
                tw = time.perf_counter()
            if decoded <= 480:
                raise AudioError(f"{decoded / 24000 * 1e3:.1f} ms of audio: MiMo's features need over 20 ms")
            rows += await self._on_forward_thread(stream.finish)
        finally:
            await self.budget.release(held)
        emb = torch.cat(rows).cpu()
        total = time.perf_counter() - t0
        seconds = {"total": total, "wait_decode": waited, "encode": total - waited}
        codes = torch.cat(stream.codes).to(torch.int32).cpu()
        return AudioResult(emb, [int(emb.shape[0])], info, decoded / 24000, seconds, codes)

    async def _from_codes(self, job: Job) -> CachedEmbedding | None:
        """MiMo's audio: the item's rows from its cached codes (no decode, no tokenizer: the encoder alone), or None
        when its codes are not cached. The codes entry outlives the rows' under the same bytes (a hundredth of
        their size), so an item whose rows were evicted costs the encoder's share of the work only."""
        if self.mimo is None or self.cache is None:
            return None
        hit = self.cache.get(codes_key(job.key))
        if hit is None or not hit.meta or "audio" not in hit.meta:
            return None
        try:
            rows = (await self._on_forward_thread(self.mimo.rows_from_codes, hit.embedding)).cpu()
        except Exception as e:  # noqa: BLE001 - a codes entry the encoder cannot take: encoded from the bytes
            log.warning("audio item %d: its cached codes failed (%s); encoding it from its bytes", job.index, e)
            self._count("codes_failed")
            return None
        meta = {"audio": hit.meta["audio"], "window_tokens": [int(rows.shape[0])]}
        return CachedEmbedding(rows, (1, int(rows.shape[0]), 1), meta)

    def _count(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.cache.labels(event).inc()

    async def _on_forward_thread(self, fn, *args):
        return await asyncio.wrap_future(self.batcher.call_on_forward_thread(fn, *args))

    async def _run(self, job: Job) -> None:
        async with self._sem:
            if not job.wanted:
                return
            data, job.data = job.data, None
            entry = await self._from_codes(job)
            if entry is not None:
                self._count("codes_hit")
                self.cache.put(job.key, entry)
                job.succeed(entry, cache_hit=False)
                return
            try:
                if len(data) <= INLINE_BYTES:
                    result = await self._encode(job, data)
                else:
                    tmpdir = "/dev/shm" if os.path.isdir("/dev/shm") else None
                    with tempfile.NamedTemporaryFile(dir=tmpdir, prefix="mimo-epd-audio-", suffix=".bin") as f:
                        f.write(data)
                        f.flush()
                        del data
                        result = await self._encode(job, f.name)
            except AudioError as e:
                job.fail(invalid(f"audio: {e}"))
                return
            except ItemError as e:  # a failed forward of a window
                job.fail(e)
                return
            except (asyncio.CancelledError, concurrent.futures.CancelledError):
                if job.wanted:  # the server is stopping (not an abandoned item)
                    job.fail(ItemError(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))
                return
            except concurrent.futures.process.BrokenProcessPool:
                job.fail(ItemError(grpc.StatusCode.UNAVAILABLE, "a decoder process died; retry"))
                return
            except Exception as e:  # noqa: BLE001 - a bug, not bad input
                log.exception("audio item %d failed", job.index)
                job.fail(ItemError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
                return
            sec = result.seconds
            job.timings_ms.update(decode=sec["wait_decode"] * 1e3, encode=sec["encode"] * 1e3)
            meta = {
                "audio": {**result.info.summary(), "decoded_s": result.decoded_s},
                "window_tokens": result.window_tokens,
            }
            entry = CachedEmbedding(result.embedding, (1, int(result.embedding.shape[0]), 1), meta)
            if self.cache is not None:
                self.cache.put(job.key, entry)
                if result.codes is not None:  # first the rows: a codes entry never stands for rows not yet there
                    codes = CachedEmbedding(result.codes, (1, int(result.codes.shape[0]), 1), {"audio": meta["audio"]})
                    if self.cache.put(codes_key(job.key), codes):
                        self._count("codes_stored")
            job.succeed(entry, cache_hit=False)
