"""The `pil` backend: PIL (pillow-simd when installed) decodes every supported format.

Normalisation applied to every image, so the tower always sees what a person sees:
- EXIF orientation is applied (a phone photo taken in portrait is encoded upright);
- every mode becomes RGB: palette and alpha images are composited on white, CMYK/YCbCr/LAB converted,
  16-bit and 32-bit integer images scaled (not clipped) to 8 bits, floats clipped to 0..1.
The other backends hand PIL whatever they do not decode themselves, so this is also where errors are worded."""

from __future__ import annotations

import numpy as np

from ..errors import DecodeError
from .base import Decoded, DecodeRequest
from .jpeg_check import check_jpeg_data


def to_rgb(img):
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


class PilDecoder:
    name = "pil"

    def decode(self, data: bytes, request: DecodeRequest) -> Decoded:
        from PIL import ImageOps

        p = request.probe
        img = p.image
        drafted = request.draft_size is not None and p.format == "JPEG"
        if p.format == "JPEG":
            check_jpeg_data(data)  # PIL decodes a truncated JPEG with grey rows and no error
        try:
            if drafted:
                img.draft("RGB", request.draft_size)
            img.load()
            img = ImageOps.exif_transpose(img)
            img = to_rgb(img)
            arr = np.asarray(img, dtype=np.uint8)
        except Exception as e:  # noqa: BLE001 - PIL raises many types on damaged data
            msg = str(e)
            if "truncated" in msg.lower():
                raise DecodeError(f"truncated image data ({msg})") from None
            raise DecodeError(f"undecodable image: {msg}") from None
        if arr.ndim != 3 or arr.shape[2] != 3:
            raise DecodeError(f"decoded to an unexpected shape {arr.shape}")
        return Decoded.of(p, np.ascontiguousarray(arr), drafted)
