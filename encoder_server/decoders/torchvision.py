"""The `torchvision` backend: torchvision's `decode_jpeg` (libjpeg on the CPU, nvJPEG with a CUDA device).

JPEG only, and only for a full decode (JPEG draft decode goes through PIL, which has it); every other
image, and any JPEG torchvision refuses (CMYK...), is decoded by the `pil` backend. libjpeg's truncation
warnings are checked first (jpeg_check), as torchvision decodes a truncated file with grey rows."""

from __future__ import annotations

from .base import Decoded, DecodeRequest, Stage
from .jpeg_check import check_jpeg_data


def decode_jpeg_tensor(data: bytes, device="cpu"):
    """JPEG bytes -> HxWx3 uint8 tensor (a view) on `device`, EXIF orientation applied."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(
        torch.frombuffer(bytearray(data), dtype=torch.uint8),
        mode=ImageReadMode.RGB,
        apply_exif_orientation=True,
        device=device,
    ).permute(1, 2, 0)


class TorchvisionDecoder:
    name = "torchvision"

    def decode(self, data: bytes, request: DecodeRequest) -> Decoded:
        p = request.probe
        if p.complete_jpeg and request.draft_size is None:
            check_jpeg_data(data)
            pixels = None
            try:
                if request.device is None:  # in a decode process: one thread, the pool is the parallelism
                    import torch

                    torch.set_num_threads(1)
                    pixels = decode_jpeg_tensor(data).contiguous().numpy()
                else:  # the GPU decode path: the tensor stays on the device for the resize there
                    pixels = decode_jpeg_tensor(data, request.device)
            except Exception:  # noqa: BLE001 - CMYK and other JPEGs it refuses: PIL decodes them or words the error
                pixels = None
            if pixels is not None and pixels.ndim == 3 and pixels.shape[2] == 3:
                return Decoded(pixels, p.oriented_size, 1, Stage.DECODED)
        from . import get_decoder

        return get_decoder("pil").decode(data, request)
