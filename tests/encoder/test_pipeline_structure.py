"""The pipeline's structure: stages say where a job goes next, the tower runs on one thread only
(the video path included), and the decode-fallback metric counts what the decode pool reports."""

from __future__ import annotations

import asyncio
import threading

import pytest

from encoder_server.config import EncoderServerConfig
from encoder_server.fetch import MediaSource
from encoder_server.models import load_vision_model
from encoder_server.pipeline import EncodePipeline, ItemRequest, Next
from tests.conftest import encode_image, textured

JPEG = encode_image(textured(240, 320, seed=21), "JPEG")


def pipeline(**kw) -> tuple[EncodePipeline, list[str]]:
    """A pipeline on its own tiny model whose forward records the thread it runs on."""
    model = load_vision_model("tiny", return_info=True)
    threads: list[str] = []
    forward = model.module.forward

    def recording_forward(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return forward(*args, **kwargs)

    model.module.forward = recording_forward
    base = dict(
        cache_bytes=1 << 24, decode_workers=0, max_wait_ms=1.0, video_decode_mode="thread", video_decode_workers=1
    )
    base.update(kw)
    return EncodePipeline(EncoderServerConfig(**base), model), threads


async def _run(p: EncodePipeline, *requests: list[ItemRequest]):
    await p.start()
    try:
        return await asyncio.gather(*(p.encode(r) for r in requests))
    finally:
        await p.stop()


@pytest.fixture(scope="module")
def video_bytes(tmp_path_factory):
    from mimo_epd.testing.video_gen import make_test_video

    path = tmp_path_factory.mktemp("v") / "short.mp4"
    make_test_video(str(path), 4, width=128, height=96, preset="ultrafast")
    return path.read_bytes()


def test_video_and_image_tower_calls_all_run_on_the_one_forward_thread(video_bytes):
    p, threads = pipeline()
    threads.clear()
    video = ItemRequest(MediaSource("data", video_bytes), "video", video_max_frames=8)
    p_threads_before_start = list(threads)
    (v, img), (img2,) = asyncio.run(
        _run(
            p,
            [video, ItemRequest(MediaSource("data", JPEG))],
            [ItemRequest(MediaSource("data", encode_image(textured(200, 300), "JPEG")))],
        )
    )
    assert v.grid_thw[0] == 4 and v.num_tokens == v.embedding.shape[0] > 0
    assert img.num_tokens > 0 and img2.num_tokens > 0
    serving = threads[len(p_threads_before_start) :]
    assert len(serving) >= 3, threads  # the start-up warm-up, the video's chunk(s) and the image batch(es)
    assert {t.rsplit("_", 1)[0] for t in serving} == {"vision-forward"}, threads


def test_stages_return_where_the_job_goes():
    from mimo_epd.common.content_key import bytes_digest

    p, _ = pipeline()

    async def go():
        await p.start()
        try:
            loop = asyncio.get_running_loop()
            from encoder_server.pipeline import Job

            job = Job(0, ItemRequest(MediaSource("data", JPEG)), loop.create_future())
            assert p.stages.check(job) is Next.FETCH
            assert await p.stages.acquire(job) is Next.DECODE
            assert await p.stages.decode(job) is Next.PREPROCESS
            assert await p.stages.preprocess(job) is Next.BATCH and job.batch_item.num_patches > 0
            twin = Job(1, ItemRequest(MediaSource("data", JPEG)), loop.create_future())
            assert await p.stages.acquire(twin) is Next.ATTACHED  # the first one is still in flight
            await p._route(job, Next.BATCH)  # to the batcher: answers the job, its twin, and caches it
            first, second = await asyncio.wait_for(asyncio.gather(job.future, twin.future), 60)
            assert not first.cache_hit and second.cache_hit and first.content_key == second.content_key
            hashed = Job(
                2,
                ItemRequest(MediaSource("url", "http://unused.invalid/x"), content_hash=bytes_digest(JPEG)),
                loop.create_future(),
            )
            assert p.stages.check(hashed) is Next.ANSWERED and hashed.future.result().cache_hit
            vid = Job(3, ItemRequest(MediaSource("data", b"not a video at all"), "video"), loop.create_future())
            p.stages.check(vid)
            assert await p.stages.acquire(vid) is Next.VIDEO
            aud = Job(4, ItemRequest(MediaSource("data", b"not audio either"), "audio"), loop.create_future())
            assert p.stages.check(aud) is Next.FETCH
            assert await p.stages.acquire(aud) is Next.AUDIO
            assert aud.key not in (vid.key, job.key)  # the kind's model and settings are in the key
        finally:
            await p.stop()

    asyncio.run(go())


def test_decode_fallback_metric_counts_images_too_large_for_a_slot():
    p, _ = pipeline(decode_workers=1, decode_slot_bytes=4096, cache_bytes=0)
    asyncio.run(
        _run(
            p,
            [ItemRequest(MediaSource("data", JPEG))],
            [ItemRequest(MediaSource("data", encode_image(textured(300, 200, seed=3), "JPEG")))],
        )
    )
    assert p.decode_pool.fallbacks == 2
    assert p.metrics.registry.get_sample_value("encoder_decode_pickled_total") == 2


def test_identical_item_of_another_request_is_answered_when_the_leaders_request_fails():
    """Request A's item leads, request B's identical item attaches to it, then A fails (another of its
    items was bad: A's futures are cancelled). The leader keeps going for B, and B gets the embedding."""
    p, _ = pipeline(cache_bytes=0)

    async def go():
        await p.start()
        try:
            from encoder_server.pipeline import Job

            loop = asyncio.get_running_loop()
            leader = Job(0, ItemRequest(MediaSource("data", JPEG)), loop.create_future())
            follower = Job(0, ItemRequest(MediaSource("data", JPEG)), loop.create_future())
            assert await p.stages.acquire(leader) is Next.DECODE
            assert await p.stages.acquire(follower) is Next.ATTACHED
            leader.future.cancel()  # what EncodePipeline._encode does when A fails
            assert leader.wanted
            await p._step(leader, p.stages.decode)  # decode -> preprocess -> batcher, as the workers do
            result = await asyncio.wait_for(follower.future, 60)
            assert result.num_tokens > 0 and result.cache_hit
        finally:
            await p.stop()

    asyncio.run(go())
