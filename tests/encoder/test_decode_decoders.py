"""The decoders package: one registry of names (what --decoder validation uses), one protocol, a typed
result, and each image's header opened once whatever the backend."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from encoder_server import decoders
from encoder_server.config import EncoderServerConfig
from encoder_server.decode_pool import DecodeOptions, decode_job
from encoder_server.decoders.base import Decoded, DecodeRequest, Stage
from encoder_server.decoders.job import decode_item, decode_on_device
from encoder_server.decoders.probe import probe
from encoder_server.preprocess import PreprocessConfig
from tests.conftest import encode_image, textured

LIMIT = 50_000_000
JPEG = encode_image(textured(900, 1300, seed=4), "JPEG", quality=90)
PNG = encode_image(textured(90, 130, seed=5), "PNG")


def test_config_validation_uses_the_registry():
    assert decoders.DECODERS == ("turbo", "pil", "torchvision", "dali")
    for name in decoders.DECODERS:
        EncoderServerConfig(decoder=name).validate()
    with pytest.raises(ValueError, match="--decoder must be one of turbo, pil, torchvision, dali"):
        EncoderServerConfig(decoder="magick").validate()


@pytest.mark.parametrize("name", ["turbo", "pil", "torchvision"])
def test_every_backend_speaks_the_protocol(name):
    dec = decoders.get_decoder(name)
    assert dec.name == name and dec is decoders.get_decoder(name)
    for data in (JPEG, PNG):
        d = dec.decode(data, DecodeRequest(probe(data, LIMIT)))
        assert isinstance(d, Decoded) and d.stage is Stage.DECODED and d.draft_scale == 1
        assert d.pixels.dtype == np.uint8 and d.pixels.shape == (*d.source_size, 3)


@pytest.mark.parametrize("name", ["turbo", "pil", "torchvision"])
@pytest.mark.parametrize("resize", [False, True])
@pytest.mark.parametrize("which", ["jpeg", "png", "rotated-jpeg"])
def test_the_header_is_opened_once_per_image(monkeypatch, name, resize, which):
    exif = Image.Exif()
    exif[0x0112] = 6
    data = {
        "jpeg": JPEG,
        "png": PNG,
        "rotated-jpeg": encode_image(textured(900, 1300, seed=6), "JPEG", exif=exif.tobytes()),
    }[which]
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    opts = DecodeOptions(max_pixels=LIMIT, decoder=name, resize=resize, patchify=resize, preprocess=PreprocessConfig())
    d = decode_item(data, opts)
    assert len(opened) == 1
    assert d.stage is (Stage.PATCHES if resize else Stage.DECODED)
    if which == "rotated-jpeg":
        assert d.source_size == (1300, 900)
    opened.clear()
    decode_on_device(data, opts if name != "turbo" else DecodeOptions(max_pixels=LIMIT, decoder="torchvision"))
    assert len(opened) == 1


def test_draft_policy_in_one_place():
    from encoder_server.decoders.draft import dct_scale, draft_size

    cfg = PreprocessConfig()
    big = encode_image(textured(2400, 3200, seed=7), "JPEG")
    ds = draft_size(probe(big, LIMIT), cfg)
    assert ds is not None and dct_scale((3200, 2400), ds) == 2
    assert draft_size(probe(PNG, LIMIT), cfg) is None  # not a JPEG
    assert draft_size(probe(JPEG, LIMIT), cfg) is None  # target above half the source
    d = decode_item(big, DecodeOptions(max_pixels=LIMIT, preprocess=cfg))
    assert d.draft_scale == 2 and d.source_size == (2400, 3200) and d.pixels.shape == (1200, 1600, 3)
    _, _, meta = decode_job(big, DecodeOptions(max_pixels=LIMIT, preprocess=cfg), -1)
    assert meta == ((2400, 3200), 2, Stage.DECODED)
