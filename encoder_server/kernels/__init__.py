"""Triton kernels of the encoder. Each has a torch reference (in `encoder_server.preprocess`) and a test
that runs it on the CPU under TRITON_INTERPRET=1; on CUDA the server uses the kernel."""

from .band_attention import band_attention_triton
from .patchify import patchify_triton

__all__ = ["band_attention_triton", "patchify_triton"]
