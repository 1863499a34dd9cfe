"""Structure-aware Hypothesis strategies: valid media files, then mutated where their decoders look.

Each image format gets a header editor that rewrites the fields a decoder trusts first (dimensions, bit
depth, component counts, chunk lengths), with values at the edges (0, 1, just under the 28 px minimum,
the 16/32-bit maxima, negative for signed fields); on top of that, generic mutations (truncation, bit
flips, overwritten ranges, duplicated or deleted ranges, trailing garbage). PNG chunks can keep a valid
CRC after an edit, so the mutation reaches past the checksum. Containers (MP4 boxes, Matroska elements)
get their size fields and well-known header boxes rewritten the same way.
"""

from __future__ import annotations

import struct
import zlib

from hypothesis import strategies as st

EDGE16 = [0, 1, 2, 27, 28, 29, 255, 256, 4096, 32767, 32768, 65535]
EDGE32 = [0, 1, 27, 28, 65535, 65536, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]


def _put(data: bytearray, off: int, fmt: str, value: int) -> None:
    size = struct.calcsize(fmt)
    if 0 <= off and off + size <= len(data):
        lo, hi = _range(fmt)
        data[off : off + size] = struct.pack(fmt, max(lo, min(hi, value)))


def _range(fmt: str) -> tuple[int, int]:
    bits = struct.calcsize(fmt) * 8
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if fmt[-1].islower() else (0, (1 << bits) - 1)


# ------------------------------------------------------------------------------ header editors
def edit_jpeg(data: bytearray, draw) -> None:
    """SOFn: precision, height, width, component count; or a marker segment length."""
    sofs = [i for i in range(len(data) - 9) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC1, 0xC2)]
    segs = [
        i for i in range(2, len(data) - 4) if data[i] == 0xFF and 0xC0 <= data[i + 1] <= 0xFE and data[i + 1] != 0xD9
    ]
    what = draw(st.sampled_from(["height", "width", "precision", "components", "seglen"]))
    if what == "seglen" and segs:
        _put(data, draw(st.sampled_from(segs)) + 2, ">H", draw(st.sampled_from(EDGE16) | st.integers(0, 65535)))
    elif sofs:
        i = draw(st.sampled_from(sofs))
        if what == "precision":
            data[i + 4] = draw(st.sampled_from([0, 1, 8, 12, 16, 255]))
        elif what == "components":
            data[i + 9] = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 255]))
        else:
            _put(data, i + (5 if what == "height" else 7), ">H", draw(st.sampled_from(EDGE16) | st.integers(0, 65535)))


def _png_chunks(data: bytes) -> list[tuple[int, bytes, int]]:
    out, off = [], 8
    while off + 8 <= len(data):
        (n,) = struct.unpack(">I", data[off : off + 4])
        out.append((off, bytes(data[off + 4 : off + 8]), n))
        if n > len(data):
            break
        off += 12 + n
    return out


def edit_png(data: bytearray, draw) -> None:
    """IHDR width/height/bit depth/colour type/interlace, a chunk length; CRC fixed up or left wrong."""
    chunks = _png_chunks(data)
    if not chunks:
        return
    what = draw(st.sampled_from(["width", "height", "depth", "colour", "interlace", "length"]))
    ihdr = next((c for c in chunks if c[1] == b"IHDR"), None)
    if what == "length":
        off, _, _ = draw(st.sampled_from(chunks))
        _put(data, off, ">I", draw(st.sampled_from(EDGE32) | st.integers(0, (1 << 32) - 1)))
        return
    if ihdr is None:
        return
    off = ihdr[0] + 8
    if what in ("width", "height"):
        _put(data, off + (0 if what == "width" else 4), ">I", draw(st.sampled_from(EDGE32) | st.integers(0, 1 << 20)))
    elif what == "depth":
        data[off + 8] = draw(st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 255]))
    elif what == "colour":
        data[off + 9] = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 255]))
    else:
        data[off + 12] = draw(st.sampled_from([0, 1, 2, 255]))
    if draw(st.booleans()):  # a valid CRC, so the decoder gets past it and trusts the edited field
        crc = zlib.crc32(bytes(data[ihdr[0] + 4 : off + 13])) & 0xFFFFFFFF
        _put(data, off + 13, ">I", crc)


