"""Writes docs/cli.md from the CLI's parsers (`make docs`); `--check` exits 1 when the file is stale."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mimo_epd.cli import build_parser  # noqa: E402
from mimo_epd.cli.docs import render  # noqa: E402

if __name__ == "__main__":
    target = ROOT / "docs" / "cli.md"
    text = render(build_parser())
    if "--check" in sys.argv[1:]:
        current = target.read_text() if target.exists() else ""
        if current != text:
            sys.exit(f"{target} is stale: run `make docs`")
        sys.exit(0)
    target.write_text(text)
    print(f"wrote {target}", file=sys.stderr)
