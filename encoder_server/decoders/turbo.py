"""The `turbo` backend (the default): libjpeg-turbo decodes baseline/progressive RGB and greyscale JPEGs
straight into a numpy array (`simplejpeg`) — the same library and settings pillow uses, so the pixels are
identical (tested), at about 1.7x the speed (no PIL image object, no copy out of it). The DCT scale PIL's
`draft` would pick is requested, and the EXIF orientation applied with numpy. Its decode is strict, so a
truncated or damaged file is refused rather than padded. Anything else (other formats, CMYK JPEGs, unusual
files) goes to the `pil` backend."""

from __future__ import annotations

import numpy as np

from .base import Decoded, DecodeRequest
from .draft import dct_scale
from .jpeg_check import damage_error, jpeg_damage

try:
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - optional: PIL decodes everything
    _simplejpeg = None


def available() -> bool:
    return _simplejpeg is not None


def exif_orient(arr: np.ndarray, orientation: int) -> np.ndarray:
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


def decode_fast(data: bytes, request: DecodeRequest) -> np.ndarray | None:
    """libjpeg-turbo into numpy for a plain RGB/greyscale JPEG; None when PIL should decode it. With
    `request.rgbx`: four bytes per pixel (the fourth is padding), the layout PIL keeps RGB images in, so
    `preprocess.pil_image` wraps it without a copy. Raises DecodeError for truncated/damaged data."""
    p = request.probe
    if _simplejpeg is None or p.format != "JPEG" or p.mode not in ("RGB", "L"):
        return None
    w, h = p.width, p.height
    s = dct_scale((w, h), request.draft_size)
    try:
        arr = _simplejpeg.decode_jpeg(
            data,
            colorspace="RGBX" if request.rgbx else "RGB",
            min_width=(w + s - 1) // s,
            min_height=(h + s - 1) // s,
            strict=True,
        )
    except ValueError as e:
        kind = jpeg_damage(str(e))
        if kind:  # strict mode caught what PIL would decode silently (grey rows in place of missing data)
            raise damage_error(kind, str(e)) from None
        return None  # an unusual file: PIL decodes it or reports the precise error
    except Exception:  # noqa: BLE001 - as above
        return None
    if arr.shape[:2] != ((h + s - 1) // s, (w + s - 1) // s):
        return None
    return exif_orient(arr, p.orientation)


class TurboDecoder:
    name = "turbo"

    def decode(self, data: bytes, request: DecodeRequest) -> Decoded:
        fast = decode_fast(data, request)
        if fast is None:
            from . import get_decoder

            return get_decoder("pil").decode(data, request)
        return Decoded.of(request.probe, np.ascontiguousarray(fast), request.draft_size is not None)
