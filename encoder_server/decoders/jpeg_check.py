"""Refusing JPEGs whose coded data is cut short or damaged.

libjpeg reports a truncated or damaged entropy-coded stream as a *warning* and goes on: the missing rows come
out grey (a file cut in half and closed with an end-of-image marker decodes "fine" in PIL, torchvision and
DALI). These warnings mean pixels were invented, so the image is refused; the harmless ones (extraneous bytes
before a marker, an unknown JFIF revision, a bad ICC marker...) are not, as PIL accepts them."""

from __future__ import annotations

from ..errors import DecodeError

try:
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - a dependency; without it PIL decodes everything unchecked
    _simplejpeg = None

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


def damage_error(kind: str, message: str) -> DecodeError:
    what = "truncated image data" if kind == "truncated" else "corrupt JPEG data"
    return DecodeError(f"{what} (libjpeg: {message})")


def check_jpeg_data(data: bytes) -> None:
    """Raises DecodeError when libjpeg finds the JPEG's coded data truncated or damaged. Decoders that ignore
    libjpeg's warnings (PIL, torchvision, DALI) call it before decoding: a strict libjpeg-turbo decode at 1/8
    scale, which entropy-decodes every block (where truncation shows) but skips most of the IDCT and colour
    work (about 2/3 of a full decode's time). The `turbo` fast path needs no check: its own decode is strict."""
    if _simplejpeg is None:  # pragma: no cover
        return
    try:
        h, w, colorspace, _ = _simplejpeg.decode_jpeg_header(data)
        _simplejpeg.decode_jpeg(
            data,
            colorspace="CMYK" if colorspace == "CMYK" else "GRAY",
            min_width=(w + 7) // 8,
            min_height=(h + 7) // 8,
            strict=True,
        )
    except ValueError as e:
        kind = jpeg_damage(str(e))
        if kind:
            raise damage_error(kind, str(e)) from None
        # anything else (a layout libjpeg-turbo will not convert): the decoder itself judges the file
