"""The `dali` backend (NVIDIA DALI, the `dali` extra): a CPU pipeline in a decode process, and the `mixed`
(nvJPEG) device when the server runs on CUDA. One pipeline per process, built on first use. JPEG only, full
decode only; other formats, CMYK and any image DALI refuses go to the `pil` backend. libjpeg's truncation
warnings are checked first (jpeg_check): DALI decodes a truncated file with grey rows."""

from __future__ import annotations

import numpy as np

from .base import Decoded, DecodeRequest, Stage
from .jpeg_check import check_jpeg_data

_PIPES: dict = {}  # "cpu" / "mixed" -> a built pipeline (one per process, used by one thread at a time)


def check_available() -> None:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        raise ValueError("--decoder dali needs NVIDIA DALI: pip install 'mimo-epd[dali]'") from None


def _pipeline(device: str):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=0 if device == "mixed" else None, prefetch_queue_depth=1)
    def pipe():
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(encoded, device=device, output_type=types.RGB)

    p = pipe()
    p.build()
    return p


def _run(data: bytes, device: str):
    pipe = _PIPES.get(device)
    if pipe is None:
        pipe = _PIPES[device] = _pipeline(device)
    pipe.feed_input("encoded", [np.frombuffer(data, np.uint8)])
    (out,) = pipe.run()
    return out


def decode_jpeg_dali(data: bytes) -> np.ndarray:
    """JPEG bytes -> HxWx3 uint8 RGB on the CPU (EXIF orientation applied by DALI's decoder)."""
    return np.array(_run(data, "cpu").as_array()[0])


def decode_jpeg_dali_tensor(data: bytes, device):
    """JPEG bytes -> HxWx3 uint8 RGB torch tensor on `device`: the `mixed` pipeline (nvJPEG) on CUDA, whose
    output is copied device to device into the tensor; the CPU pipeline otherwise."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(decode_jpeg_dali(data))
    from nvidia.dali.plugin.pytorch import feed_ndarray

    image = _run(data, "mixed")[0]
    out = torch.empty(tuple(image.shape()), dtype=torch.uint8, device=device)
    feed_ndarray(image, out, cuda_stream=torch.cuda.current_stream(device))
    return out


class DaliDecoder:
    name = "dali"

    def decode(self, data: bytes, request: DecodeRequest) -> Decoded:
        p = request.probe
        if p.complete_jpeg and request.draft_size is None:
            check_jpeg_data(data)
            try:
                pixels = (
                    decode_jpeg_dali(data) if request.device is None else decode_jpeg_dali_tensor(data, request.device)
                )
            except Exception:  # noqa: BLE001 - CMYK, progressive oddities...: PIL knows them and words its errors
                pixels = None
            if pixels is not None and pixels.ndim == 3 and pixels.shape[2] == 3:
                return Decoded(pixels, p.oriented_size, 1, Stage.DECODED)
        from . import get_decoder

        return get_decoder("pil").decode(data, request)
