"""One image through a decode process: probe the header once, choose the draft scale, decode with the
configured backend, and optionally resize (PIL / pillow-simd) and cut it into uint8 patches right there, so
on a CPU deployment every heavy pixel operation runs in the decode processes (`--resize-in decoder`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DecodeError
from ..preprocess import PreprocessConfig, target_size
from . import get_decoder
from .base import Decoded, DecodeRequest, Stage
from .draft import draft_size
from .probe import probe


@dataclass(frozen=True)
class DecodeOptions:
    max_pixels: int
    decoder: str = "turbo"
    jpeg_draft: bool = True
    resize: bool = False  # resize to the smart_resize target in the worker...
    patchify: bool = False  # ...and cut it into uint8 still-image patches there (preprocess.patchify_uint8)
    preprocess: PreprocessConfig | None = None
    device: str = "cpu"  # the server's --device: with cuda, `torchvision` and `dali` decode there (nvJPEG)


def decodes_on_device(opts: DecodeOptions) -> bool:
    """GPU decoders on a CUDA server decode in the server process and leave the pixels on the GPU."""
    return opts.decoder in ("torchvision", "dali") and opts.device.startswith("cuda")


def decode_item(data: bytes, opts: DecodeOptions) -> Decoded:
    """Bytes -> `Decoded` (stage DECODED, RESIZED or PATCHES per `opts`). Raises DecodeError."""
    p = probe(data, opts.max_pixels)
    resize = opts.resize and opts.preprocess is not None
    draft = draft_size(p, opts.preprocess) if opts.jpeg_draft else None
    d = get_decoder(opts.decoder).decode(data, DecodeRequest(p, draft, rgbx=resize))
    if not resize:
        return d
    from ..preprocess import patchify_uint8, resize_pil_hwc

    try:
        th, tw = target_size(d.source_size[0], d.source_size[1], opts.preprocess)
    except ValueError as e:
        raise DecodeError(str(e), "size") from None
    pixels = resize_pil_hwc(d.pixels, (th, tw)) if (th, tw) != d.pixels.shape[:2] else d.pixels[..., :3]
    d.pixels, d.stage = pixels, Stage.RESIZED
    if opts.patchify:
        d.pixels, d.stage = patchify_uint8(pixels, opts.preprocess), Stage.PATCHES
    return d


def decode_on_device(data: bytes, opts: DecodeOptions) -> Decoded:
    """`--decoder torchvision|dali` with `--device cuda`: the JPEG is decoded on the GPU (nvJPEG through
    torchvision's `decode_jpeg`, or DALI's `mixed` decoder) into an HxWx3 uint8 tensor that stays there for
    the device-side resize: no pixels cross PCIe, and no draft decode is needed. Other formats and JPEGs the
    GPU decoder refuses (CMYK...) are decoded by PIL on the CPU. Also runs with a CPU `opts.device` (the same
    code on the CPU decoders), which is how it is tested without a GPU."""
    p = probe(data, opts.max_pixels)
    return get_decoder(opts.decoder).decode(data, DecodeRequest(p, None, device=opts.device))
