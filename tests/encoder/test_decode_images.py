"""decode_image: every PIL mode to RGB, EXIF orientation, limits and clear errors; the decode pool's transport."""

import io

import numpy as np
import pytest
from PIL import Image

from encoder_server.decoders import decode_image
from encoder_server.decoders.base import DecodeRequest, Stage
from encoder_server.decoders.probe import probe
from encoder_server.errors import DecodeError
from tests.conftest import encode_image, textured

LIMIT = 50_000_000


def save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_rgb_png_roundtrip_exact():
    arr = textured(37, 53)
    out = decode_image(encode_image(arr, "PNG"), LIMIT)
    assert out.dtype == np.uint8 and out.shape == (37, 53, 3)
    np.testing.assert_array_equal(out, arr)


def test_grayscale_becomes_three_equal_channels():
    g = textured(20, 30)[..., 0]
    out = decode_image(save(Image.fromarray(g, "L"), "PNG"), LIMIT)
    assert out.shape == (20, 30, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], g)


def test_alpha_modes_composite_on_white():
    rgba = np.zeros((10, 10, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:, :5, 3] = 255  # left half opaque red-ish, right half transparent
    out = decode_image(save(Image.fromarray(rgba, "RGBA"), "PNG"), LIMIT)
    assert (out[:, :5] == [200, 0, 0]).all() and (out[:, 5:] == 255).all()
    la = Image.fromarray(np.stack([np.full((4, 4), 10, np.uint8), np.zeros((4, 4), np.uint8)], -1), "LA")
    assert (decode_image(save(la, "PNG"), LIMIT) == 255).all()
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    p.info["transparency"] = 0
    assert (decode_image(save(p, "PNG", transparency=0), LIMIT) == 255).all()


def test_sixteen_bit_is_scaled_not_clipped():
    arr = np.array([[0, 32768, 65535]], dtype=np.uint16).repeat(4, 0)
    img = Image.fromarray(arr)
    assert img.mode == "I;16"
    out = decode_image(save(img, "PNG"), LIMIT)
    assert out[0, :, 0].tolist() == [0, 128, 255]


def test_cmyk_jpeg_decodes_to_rgb():
    out = decode_image(encode_image(textured(40, 60), "JPEG", mode="CMYK"), LIMIT)
    assert out.shape == (40, 60, 3)


def test_exif_orientation_applied():
    arr = textured(30, 50)
    exif = Image.Exif()
    exif[0x0112] = 8  # rotate 90 CCW to display
    out = decode_image(encode_image(arr, "JPEG", exif=exif.tobytes()), LIMIT)
    assert out.shape == (50, 30, 3)


@pytest.mark.parametrize(
    "data,fragment",
    [
        (b"", "empty"),
        (b"hello world, not an image", "unsupported"),
    ],
)
def test_bad_bytes(data, fragment):
    with pytest.raises(DecodeError, match=fragment):
        decode_image(data, LIMIT)


def test_corrupt_png_data():
    data = bytearray(encode_image(textured(64, 64), "PNG"))
    i = data.find(b"IDAT")
    data[i + 20 : i + 60] = b"\xff" * 40  # header intact, compressed stream broken
    with pytest.raises(DecodeError, match="undecodable"):
        decode_image(bytes(data), LIMIT)


def test_truncated_jpeg():
    data = encode_image(textured(200, 200), "JPEG")
    with pytest.raises(DecodeError, match="truncated"):
        decode_image(data[: len(data) // 3], LIMIT)


def test_pixel_limit_checked_from_header():
    data = encode_image(np.zeros((300, 400, 3), np.uint8), "PNG")
    with pytest.raises(DecodeError, match="over the limit") as ei:
        decode_image(data, 100_000)
    assert ei.value.kind == "too_large"


def test_decode_error_is_picklable():
    import pickle

    e = pickle.loads(pickle.dumps(DecodeError("x", "too_large")))
    assert e.reason == "x" and e.kind == "too_large"


def _jpeg_cases():
    arr = textured(333, 517, seed=3)
    cases = {
        "rgb-420": save(Image.fromarray(arr), "JPEG", quality=90),
        "rgb-444": save(Image.fromarray(arr), "JPEG", quality=95, subsampling=0),
        "progressive": save(Image.fromarray(arr), "JPEG", quality=85, progressive=True),
        "grey": save(Image.fromarray(arr[..., 1], "L"), "JPEG", quality=90),
    }
    for o in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = o
        cases[f"exif-{o}"] = save(Image.fromarray(arr), "JPEG", quality=90, exif=exif.tobytes())
    return cases


JPEG_CASES = _jpeg_cases()


@pytest.mark.parametrize("draft", [None, (258, 166), (129, 83), (60, 40)], ids=["full", "half", "quarter", "eighth"])
@pytest.mark.parametrize("case", sorted(JPEG_CASES))
def test_turbo_jpeg_path_is_pixel_identical_to_pil(case, draft):
    """The libjpeg-turbo fast path gives exactly PIL's pixels: subsampling, progressive, greyscale, every EXIF
    orientation, and PIL's own DCT scale for each draft size."""
    from encoder_server.decoders import turbo

    if not turbo.available():
        pytest.skip("simplejpeg is not installed: PIL decodes every JPEG")
    data = JPEG_CASES[case]
    assert turbo.decode_fast(data, DecodeRequest(probe(data, LIMIT), draft)) is not None  # the fast path really runs
    fast = decode_image(data, LIMIT, draft_size=draft, turbo=True)
    slow = decode_image(data, LIMIT, draft_size=draft, turbo=False)
    assert fast.shape == slow.shape and fast.flags.c_contiguous
    np.testing.assert_array_equal(fast, slow)
    # The decode workers' resize path: RGBX straight into PIL, resized, equals PIL's RGB decode resized.
    from encoder_server.preprocess import resize_pil_hwc

    fast4 = decode_image(data, LIMIT, draft_size=draft, turbo=True, rgbx=True)
    assert fast4.shape == (*slow.shape[:2], 4) and fast4.flags.c_contiguous
    np.testing.assert_array_equal(fast4[..., :3], slow)
    size = (slow.shape[0] * 3 // 5, slow.shape[1] * 2 // 3)
    np.testing.assert_array_equal(resize_pil_hwc(fast4, size), resize_pil_hwc(slow, size))


def test_turbo_jpeg_path_leaves_cmyk_to_pil_and_refuses_truncated_files():
    from encoder_server.decoders import turbo

    cmyk = encode_image(textured(40, 60), "JPEG", mode="CMYK")
    assert turbo.decode_fast(cmyk, DecodeRequest(probe(cmyk, LIMIT))) is None
    data = encode_image(textured(200, 200), "JPEG")
    half = data[: len(data) // 2]
    with pytest.raises(DecodeError, match="truncated"):  # strict libjpeg-turbo: no grey padding
        turbo.decode_fast(half, DecodeRequest(probe(half, LIMIT)))


@pytest.mark.parametrize("slot_bytes", [64 << 20, "input-only", 1024], ids=["both-fit", "input-fits", "neither-fits"])
def test_decode_pool_shared_memory_handoff_and_pickled_fallback(slot_bytes):
    """Real worker processes: the file goes in through the slot and the patches come back through it; what
    does not fit a slot travels pickled instead (counted in `fallbacks`), with the same result either way."""
    import asyncio

    from encoder_server.decode_pool import DecodeOptions, DecodePool, decode_job
    from encoder_server.preprocess import PreprocessConfig

    data = JPEG_CASES["rgb-420"]
    opts = DecodeOptions(max_pixels=LIMIT, resize=True, patchify=True, preprocess=PreprocessConfig())
    _, expected, meta = decode_job(data, opts, -1)  # in this process, nothing shared
    if slot_bytes == "input-only":
        slot_bytes = len(data) + 1
        assert expected.nbytes > slot_bytes

    async def run():
        pool = DecodePool(1, opts, slot_bytes=slot_bytes)
        await pool.start()
        try:
            out = [await pool.decode(data) for _ in range(3)]
        finally:
            pool.stop()
        return out, pool.fallbacks

    out, fallbacks = asyncio.run(run())
    for d in out:
        np.testing.assert_array_equal(d.pixels, expected)
        assert (d.source_size, d.draft_scale, d.stage) == meta and d.stage is Stage.PATCHES
        assert d.resized == "patches"  # the former spelling, kept for callers
    assert fallbacks == (0 if slot_bytes == 64 << 20 else 3)


@pytest.mark.parametrize("decoder", ["torchvision", "dali"])
@pytest.mark.parametrize("case", ["rgb-420", "grey", "exif-6", "progressive"])
def test_device_decode_path_gives_the_decoders_pixels_as_a_tensor(decoder, case):
    """The GPU decode path (`--decoder torchvision|dali --device cuda`, in the server process) run with a CPU
    device: the same pixels as that decoder in a worker process, as an HxWx3 tensor, with the oriented size."""
    import torch

    from encoder_server.decode_pool import DecodeOptions, decode_job, decode_on_device

    if decoder == "dali":
        pytest.importorskip("nvidia.dali")
    data = JPEG_CASES[case]
    opts = DecodeOptions(max_pixels=LIMIT, decoder=decoder, jpeg_draft=False)
    d = decode_on_device(data, opts)
    _, expected, meta = decode_job(data, opts, -1)
    assert isinstance(d.pixels, torch.Tensor) and d.pixels.dtype == torch.uint8
    np.testing.assert_array_equal(d.pixels.numpy(), expected)
    assert d.source_size == tuple(expected.shape[:2]) == meta[0] and (d.draft_scale, d.stage) == (1, Stage.DECODED)


def test_device_decode_path_falls_back_to_pil_and_keeps_the_limits():
    from encoder_server.decode_pool import DecodeOptions, DecodePool, decode_on_device, decodes_on_device
    from encoder_server.preprocess import PreprocessConfig

    opts = DecodeOptions(max_pixels=LIMIT, decoder="torchvision")
    png = encode_image(textured(40, 60), "PNG")
    np.testing.assert_array_equal(decode_on_device(png, opts).pixels, decode_image(png, LIMIT))  # not a JPEG
    cmyk = save(Image.fromarray(textured(40, 60)).convert("CMYK"), "JPEG")
    np.testing.assert_array_equal(decode_on_device(cmyk, opts).pixels, decode_image(cmyk, LIMIT))
    with pytest.raises(DecodeError, match="empty"):
        decode_on_device(b"", opts)
    with pytest.raises(DecodeError, match="over the limit") as ei:
        decode_on_device(JPEG_CASES["rgb-420"], DecodeOptions(max_pixels=1000, decoder="torchvision"))
    assert ei.value.kind == "too_large"
    # Which configurations decode on the GPU, and the one that cannot work.
    assert decodes_on_device(DecodeOptions(max_pixels=1, decoder="dali", device="cuda:0"))
    assert not decodes_on_device(DecodeOptions(max_pixels=1, decoder="turbo", device="cuda"))
    assert not decodes_on_device(DecodeOptions(max_pixels=1, decoder="torchvision", device="cpu"))
    with pytest.raises(ValueError, match="--resize-in device"):
        DecodePool(
            2,
            DecodeOptions(
                max_pixels=1, decoder="torchvision", device="cuda", resize=True, preprocess=PreprocessConfig()
            ),
        )


def test_stale_decode_arenas_of_dead_servers_are_removed(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from encoder_server.decode_pool import ARENA_PREFIX, remove_stale_arenas

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    old = time.time() - 3600
    names = {
        "dead": f"{ARENA_PREFIX}{dead_pid}-aaaa",
        "alive": f"{ARENA_PREFIX}{os.getppid()}-bbbb",
        "young": f"{ARENA_PREFIX}{dead_pid}-cccc",
        "other": "someone-elses-segment",
    }
    for key, name in names.items():
        (tmp_path / name).write_bytes(b"x")
        if key != "young":
            os.utime(tmp_path / name, (old, old))
    assert remove_stale_arenas(str(tmp_path)) == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "dead")
