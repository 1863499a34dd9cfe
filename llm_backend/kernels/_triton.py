"""Triton, when this torch build has it (CUDA builds on Linux ship it; CPU-only builds do not).

Kernel modules import `triton`, `tl` and `jit` from here, so that without Triton they still import and
their torch twins still serve; `triton_enabled` is then False and nothing calls a kernel.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported build has it
    triton = tl = None


def jit(fn):
    return triton.jit(fn) if triton is not None else fn
