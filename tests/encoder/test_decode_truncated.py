"""A JPEG cut short and closed with an end-of-image marker: libjpeg pads the missing rows with grey and
only warns, so every decoder used to accept it. It is refused as truncated, by every decoder and draft
scale; harmless libjpeg warnings (extraneous bytes before a marker) still decode, as in PIL."""

from __future__ import annotations

import numpy as np
import pytest

from encoder_server.decode_pool import DecodeOptions, decode_job, decode_on_device
from encoder_server.decoders import decode_image
from encoder_server.decoders.jpeg_check import check_jpeg_data, jpeg_damage
from encoder_server.errors import DecodeError
from encoder_server.preprocess import PreprocessConfig
from tests.conftest import encode_image, textured

LIMIT = 50_000_000
EOI = b"\xff\xd9"


def cut_in_half(data: bytes) -> bytes:
    return data[: len(data) // 2] + EOI


CASES = {
    "baseline": encode_image(textured(480, 640, seed=1), "JPEG", quality=90),
    "progressive": encode_image(textured(480, 640, seed=2), "JPEG", quality=90, progressive=True),
    "grey": encode_image(textured(480, 640, seed=3)[..., 0], "JPEG", quality=90),
    "cmyk": encode_image(textured(240, 320, seed=4), "JPEG", mode="CMYK"),
}


def test_pil_alone_accepts_the_cut_file():
    """Why the check exists: PIL (LOAD_TRUNCATED_IMAGES off) decodes it and invents grey rows."""
    import io

    from PIL import Image, ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = False
    with Image.open(io.BytesIO(cut_in_half(CASES["baseline"]))) as img:
        arr = np.asarray(img.convert("RGB"))
    assert arr.shape == (480, 640, 3) and (arr[-50:] == 128).mean() > 0.9


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("turbo", [True, False], ids=["turbo", "pil"])
@pytest.mark.parametrize("draft", [None, (160, 120)], ids=["full", "draft"])
def test_decode_image_refuses_a_jpeg_cut_in_half(case, turbo, draft):
    with pytest.raises(DecodeError, match="truncated image data") as ei:
        decode_image(cut_in_half(CASES[case]), LIMIT, draft_size=draft, turbo=turbo)
    assert "premature end" in str(ei.value).lower()
    # ...and without the end marker too
    with pytest.raises(DecodeError, match="truncated"):
        decode_image(CASES[case][: len(CASES[case]) // 2], LIMIT, draft_size=draft, turbo=turbo)
    # the whole file decodes
    assert decode_image(CASES[case], LIMIT, draft_size=draft, turbo=turbo).ndim == 3


@pytest.mark.parametrize("decoder", ["turbo", "pil", "torchvision"])
def test_every_decoder_in_the_workers_refuses_it(decoder):
    cut = cut_in_half(CASES["baseline"])
    for opts in (
        DecodeOptions(max_pixels=LIMIT, decoder=decoder, jpeg_draft=False),
        DecodeOptions(max_pixels=LIMIT, decoder=decoder, resize=True, patchify=True, preprocess=PreprocessConfig()),
    ):
        with pytest.raises(DecodeError, match="truncated"):
            decode_job(cut, opts, -1)
    with pytest.raises(DecodeError, match="truncated"):  # the GPU decode path, run with a CPU device
        decode_on_device(cut, DecodeOptions(max_pixels=LIMIT, decoder="torchvision"))


def test_dali_refuses_it():
    pytest.importorskip("nvidia.dali")
    with pytest.raises(DecodeError, match="truncated"):
        decode_job(
            cut_in_half(CASES["baseline"]), DecodeOptions(max_pixels=LIMIT, decoder="dali", jpeg_draft=False), -1
        )


def test_harmless_libjpeg_warnings_still_decode():
    data = CASES["baseline"]
    padded = data[:-2] + b"\x00" * 7 + EOI  # extraneous bytes before the end marker
    check_jpeg_data(padded)
    np.testing.assert_array_equal(decode_image(padded, LIMIT, turbo=True), decode_image(data, LIMIT, turbo=False))
    assert jpeg_damage("Corrupt JPEG data: 7 extraneous bytes before marker 0xd9") is None
    assert jpeg_damage("Corrupt JPEG data: bad Huffman code") == "corrupt"
    assert jpeg_damage("Premature end of JPEG file") == "truncated"
