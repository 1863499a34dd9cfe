"""Image bytes fuzzed through a real encoder: valid JPEG/PNG/WebP/GIF/BMP/TIFF files, mutated.

Every reply must be a success or INVALID_ARGUMENT (the documented status of bad image bytes); never
INTERNAL, never a hang, and the server stays up. Also: header dimensions far beyond --max-image-pixels
must be refused from the header (a quick INVALID_ARGUMENT), whatever the format.
"""

from __future__ import annotations

import io
import struct
import time
import zlib

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from mimo_epd.v1 import encoder_pb2 as pb
from tests.conftest import encode_image, textured
from tests.fuzz.conftest import fuzz_settings
from tests.fuzz.mutate import mutated

pytestmark = pytest.mark.integration


def _corpus() -> dict[str, tuple[str, bytes]]:
    arr = textured(72, 96, seed=3)
    rgba = np.dstack([arr, np.linspace(0, 255, 72 * 96).reshape(72, 96).astype(np.uint8)])
    frames = [Image.fromarray(textured(64, 64, seed=s)).convert("P") for s in (1, 2)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    png16 = io.BytesIO()
    Image.fromarray((arr[..., 0].astype(np.uint16) * 257)).save(png16, "PNG")
    return {
        "baseline.jpg": ("JPEG", encode_image(arr, "JPEG", quality=85)),
        "progressive.jpg": ("JPEG", encode_image(arr, "JPEG", progressive=True)),
        "grey.jpg": ("JPEG", encode_image(arr, "JPEG", mode="L")),
        "cmyk.jpg": ("JPEG", encode_image(arr, "JPEG", mode="CMYK")),
        "rgb.png": ("PNG", encode_image(arr, "PNG")),
        "rgba.png": ("PNG", encode_image(rgba, "PNG")),
        "palette.png": ("PNG", encode_image(arr, "PNG", mode="P")),
        "grey16.png": ("PNG", png16.getvalue()),
        "lossy.webp": ("WEBP", encode_image(arr, "WEBP", quality=80)),
        "lossless.webp": ("WEBP", encode_image(arr, "WEBP", lossless=True)),
        "anim.gif": ("GIF", gif.getvalue()),
        "rgb.bmp": ("BMP", encode_image(arr, "BMP")),
        "raw.tiff": ("TIFF", encode_image(arr, "TIFF")),
        "lzw.tiff": ("TIFF", encode_image(arr, "TIFF", compression="tiff_lzw")),
    }


CORPUS = _corpus()
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


def test_corpus_is_valid(fuzz_server):
    for name, (_, data) in CORPUS.items():
        out = fuzz_server.encode(pb.MediaItem(data=data))
        assert out.code == grpc.StatusCode.OK, (name, out)


@fuzz_settings(40)
@given(case=mutated(CORPUS))
def test_mutated_images(fuzz_server, case):
    desc, data = case
    out = fuzz_server.encode(pb.MediaItem(data=data))
    assert out.code in ALLOWED, (desc, out)
    if out.code != grpc.StatusCode.OK:
        assert out.details.startswith("item 0: "), (desc, out)


def _png_with_size(w: int, h: int) -> bytes:
    raw = bytearray(CORPUS["rgb.png"][1])
    raw[16:24] = struct.pack(">II", w, h)
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])) & 0xFFFFFFFF)
    return bytes(raw)


def _jpeg_with_size(w: int, h: int) -> bytes:
    raw = bytearray(CORPUS["baseline.jpg"][1])
    i = raw.find(b"\xff\xc0")
    raw[i + 5 : i + 9] = struct.pack(">HH", h, w)
    return bytes(raw)


def _bmp_with_size(w: int, h: int) -> bytes:
    raw = bytearray(CORPUS["rgb.bmp"][1])
    raw[18:26] = struct.pack("<ii", w, h)
    return bytes(raw)


def _gif_with_size(w: int, h: int) -> bytes:
    raw = bytearray(CORPUS["anim.gif"][1])
    raw[6:10] = struct.pack("<HH", w, h)
    return bytes(raw)


@pytest.mark.parametrize(
    "make", [_png_with_size, _jpeg_with_size, _bmp_with_size, _gif_with_size], ids=["png", "jpeg", "bmp", "gif"]
)
@pytest.mark.parametrize("w,h", [(65535, 65535), (60000, 100), (3000, 3000)])
def test_huge_header_dimensions_are_refused_from_the_header(fuzz_server, make, w, h):
    """A few-KB file claiming more than --max-image-pixels (4 MP here): refused, and quickly (the check
    reads the header; a decoder that allocated first would take far longer or run out of memory)."""
    t0 = time.monotonic()
    out = fuzz_server.encode(pb.MediaItem(data=make(w, h)))
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out
    if w * h > 4_000_000:
        assert "limit" in out.details or "pixels" in out.details, out
    assert time.monotonic() - t0 < 10


@fuzz_settings(15)
@given(w=st.integers(1, 65535), h=st.integers(1, 65535), fmt=st.sampled_from(["png", "jpeg", "bmp", "gif"]))
def test_any_header_dimensions(fuzz_server, w, h, fmt):
    make = {"png": _png_with_size, "jpeg": _jpeg_with_size, "bmp": _bmp_with_size, "gif": _gif_with_size}[fmt]
    out = fuzz_server.encode(pb.MediaItem(data=make(w, h)))
    assert out.code in ALLOWED, (fmt, w, h, out)
