"""`mimo-epd version`: versions of the stack and which PIL build is really loaded."""

from __future__ import annotations

from .. import __version__
from ..common.pil_build import loaded_pil_distribution


def pil_line() -> str:
    try:
        dist, version = loaded_pil_distribution()
    except ImportError:  # pragma: no cover - pillow is a dependency
        return "none"
    if dist == "pillow-simd":
        return f"pillow-simd {version}"
    return f"pillow {version} (pillow-simd not active: resizes on the CPU are slower)"


def run(args) -> int:
    import platform

    import torch

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    info = {
        "mimo-epd": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_v,
        "cuda_available": torch.cuda.is_available(),
        "pil": pil_line(),
    }
    for k, v in info.items():
        print(f"{k}: {v}")
    return 0


def register(commands) -> None:
    commands.command("version", "print versions and which PIL build is really loaded", run=run)
