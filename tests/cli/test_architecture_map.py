"""docs/architecture.md names every module of the product (like the CLI docs test: a new module without a line in
the map fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mimo_epd", "llm_backend", "encoder_server", "shm_cache", "loadtest")


def _modules() -> list[Path]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT)
            if p.name == "__init__.py" or rel.parts[:2] == ("mimo_epd", "v1"):
                continue  # packages are named by their folder; v1/ holds generated stubs
            out.append(rel)
    return out


def _named(doc: str, rel: Path) -> bool:
    """Named by its path, by folder/file, or by its file name or stem in backticks."""
    if str(rel) in doc or f"{rel.parent.name}/{rel.name}" in doc:
        return True
    return re.search(rf"`{re.escape(rel.name)}`|`{re.escape(rel.stem)}`|[ (`/]{re.escape(rel.name)}\b", doc) is not None


def test_every_module_is_on_the_map():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(m) for m in _modules() if not _named(doc, m)]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_the_map_names_no_module_that_is_gone():
    """Paths written out in full (llm_backend/..., mimo_epd/...) must exist."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:llm_backend|mimo_epd|encoder_server|shm_cache)/[\w/]+\.py)`", doc))
    gone = sorted(p for p in paths if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md names modules that do not exist: {', '.join(gone)}"
