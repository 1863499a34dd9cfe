"""Every combination of the encoder's optimisation switches returns the same embeddings.

Switches: --pipeline, --batching, --decode-workers (thread vs process + shm handoff), --jpeg-draft,
--resize-in (device vs decoder), --decoder (turbo, pil, torchvision, dali when installed). Pipelines run
in-process (no gRPC), several requests at once so batches really form.

Pixels are identical across switches; embeddings agree within 1e-5 (fp32: a batched matmul may sum in
another order than a single-item one). The exception is JPEG draft decode, which changes pixels within its
documented bound (README: mean |diff| <= 2 levels, 99.9th percentile <= 8 levels of 255 after the
resize); embeddings of a draft-decoded image stay within 5% relative L2 of the full decode's.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_server.config import EncoderServerConfig
from encoder_server.decode_pool import DecodeOptions, decode_job
from encoder_server.fetch import MediaSource
from encoder_server.models import load_vision_model
from encoder_server.pipeline import EncodePipeline, ItemRequest
from encoder_server.preprocess import PreprocessConfig
from tests.conftest import encode_image, textured

MODEL = None


def images() -> list[bytes]:
    exif = Image.Exif()
    exif[0x0112] = 6
    return [
        encode_image(textured(480, 640, seed=1), "JPEG", quality=90),
        encode_image(textured(2400, 3200, seed=2), "JPEG", quality=90),  # draft applies (target <= half)
        encode_image(textured(1800, 2400, seed=3), "JPEG", quality=90, exif=exif.tobytes()),  # rotated + draft
        encode_image(textured(300, 200, seed=4), "PNG"),
    ]


async def run_pipeline(cfg: EncoderServerConfig, datas: list[bytes]) -> list[torch.Tensor]:
    global MODEL
    if MODEL is None:
        MODEL = load_vision_model("tiny", return_info=True)
    p = EncodePipeline(cfg, MODEL)
    await p.start()
    try:
        # Two requests of two items each, at once.
        reqs = [[ItemRequest(MediaSource("data", d)) for d in datas[i : i + 2]] for i in (0, 2)]
        results = await asyncio.gather(*(p.encode(r) for r in reqs))
        return [it.embedding for res in results for it in res]
    finally:
        await p.stop()


def config(**kw) -> EncoderServerConfig:
    base = dict(cache_bytes=0, resize_backend="pil", max_wait_ms=20.0)
    base.update(kw)
    return EncoderServerConfig(**base)


@pytest.fixture(scope="module")
def reference():
    datas = images()
    ref_full = asyncio.run(
        run_pipeline(
            config(
                pipeline=False, batching=False, decode_workers=0, jpeg_draft=False, resize_in="device", decoder="pil"
            ),
            datas,
        )
    )
    return datas, ref_full


SWITCHES = list(itertools.product([True, False], [True, False], [0, 1], ["device", "decoder"]))


@pytest.mark.parametrize(
    "pipeline,batching,workers,resize_in",
    SWITCHES,
    ids=[f"pipe{int(a)}-batch{int(b)}-workers{c}-{d}" for a, b, c, d in SWITCHES],
)
def test_switches_give_identical_embeddings(reference, pipeline, batching, workers, resize_in):
    datas, ref = reference
    out = asyncio.run(
        run_pipeline(
            config(pipeline=pipeline, batching=batching, decode_workers=workers, jpeg_draft=False, resize_in=resize_in),
            datas,
        )
    )
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("decoder", ["turbo", "torchvision", "dali"])
def test_decoders_give_identical_embeddings(reference, decoder):
    if decoder == "dali":
        pytest.importorskip("nvidia.dali", reason="the dali extra is not installed")
    datas, ref = reference
    out = asyncio.run(run_pipeline(config(decode_workers=1, jpeg_draft=False, decoder=decoder), datas))
    for a, b in zip(out, ref):
        # Same libjpeg-turbo IDCT: identical, or off by a rounding at most.
        assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()


def test_jpeg_draft_within_documented_bound(reference):
    datas, ref = reference
    out = asyncio.run(run_pipeline(config(decode_workers=1, jpeg_draft=True), datas))
    for i, (a, b) in enumerate(zip(out, ref)):
        rel = ((a - b).norm() / b.norm()).item()
        if i in (0, 3):  # small JPEG and PNG: no draft
            assert rel < 1e-5
        else:
            assert 0 < rel < 0.05


@pytest.mark.parametrize("hw,scale", [((2160, 3840), 2), ((3000, 2000), 2), ((4000, 6000), 4)])
def test_draft_pixel_bound(hw, scale):
    cfg = PreprocessConfig()
    data = encode_image(textured(*hw, seed=sum(hw)), "JPEG", quality=90)
    full = decode_job(data, DecodeOptions(10**9, jpeg_draft=False, resize=True, preprocess=cfg), -1)
    draft = decode_job(data, DecodeOptions(10**9, jpeg_draft=True, resize=True, preprocess=cfg), -1)
    assert draft[2][1] == scale and full[2][1] == 1
    assert full[1].shape == draft[1].shape
    d = np.abs(full[1].astype(int) - draft[1].astype(int))
    assert d.mean() <= 2.0 and np.percentile(d, 99.9) <= 8