def edit_gif(data: bytearray, draw) -> None:
    """Logical screen size, an image descriptor's position/size, the colour-table size bits."""
    what = draw(st.sampled_from(["screen", "frame", "table"]))
    if what == "screen":
        _put(data, draw(st.sampled_from([6, 8])), "<H", draw(st.sampled_from(EDGE16)))
    elif what == "table" and len(data) > 10:
        data[10] = draw(st.integers(0, 255))
    else:
        descs = [i for i in range(13, len(data) - 10) if data[i] == 0x2C]
        if descs:
            _put(
                data,
                draw(st.sampled_from(descs)) + draw(st.sampled_from([1, 3, 5, 7])),
                "<H",
                draw(st.sampled_from(EDGE16)),
            )


def edit_bmp(data: bytearray, draw) -> None:
    """BITMAPINFOHEADER width/height (signed: negative height = top-down), planes, bit count, compression,
    pixel-data offset, header size, palette size."""
    field = draw(
        st.sampled_from(
            [(18, "<i"), (22, "<i"), (26, "<H"), (28, "<H"), (30, "<I"), (10, "<I"), (14, "<I"), (46, "<I")]
        )
    )
    edge = [0, 1, -1, 27, 28, -28, 32768, -32768, (1 << 31) - 1, -(1 << 31), 4, 8, 16, 24, 32, 3, 6]
    _put(data, field[0], field[1], draw(st.sampled_from(edge) | st.integers(-(1 << 31), (1 << 31) - 1)))


def edit_tiff(data: bytearray, draw) -> None:
    """An IFD0 entry: tag, type, count or value (ImageWidth, ImageLength, BitsPerSample, StripOffsets ...)."""
    if len(data) < 8:
        return
    end = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack(end + "I", data[4:8])
    if ifd + 2 > len(data):
        return
    (n,) = struct.unpack(end + "H", data[ifd : ifd + 2])
    n = min(n, (len(data) - ifd - 2) // 12)
    if n == 0:
        return
    e = ifd + 2 + 12 * draw(st.integers(0, n - 1))
    part = draw(st.sampled_from([(0, "H"), (2, "H"), (4, "I"), (8, "I"), (8, "H")]))
    _put(data, e + part[0], end + part[1], draw(st.sampled_from(EDGE32) | st.integers(0, (1 << 32) - 1)))


def edit_webp(data: bytearray, draw) -> None:
    """RIFF size, the VP8/VP8L/VP8X chunk size, the bitstream's frame dimensions."""
    what = draw(st.sampled_from(["riff", "chunk", "dims"]))
    if what == "riff":
        _put(data, 4, "<I", draw(st.sampled_from(EDGE32)))
    elif what == "chunk":
        _put(data, 16, "<I", draw(st.sampled_from(EDGE32)))
    else:
        fourcc = bytes(data[12:16])
        if fourcc == b"VP8 ":  # keyframe header: 3 bytes tag, 3 bytes start code, 14-bit width/height
            _put(data, 26 + draw(st.sampled_from([0, 2])), "<H", draw(st.sampled_from(EDGE16)))
        elif fourcc == b"VP8L":
            for k in range(4):
                if 21 + k < len(data):
                    data[21 + k] = draw(st.integers(0, 255))
        elif fourcc == b"VP8X":
            _put(data, 24 + draw(st.sampled_from([0, 3])), "<H", draw(st.sampled_from(EDGE16)))


EDITORS = {"JPEG": edit_jpeg, "PNG": edit_png, "GIF": edit_gif, "BMP": edit_bmp, "TIFF": edit_tiff, "WEBP": edit_webp}

MP4_BOXES = [
    b"ftyp",
    b"moov",
    b"mvhd",
    b"trak",
    b"tkhd",
    b"mdia",
    b"mdhd",
    b"minf",
    b"stbl",
    b"stsd",
    b"stts",
    b"stss",
    b"stsc",
    b"stsz",
    b"stco",
    b"co64",
    b"avcC",
    b"mdat",
    b"hdlr",
    b"ctts",
    b"elst",
]
MKV_IDS = [
    b"\x1a\x45\xdf\xa3",
    b"\x18\x53\x80\x67",
    b"\x16\x54\xae\x6b",
    b"\xae",
    b"\xb0",
    b"\xba",
    b"\x1f\x43\xb6\x75",
    b"\xa3",
    b"\xe7",
    b"\x2a\xd7\xb1",
    b"\x44\x89",
    b"\x63\xa2",
    b"\x1c\x53\xbb\x6b",
]


def edit_container(data: bytearray, draw) -> None:
    """MP4: a box's size, or a field just past a header box's name (version/flags, timescale, duration,
    width/height, entry counts). Matroska: the size byte(s) after an element id, or its first payload bytes."""
    if data[4:8] == b"ftyp":
        hits = [(i, name) for name in MP4_BOXES for i in _find_all(data, name)]
        if not hits:
            return
        i, _ = draw(st.sampled_from(hits))
        if draw(st.booleans()):
            _put(data, i - 4, ">I", draw(st.sampled_from(EDGE32 + [8, 7, 16]) | st.integers(0, (1 << 32) - 1)))
        else:
            _put(
                data,
                i + 4 + 4 * draw(st.integers(0, 6)),
                ">I",
                draw(st.sampled_from(EDGE32) | st.integers(0, (1 << 32) - 1)),
            )
    else:
        hits = [(i, eid) for eid in MKV_IDS for i in _find_all(data, eid)][:400]
        if not hits:
            return
        i, eid = draw(st.sampled_from(hits))
        j = i + len(eid)
        for k in range(draw(st.integers(1, 8))):
            if j + k < len(data):
                data[j + k] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0x81, 0xFF]) | st.integers(0, 255))


