"""Forward workers and their lanes: how many forwards run at once follows `workers()`, each forward thread
keeps one lane, lanes map to devices (worker i on device i mod N, a stream each), and a lane's output equals
the one-thread forward's. The CPU thread path runs here; the CUDA test runs where a GPU is."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from encoder_server.batcher import Batcher, BatchItem
from encoder_server.models import load_vision_model
from encoder_server.pipeline.lanes import ForwardLanes, lane_devices
from tests.encoder.test_batcher import FakeJob


def test_lane_devices_spread_workers_over_devices():
    assert lane_devices("cuda", 4, visible=2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert lane_devices("cuda", 3, visible=1) == ["cuda:0"] * 3  # three streams on one GPU
    assert lane_devices("cuda:1", 2, visible=4) == ["cuda:1", "cuda:1"]
    assert lane_devices("cpu", 2) == ["cpu", "cpu"]


def tiny_inputs(n: int = 3):
    from encoder_server.preprocess import PreprocessConfig, preprocess_images
    from tests.conftest import textured

    model = load_vision_model("tiny", return_info=True).module
    pre = PreprocessConfig.preset("qwen2_vl_patch16" if model.config.patch_size == 16 else "qwen2_5_vl")
    model.patch_embed.set_input_normalization(pre.mean, pre.std)
    images = [textured(96 + 32 * i, 128, seed=i) for i in range(n)]
    return model, [preprocess_images([im], pre, fold_time=True) for im in images]


def test_cpu_lanes_one_per_thread_and_equal_to_one_thread_forward():
    model, inputs = tiny_inputs()
    with torch.inference_mode():
        want = [model(pv, grid) for pv, grid in inputs]
    lanes = ForwardLanes(model, "cpu", 2)
    assert lanes.replicas == 1 and [lane.device.type for lane in lanes.lanes] == ["cpu", "cpu"]
    got: dict[str, list] = {}
    seen: dict[str, set[int]] = {}
    barrier = threading.Barrier(2)

    def worker():
        name = threading.current_thread().name
        barrier.wait(timeout=30)  # both threads take their lane before either runs a second forward
        with torch.inference_mode():
            for pv, grid in inputs:
                got.setdefault(name, []).append(lanes.run(pv, grid, threads=1))
                seen.setdefault(name, set()).add(lanes.lane().index)

    threads = [threading.Thread(target=worker, name=f"fw{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(i for s in seen.values() for i in s) == [0, 1]  # a lane each, always the same one
    for outs in got.values():
        for a, b in zip(outs, want):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lanes_match_the_cpu_forward():
    model, inputs = tiny_inputs()
    with torch.inference_mode():
        want = [model(pv, grid) for pv, grid in inputs]
    lanes = ForwardLanes(model.to("cuda"), "cuda", 2 * torch.cuda.device_count())
    assert lanes.replicas == torch.cuda.device_count() and all(lane.stream is not None for lane in lanes.lanes)
    with torch.inference_mode():
        for lane in lanes.lanes:
            for (pv, grid), w in zip(inputs, want):
                out = lane.run(pv, grid).float().cpu()
                assert torch.allclose(out, w, rtol=1e-3, atol=1e-4)


def overlap(workers: int, batches: int = 4) -> int:
    """The most forwards the batcher ran at once with `workers()` == workers (each forward sleeps)."""
    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    def forward(pv, grid):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.15)
        with lock:
            state["now"] -= 1
        return pv

    async def go():
        done = asyncio.get_running_loop().create_future()
        count = {"n": 0}

        def on_done(*_):
            count["n"] += 1
            if count["n"] == batches and not done.done():
                done.set_result(None)

        b = Batcher(
            forward,
            on_done=on_done,
            max_batch_tokens=4,  # one item per batch
            merge_unit=1,
            max_wait_ms=1,
            queue_depth=16,
            max_workers=2,
            workers=lambda: workers,
        )
        task = asyncio.create_task(b.run())
        for i in range(batches):
            await b.submit(BatchItem(torch.zeros(4, 4), (1, 2, 2), FakeJob(str(i))))
        await asyncio.wait_for(done, 30)
        task.cancel()
        b.shutdown()

    asyncio.run(go())
    return state["most"]


def test_one_worker_runs_one_forward_at_a_time():
    assert overlap(1) == 1


def test_two_workers_run_two_batches_at_once():
    assert overlap(2) == 2


def test_pipeline_with_two_forward_workers_gives_the_same_embeddings():
    from encoder_server.config import EncoderServerConfig
    from encoder_server.fetch import MediaSource
    from encoder_server.pipeline import EncodePipeline, ItemRequest
    from tests.conftest import encode_image, textured

    images = [encode_image(textured(120 + 16 * i, 160, seed=i), "JPEG") for i in range(6)]

    async def encode(workers: int):
        cfg = EncoderServerConfig(cache_bytes=0, decode_workers=0, max_wait_ms=1.0, forward_workers=workers)
        p = EncodePipeline(cfg)
        assert p.max_forward_workers == workers and p.tuner.workers == workers
        await p.start()
        try:
            return await asyncio.gather(*(p.encode([ItemRequest(MediaSource("data", b))]) for b in images))
        finally:
            await p.stop()

    one, two = asyncio.run(encode(1)), asyncio.run(encode(2))
    for (a,), (b,) in zip(one, two):
        assert a.grid_thw == b.grid_thw and torch.equal(a.embedding, b.embedding)
