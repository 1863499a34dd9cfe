"""NVIDIA DALI image decoding (`--decoder dali`, the `dali` extra): a CPU pipeline here, and the `mixed`
(nvJPEG) device when the server runs on CUDA. One pipeline per decode process, built on first use.
JPEG only; other formats, CMYK and any image DALI refuses go through PIL."""
from __future__ import annotations

import numpy as np

_PIPE = None


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


def decode_jpeg_dali(data: bytes, device: str = "cpu") -> np.ndarray:
    """JPEG bytes -> HxWx3 uint8 RGB (EXIF orientation applied by DALI's decoder)."""
    global _PIPE
    if _PIPE is None:
        _PIPE = _pipeline(device)
    _PIPE.feed_input("encoded", [np.frombuffer(data, np.uint8)])
    (out,) = _PIPE.run()
    if device == "mixed":
        out = out.as_cpu()
    return np.array(out.as_array()[0])
