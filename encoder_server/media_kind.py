"""What kind of media an item's bytes are, from their first bytes, to refuse a kind mismatch up front: PNG bytes
sent as a `video_url`, or an MP4 sent as an `image_url`, are INVALID_ARGUMENT naming both kinds, not a decode
that half works (a one-frame "video") or fails with a decoder's message.

`sniff(data)` knows the signatures of the image formats the decoders read (JPEG, PNG, GIF, WebP, BMP, TIFF) and
of the video containers (ISO-BMFF `ftyp` MP4/MOV, Matroska/WebM EBML, AVI, MPEG-TS). Bytes it does not know are
`None`: left to the decoder, which reports its own error. Audio and other kinds are not judged here.
"""

from __future__ import annotations

IMAGE, VIDEO = "image", "video"

_SIGNATURES: tuple[tuple[bytes, int, str, str], ...] = (
    (b"\xff\xd8\xff", 0, IMAGE, "JPEG"),
    (b"\x89PNG\r\n\x1a\n", 0, IMAGE, "PNG"),
    (b"GIF87a", 0, IMAGE, "GIF"),
    (b"GIF89a", 0, IMAGE, "GIF"),
    (b"BM", 0, IMAGE, "BMP"),
    (b"II*\x00", 0, IMAGE, "TIFF"),
    (b"MM\x00*", 0, IMAGE, "TIFF"),
    (b"ftyp", 4, VIDEO, "MP4/MOV"),
    (b"\x1a\x45\xdf\xa3", 0, VIDEO, "Matroska/WebM"),
)


def sniff(data: bytes) -> tuple[str, str] | None:
    """(kind, format name) of the bytes, or None when they carry no signature known here."""
    head = bytes(data[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return IMAGE, "WebP"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return VIDEO, "AVI"
    if len(data) > 376 and data[0] == 0x47 and data[188] == 0x47 and data[376] == 0x47:
        return VIDEO, "MPEG-TS"
    for sig, at, kind, name in _SIGNATURES:
        if head[at : at + len(sig)] == sig:
            if name == "BMP" and len(head) >= 6 and int.from_bytes(head[2:6], "little") < 26:
                continue  # "BM" followed by an impossible file size: not a BMP header
            return kind, name
    return None


def mismatch(data: bytes, modality: str) -> str | None:
    """The reason an item of `modality` (image | video) cannot be these bytes, or None."""
    if modality not in (IMAGE, VIDEO):
        return None
    found = sniff(data)
    if found is None or found[0] == modality:
        return None
    kind, name = found
    field = "image_url" if kind == IMAGE else "video_url"
    return f"the item was sent as {'a video' if modality == VIDEO else 'an image'} but its bytes are {name} ({kind}); send it as {field}"
