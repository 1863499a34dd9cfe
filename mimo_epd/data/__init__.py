"""Data files shipped with the package (read-only, found through this module, never through a path outside it).

| name | what | licence |
|---|---|---|
| `MOONCAKE_TRACE` | the conversation trace published with Mooncake (FAST'25), xz-compressed JSONL | Apache-2.0 |
| `TINY_MODEL` | the default model `tiny`: a checkpoint directory trained by `mimo-epd train-tiny` (docs/model.md) | Apache-2.0 (the project's); trained on the Python documentation, PSF-2.0 |

`open_text(path)` opens a trace as text whether it is plain, `.xz` or `.gz`, so a user's own trace in any of the
three forms works wherever the shipped one does.
"""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path
from typing import IO

DATA_DIR = Path(__file__).resolve().parent
MOONCAKE_TRACE = str(DATA_DIR / "traces" / "mooncake_conversation.jsonl.xz")
TINY_MODEL = str(DATA_DIR / "models" / "tiny")


def open_text(path: str | Path) -> IO[str]:
    p = Path(path)
    if p.suffix == ".xz":
        return lzma.open(p, "rt", encoding="utf-8")
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8")
    return p.open(encoding="utf-8")
