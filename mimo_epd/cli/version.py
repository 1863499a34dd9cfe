"""`mimo-epd version`: versions of the stack and which PIL build is really loaded."""
from __future__ import annotations

import hashlib
import os

from .. import __version__


def loaded_pil_distribution() -> tuple[str, str]:
    """(distribution, version) of the PIL package this interpreter actually imports.

    Package metadata alone can lie: pillow and pillow-simd both install the `PIL` package, so
    installing pillow after pillow-simd (e.g. `pip install` of anything that depends on pillow)
    overwrites pillow-simd's files while its metadata stays installed. So we ask which installed
    distribution's RECORD lists the very `PIL/_version.py` that was imported *with the same hash* as the
    file on disk; the version PIL itself reports breaks ties when a RECORD has no hashes."""
    import base64
    from importlib import metadata

    import PIL

    loaded = os.path.join(os.path.dirname(os.path.realpath(PIL.__file__)), "_version.py")
    try:
        with open(loaded, "rb") as f:
            digest = base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
    except OSError:
        digest = None
    owners: list[tuple[str, str, bool]] = []
    for name in metadata.packages_distributions().get("PIL", []):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for f in dist.files or []:
            if str(f).replace("\\", "/") == "PIL/_version.py" and os.path.realpath(dist.locate_file(f)) == loaded:
                same_hash = f.hash is not None and f.hash.mode == "sha256" and f.hash.value == digest
                owners.append((dist.metadata["Name"], dist.version, same_hash))
    for name, version, same_hash in owners:
        if same_hash:
            return name.lower(), PIL.__version__
    for name, version, _ in owners:
        if version == PIL.__version__:
            return name.lower(), PIL.__version__
    return ("pillow-simd" if "post" in PIL.__version__ else "pillow"), PIL.__version__


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
