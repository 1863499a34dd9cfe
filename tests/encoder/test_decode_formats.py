"""Every documented image format (JPEG, PNG, WebP, GIF, BMP, TIFF) decodes with the installed PIL build.

A pillow(-simd) built without a library's headers silently lacks that format (WebP needs libwebp-dev at
build time; scripts/setup_env.sh installs it and rebuilds a cached wheel that lacks it), so these tests
fail on a machine whose build cannot read a documented format."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from encoder_server.decoders import decode_image
from encoder_server.decoders.probe import SUPPORTED_FORMATS
from tests.conftest import textured

LIMIT = 50_000_000


def save(arr: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


ARR = textured(61, 83, seed=9)
# (format, save options, exact): exact = lossless, so the decode must equal the source pixels.
FORMATS = {
    "JPEG": ({"quality": 95}, False),
    "PNG": ({}, True),
    "WEBP": ({"lossless": True}, True),
    "WEBP-lossy": ({"quality": 80}, False),
    "GIF": ({}, False),  # palette: compared with PIL's own decode of the file
    "BMP": ({}, True),
    "TIFF": ({}, True),
    "TIFF-deflate": ({"compression": "tiff_deflate"}, True),
}


def sample(name: str) -> bytes:
    kw, _ = FORMATS[name]
    return save(ARR, name.split("-")[0], **kw)


def test_the_documented_formats_are_the_decoders_list():
    assert {n.split("-")[0] for n in FORMATS} == set(SUPPORTED_FORMATS)


def test_pil_build_has_every_codec_the_formats_need():
    from PIL import features

    missing = [c for c in ("jpg", "zlib", "webp") if not features.check(c)]
    assert not missing, (
        f"PIL was built without {missing}: rerun scripts/setup_env.sh (installs the -dev headers, rebuilds)"
    )


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("turbo", [True, False], ids=["turbo", "pil"])
def test_each_format_decodes(name, turbo):
    data = sample(name)
    out = decode_image(data, LIMIT, turbo=turbo)
    assert out.shape == ARR.shape and out.dtype == np.uint8
    _, exact = FORMATS[name]
    if exact:
        np.testing.assert_array_equal(out, ARR)
    else:
        with Image.open(io.BytesIO(data)) as img:
            ref = np.asarray(img.convert("RGB"))
        np.testing.assert_array_equal(out, ref)
        assert np.abs(out.astype(int) - ARR.astype(int)).mean() < 40  # a picture of the source, not noise
