"""Stage 2 of the pipeline: bytes -> HxWx3 uint8 RGB pixels.

`decode_image` runs in worker processes (it is CPU-bound and holds the GIL), so it takes and returns
plain picklable values and raises only `DecodeError`.

Normalisation applied to every image, so the tower always sees what a person sees:
- EXIF orientation is applied (a phone photo taken in portrait is encoded upright);
- every mode becomes RGB: palette and alpha images are composited on white, CMYK/YCbCr/LAB
  converted, 16-bit and 32-bit integer images scaled (not clipped) to 8 bits, floats clipped to 0..1;
- the pixel count is checked from the header before pixels are decoded (decompression bombs).

Fast path: baseline/progressive RGB and greyscale JPEGs are decoded by libjpeg-turbo straight into a numpy
array (`simplejpeg`) — the same library and settings pillow uses, so the pixels are identical (tested), at
about 1.7x the speed (no PIL image object, no copy out of it). The same DCT scale PIL's `draft` would pick
is requested, and the EXIF orientation applied with numpy. Anything else — other formats, CMYK JPEGs,
damaged files — goes through PIL, which also words the errors. It is the `turbo` decoder (`--decoder`).
"""
from __future__ import annotations

import io
import warnings

import numpy as np

from .errors import DecodeError

try:
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - optional: PIL decodes everything
    _simplejpeg = None

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def _to_rgb(img):
    from PIL import Image

    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
        mode = img.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode.startswith("I;16") or mode == "I":
        arr = np.asarray(img)
        if mode.startswith("I;16"):
            scaled = (arr.astype(np.uint32) * 255 + 32767) // 65535
        else:  # 32-bit signed ints; treat values as 16-bit samples when they fit, else as full range
            arr = np.clip(arr.astype(np.int64), 0, None)
            top = 65535 if arr.max(initial=0) <= 65535 else int(arr.max())
            scaled = (arr * 255 + top // 2) // max(top, 1)
        return Image.fromarray(scaled.astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        return Image.fromarray((np.clip(arr, 0.0, 1.0) * 255 + 0.5).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


# libjpeg reports a truncated or damaged entropy-coded stream as a *warning* and goes on: the missing rows
# come out grey (a file cut in half and closed with an end-of-image marker decodes "fine" in PIL, torchvision
# and DALI). These warnings mean pixels were invented, so the image is refused; the harmless ones (extraneous
# bytes before a marker, an unknown JFIF revision, a bad ICC marker...) are not, as PIL accepts them.
_TRUNCATED_WARNINGS = ("premature end",)  # "premature end of data segment", "Premature end of JPEG file"
_CORRUPT_WARNINGS = ("bad huffman code", "bad arithmetic code", "instead of rst")


def jpeg_damage(message: str) -> str | None:
    """'truncated' / 'corrupt' when a libjpeg message says pixels are missing, else None."""
    m = message.lower()
    if any(w in m for w in _TRUNCATED_WARNINGS):
        return "truncated"
    if any(w in m for w in _CORRUPT_WARNINGS):
        return "corrupt"
    return None


def _damage_error(kind: str, message: str) -> DecodeError:
    what = "truncated image data" if kind == "truncated" else "corrupt JPEG data"
    return DecodeError(f"{what} (libjpeg: {message})")


def check_jpeg_data(data: bytes) -> None:
    """Raises DecodeError when libjpeg finds the JPEG's coded data truncated or damaged. Decoders that
    ignore libjpeg's warnings (PIL, torchvision, DALI) call it before decoding: a strict libjpeg-turbo decode
    at 1/8 scale, which entropy-decodes every block (that is where truncation shows) but skips most of the
    IDCT and colour work. The `turbo` fast path needs no check: its own decode is strict."""
    if _simplejpeg is None:  # pragma: no cover - simplejpeg is a dependency
        return
    try:
        h, w, colorspace, _ = _simplejpeg.decode_jpeg_header(data)
        _simplejpeg.decode_jpeg(data, colorspace="CMYK" if colorspace == "CMYK" else "GRAY",
                                min_width=(w + 7) // 8, min_height=(h + 7) // 8, strict=True)
    except ValueError as e:
        kind = jpeg_damage(str(e))
        if kind:
            raise _damage_error(kind, str(e)) from None
        # anything else (an unusual layout libjpeg-turbo will not convert): the decoder itself judges it


def turbo_jpeg_available() -> bool:
    return _simplejpeg is not None


def _draft_scale(size: tuple[int, int], draft_size: tuple[int, int] | None) -> int:
    """The DCT scale denominator PIL's JPEG `draft` picks: the largest of 8/4/2/1 not above the ratio."""
    if not draft_size:
        return 1
    ratio = min(size[0] // max(draft_size[0], 1), size[1] // max(draft_size[1], 1))
    return next(s for s in (8, 4, 2, 1) if ratio >= s)


def _exif_orient(arr: np.ndarray, orientation: int) -> np.ndarray:
    """The numpy equivalent of `ImageOps.exif_transpose` for EXIF orientations 2-8."""
    if orientation == 2:
        return arr[:, ::-1]
    if orientation == 3:
        return arr[::-1, ::-1]
    if orientation == 4:
        return arr[::-1]
    if orientation == 5:
        return arr.transpose(1, 0, 2)
    if orientation == 6:
        return np.rot90(arr, -1)
    if orientation == 7:
        return arr[::-1, ::-1].transpose(1, 0, 2)
    if orientation == 8:
        return np.rot90(arr, 1)
    return arr


def _decode_turbo_jpeg(img, data: bytes, draft_size: tuple[int, int] | None, rgbx: bool = False) -> np.ndarray | None:
    """libjpeg-turbo into numpy for a plain RGB/greyscale JPEG; None when PIL should decode it. `rgbx`: four
    bytes per pixel (the fourth is padding), the layout PIL keeps RGB images in, so `preprocess.pil_image`
    wraps it without a copy."""
    if _simplejpeg is None or img.format != "JPEG" or img.mode not in ("RGB", "L"):
        return None
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block: PIL's exif_transpose ignores it too
        orientation = 1
    w, h = img.size
    s = _draft_scale((w, h), draft_size)
    try:
        arr = _simplejpeg.decode_jpeg(data, colorspace="RGBX" if rgbx else "RGB", min_width=(w + s - 1) // s, min_height=(h + s - 1) // s,
                                      strict=True)
    except ValueError as e:
        kind = jpeg_damage(str(e))
        if kind:  # strict mode caught what PIL would decode silently (grey rows in place of missing data)
            raise _damage_error(kind, str(e)) from None
        return None  # an unusual file: PIL decodes it or reports the precise error
    except Exception:  # noqa: BLE001 - as above
        return None
    if arr.shape[:2] != ((h + s - 1) // s, (w + s - 1) // s):
        return None
    return _exif_orient(arr, orientation if orientation in range(1, 9) else 1)


def decode_image(data: bytes, max_pixels: int, draft_size: tuple[int, int] | None = None,
                 turbo: bool = False, rgbx: bool = False) -> np.ndarray:
    """Decodes one image to HxWx3 uint8. `draft_size` (w, h), when set, lets JPEG decode at a reduced DCT scale
    no smaller than that size (see the JPEG draft decode in the README). `turbo` takes the libjpeg-turbo
    fast path for the JPEGs it handles (same pixels); with `rgbx` that path returns HxWx4 (RGB + padding)
    for a caller that resizes with PIL next."""
    from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

    ImageFile.LOAD_TRUNCATED_IMAGES = False
    if not data:
        raise DecodeError("empty item (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except UnidentifiedImageError:
        raise DecodeError(f"unsupported or unrecognised image format (supported: {', '.join(SUPPORTED_FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DecodeError(f"image has too many pixels, over the limit of {max_pixels} (--max-image-pixels): {e}",
                          "too_large") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types on malformed headers
        raise DecodeError(f"undecodable image: {e}") from None
    w, h = img.size
    if w * h > max_pixels:
        raise DecodeError(f"image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels} (--max-image-pixels)", "too_large")
    if w == 0 or h == 0:
        raise DecodeError(f"image has an empty size {w}x{h}")
    fast = _decode_turbo_jpeg(img, data, draft_size, rgbx) if turbo else None
    if fast is not None:
        return np.ascontiguousarray(fast)
    if img.format == "JPEG":
        check_jpeg_data(data)
    try:
        if draft_size is not None and img.format == "JPEG":
            img.draft("RGB", draft_size)
        img.load()
        img = ImageOps.exif_transpose(img)
        img = _to_rgb(img)
        arr = np.asarray(img, dtype=np.uint8)
    except DecodeError:
        raise
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        if "truncated" in msg.lower():
            raise DecodeError(f"truncated image data ({msg})") from None
        raise DecodeError(f"undecodable image: {msg}") from None
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise DecodeError(f"decoded to an unexpected shape {arr.shape}")
    return np.ascontiguousarray(arr)

