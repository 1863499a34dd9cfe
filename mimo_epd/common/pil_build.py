"""Which PIL build this interpreter really loads (pillow or pillow-simd), from the imported files, not metadata.

Used by `mimo-epd version`; the encoder's `--resize-backend auto` can use it too (encoder_server may import
mimo_epd.common)."""

from __future__ import annotations

import base64
import hashlib
import os


def loaded_pil_distribution() -> tuple[str, str]:
    """(distribution, version) of the PIL package this interpreter actually imports.

    Package metadata alone can lie: pillow and pillow-simd both install the `PIL` package, so
    installing pillow after pillow-simd (e.g. `pip install` of anything that depends on pillow)
    overwrites pillow-simd's files while its metadata stays installed. So we ask which installed
    distribution's RECORD lists the very `PIL/_version.py` that was imported *with the same hash* as the
    file on disk; the version PIL itself reports breaks ties when a RECORD has no hashes."""
    from importlib import metadata

    import PIL

    loaded = os.path.join(os.path.dirname(os.path.realpath(PIL.__file__)), "_version.py")
    try:
        with open(loaded, "rb") as fh:
            digest = base64.urlsafe_b64encode(hashlib.sha256(fh.read()).digest()).rstrip(b"=").decode()
    except OSError:
        digest = None
    owners: list[tuple[str, str, bool]] = []
    for name in metadata.packages_distributions().get("PIL", []):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for f in dist.files or []:
            if str(f).replace("\\", "/") == "PIL/_version.py" and os.path.realpath(str(dist.locate_file(f))) == loaded:
                same_hash = f.hash is not None and f.hash.mode == "sha256" and f.hash.value == digest
                owners.append((dist.metadata["Name"], dist.version, same_hash))
    for name, _version, same_hash in owners:
        if same_hash:
            return name.lower(), PIL.__version__
    for name, version, _ in owners:
        if version == PIL.__version__:
            return name.lower(), PIL.__version__
    return ("pillow-simd" if "post" in PIL.__version__ else "pillow"), PIL.__version__