def _find_all(data: bytes | bytearray, needle: bytes) -> list[int]:
    out, i = [], data.find(needle)
    while i != -1 and len(out) < 64:
        out.append(i)
        i = data.find(needle, i + 1)
    return out


# ------------------------------------------------------------------------------ generic mutations
@st.composite
def generic_mutation(draw, data: bytearray) -> str:
    n = len(data)
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "duplicate", "delete", "append", "zero_run"]))
    if n == 0:
        data += draw(st.binary(max_size=64))
        return "append"
    if kind == "truncate":
        cut = draw(st.integers(0, n - 1))
        del data[cut:]
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, n - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "overwrite":
        i = draw(st.integers(0, n - 1))
        blob = draw(st.binary(min_size=1, max_size=32))
        data[i : i + len(blob)] = blob
    elif kind == "duplicate":
        i = draw(st.integers(0, n - 1))
        j = draw(st.integers(i, min(n, i + 4096)))
        data[j:j] = data[i:j]
    elif kind == "delete":
        i = draw(st.integers(0, n - 1))
        del data[i : i + draw(st.integers(1, 512))]
    elif kind == "append":
        data += draw(st.binary(min_size=1, max_size=256))
    else:
        i = draw(st.integers(0, n - 1))
        data[i : i + draw(st.integers(1, 256))] = bytes(min(256, n - i))
    return kind


@st.composite
def mutated(draw, corpus: dict[str, tuple[str, bytes]], editor_for=lambda fmt: EDITORS.get(fmt)) -> tuple[str, bytes]:
    """(description, bytes): a corpus file, 0-1 structural edits, 0-3 generic mutations (at least one change)."""
    name = draw(st.sampled_from(sorted(corpus)))
    fmt, original = corpus[name]
    data = bytearray(original)
    steps = []
    edit = editor_for(fmt)
    if edit is not None and draw(st.booleans()):
        edit(data, draw)
        steps.append("header")
    for _ in range(draw(st.integers(0 if steps else 1, 3))):
        steps.append(draw(generic_mutation(data)))
    return f"{name} [{', '.join(steps)}]", bytes(data)
