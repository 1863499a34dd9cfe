"""The image header, opened once per image: format, size, EXIF orientation and the pixel limits.

The draft policy, the decoders and the resize all need some of it; the `Probe` (with the opened, not yet
loaded, PIL image) travels with the request so nothing opens the file a second time."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from ..errors import DecodeError

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass
class Probe:
    image: object  # PIL.Image.Image, opened lazily (pixels not decoded yet); the pil backend loads it
    format: str
    mode: str
    width: int  # as stored, before the EXIF orientation
    height: int
    orientation: int  # EXIF orientation 1..8 of a JPEG (1 when absent or unreadable, and for other formats:
    # the pil backend applies theirs after decoding, and the decoded shape is then the source size)
    complete_jpeg: bool  # JPEG magic and an end-of-image marker near the end

    @property
    def swapped(self) -> bool:
        return self.orientation in (5, 6, 7, 8)

    @property
    def oriented_size(self) -> tuple[int, int]:
        """(h, w) as displayed, after the EXIF orientation (for a JPEG; other formats: as stored)."""
        return (self.width, self.height) if self.swapped else (self.height, self.width)


def _complete_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff" and b"\xff\xd9" in data[-4096:]


def probe(data: bytes, max_pixels: int) -> Probe:
    """Opens the header (no pixel is decoded) and applies the limits: empty, unrecognised, decompression
    bomb, too many pixels, empty size. Raises DecodeError."""
    from PIL import Image, ImageFile, UnidentifiedImageError

    ImageFile.LOAD_TRUNCATED_IMAGES = False
    if not data:
        raise DecodeError("empty item (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except UnidentifiedImageError:
        raise DecodeError(
            f"unsupported or unrecognised image format (supported: {', '.join(SUPPORTED_FORMATS)})"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DecodeError(
            f"image has too many pixels, over the limit of {max_pixels} (--max-image-pixels): {e}", "too_large"
        ) from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types on malformed headers
        raise DecodeError(f"undecodable image: {e}") from None
    w, h = img.size
    if w * h > max_pixels:
        raise DecodeError(
            f"image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels} (--max-image-pixels)", "too_large"
        )
    if w == 0 or h == 0:
        raise DecodeError(f"image has an empty size {w}x{h}")
    orientation = 1
    if img.format == "JPEG":  # its EXIF block is in the header; a PNG's may follow the pixels (getexif decodes them)
        try:
            orientation = img.getexif().get(0x0112, 1)
        except Exception:  # noqa: BLE001 - a broken EXIF block: PIL's exif_transpose ignores it too
            orientation = 1
        if orientation not in range(1, 9):
            orientation = 1
    return Probe(img, img.format, img.mode, w, h, orientation, _complete_jpeg(data))
