"""Image decoding: bytes -> HxWx3 uint8 RGB pixels (stage 2 of the pipeline).

One protocol (`base.Decoder`: `decode(data, request) -> Decoded`) and one backend per module: `turbo`
(libjpeg-turbo straight into numpy), `pil` (PIL / pillow-simd, every format), `torchvision` (decode_jpeg,
nvJPEG on CUDA) and `dali` (NVIDIA DALI). Around them: `probe` opens each image's header once (format,
size, EXIF orientation, pixel limits) and the result travels with the request; `draft` is the JPEG
reduced-DCT-scale policy; `jpeg_check` refuses JPEGs libjpeg would pad with grey; `job` runs one item
(probe, draft, decode, optional resize/patchify) as a decode process does. Transport (shared-memory slots)
and the decode processes' lifecycle are `encoder_server.decode_pool`.

This module stays light (no PIL, numpy or torch import): `config.py` validates `--decoder` against it.
"""

from __future__ import annotations

import importlib

# The one list of decoder names (`--decoder`): name -> "module:class" in this package, imported on first use.
REGISTRY = {
    "turbo": "turbo:TurboDecoder",
    "pil": "pil:PilDecoder",
    "torchvision": "torchvision:TorchvisionDecoder",
    "dali": "dali:DaliDecoder",
}
DECODERS = tuple(REGISTRY)
_INSTANCES: dict = {}


def check_decoder_name(name: str) -> None:
    if name not in REGISTRY:
        raise ValueError(f"--decoder must be one of {', '.join(DECODERS)}, got {name!r}")


def get_decoder(name: str):
    """The backend for `name` (one instance per process; backends keep per-process state such as DALI's pipelines)."""
    check_decoder_name(name)
    dec = _INSTANCES.get(name)
    if dec is None:
        module, cls = REGISTRY[name].split(":")
        dec = _INSTANCES[name] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return dec


def decode_image(
    data: bytes, max_pixels: int, draft_size: tuple[int, int] | None = None, turbo: bool = False, rgbx: bool = False
):
    """Decodes one image to HxWx3 uint8 with the `turbo` (fast JPEG path) or `pil` backend. `draft_size` (w, h),
    when set, lets a JPEG decode at a reduced DCT scale no smaller than that size; with `rgbx` the turbo path
    returns HxWx4 (RGB + padding) for a caller that resizes with PIL next. Raises DecodeError."""
    from .base import DecodeRequest
    from .probe import probe

    p = probe(data, max_pixels)
    return get_decoder("turbo" if turbo else "pil").decode(data, DecodeRequest(p, draft_size, rgbx)).pixels
