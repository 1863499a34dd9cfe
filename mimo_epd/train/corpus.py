"""The training corpus: Debian's `python3.11-doc` (the Python 3.11 documentation, PSF licence) as plain text.

`extract(root)` walks the HTML pages under `root` (default /usr/share/doc/python3.11/html) in sorted order and
turns each page's main body into a `Page`: its title and its sections, each a heading and its blocks of text.
The parser is the standard library's `html.parser`, so the same files always give the same text:
- a heading (h1-h6) opens a section; its permalink mark is dropped;
- paragraphs, list items, definition terms and descriptions, table rows and admonitions are one block each, with
  whitespace collapsed; a table row's cells are joined by " | ";
- `<pre>` (code and interactive examples) keeps its lines exactly;
- navigation, the index, search and changelog pages are skipped (`SKIP`), and so is everything outside the body.

`split(pages)` puts a page in the held-out set when the CRC-32 of its path falls in the last `heldout_per_mille`
of 1000, so the split depends on the page alone, never on the order or the machine.

The corpus is never shipped and never read at run time: only `mimo-epd train-tiny` reads it. The packages and
their licences are in docs/model.md.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

DEFAULT_ROOT = "/usr/share/doc/python3.11/html"
DEBIAN_PACKAGE = "python3.11-doc"
LICENCE = "PSF-2.0 (Python Software Foundation License Version 2), as stated in the package's copyright file"

SKIP = re.compile(r"^(genindex|py-modindex|search|contents|download|copyright|bugs|about|index|license)|^_")
_BLOCK = {"p", "li", "dt", "dd", "tr", "caption", "blockquote", "div", "figcaption", "td", "th"}
_HEADING = {"h1", "h2", "h3", "h4", "h5", "h6"}
_SPACE = re.compile(r"\s+")


@dataclass
class Section:
    heading: str
    blocks: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n\n".join(self.blocks)


@dataclass
class Page:
    path: str  # relative to the root, without ".html": "library/json"
    title: str
    sections: list[Section]


class _BodyParser(HTMLParser):
    """Collects the blocks of `<div class="body">`; see the module docstring for the rules."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0  # open elements inside the body div (0 = outside)
        self.sections: list[Section] = [Section("")]
        self.buf: list[str] = []
        self.in_pre = 0
        self.in_heading = False
        self.skip = 0  # inside a headerlink, script or style
        self.cells: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.depth == 0:
            if tag == "div" and a.get("class") == "body" and a.get("role") == "main":
                self.depth = 1
            return
        if tag not in ("br", "hr", "img", "meta", "input", "col", "wbr", "link"):
            self.depth += 1
        if self.skip:
            if tag not in ("br", "hr", "img", "meta", "input", "col", "wbr", "link"):
                self.skip += 1
            return
        if tag in ("script", "style") or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip = 1
            return
        if tag == "pre":
            self._flush()
            self.in_pre += 1
        elif tag in _HEADING:
            self._flush()
            self.in_heading = True
        elif tag == "tr":
            self._flush()
            self.cells = []
        elif tag in ("td", "th") and self.cells is not None:
            self._cell()
        elif tag in _BLOCK:
            self._flush()
        elif tag == "br":
            self.buf.append("\n" if self.in_pre else " ")

    def handle_endtag(self, tag):
        if self.depth == 0:
            return
        self.depth -= 1
        if self.skip:
            self.skip -= 1
            return
        if tag == "pre":
            self._flush()
            self.in_pre -= 1
        elif tag in _HEADING:
            title = _SPACE.sub(" ", "".join(self.buf)).strip()
            self.buf = []
            self.in_heading = False
            self.sections.append(Section(title))
        elif tag == "tr" and self.cells is not None:
            self._cell()
            row = " | ".join(c for c in self.cells if c)
            self.cells = None
            if row:
                self.sections[-1].blocks.append(row)
        elif tag in ("td", "th") and self.cells is not None:
            self._cell()
        elif tag in _BLOCK and self.cells is None:
            self._flush()

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.buf.append(data)

    def _cell(self):
        if self.cells is not None:
            self.cells.append(_SPACE.sub(" ", "".join(self.buf)).strip())
            self.buf = []

    def _flush(self):
        if self.cells is not None or self.in_heading:
            return
        raw = "".join(self.buf)
        self.buf = []
        if self.in_pre:
            text = raw.strip("\n").rstrip()
        else:
            text = _SPACE.sub(" ", raw).strip()
        if text:
            self.sections[-1].blocks.append(text)


def parse_page(html: str, path: str) -> Page:
    p = _BodyParser()
    p.feed(html)
    p.close()
    p._flush()
    sections = [s for s in p.sections if s.blocks]
    title = next((s.heading for s in p.sections if s.heading), path)
    return Page(path, title, sections)


def extract(root: str | Path = DEFAULT_ROOT) -> list[Page]:
    """Every page of the documentation under `root`, in sorted path order."""
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(
            f"{base}: no documentation here; install the Debian package {DEBIAN_PACKAGE} "
            "(scripts/train_tiny.sh does) or pass --corpus-root"
        )
    pages = []
    for f in sorted(base.rglob("*.html")):
        rel = f.relative_to(base).with_suffix("").as_posix()
        if SKIP.search(rel.split("/")[-1]) or rel.startswith("_"):
            continue
        page = parse_page(f.read_text(encoding="utf-8", errors="replace"), rel)
        if page.sections:
            pages.append(page)
    return pages


def is_heldout(path: str, heldout_per_mille: int) -> bool:
    return zlib.crc32(path.encode()) % 1000 >= 1000 - heldout_per_mille


def split(pages: list[Page], heldout_per_mille: int = 30) -> tuple[list[Page], list[Page]]:
    train = [p for p in pages if not is_heldout(p.path, heldout_per_mille)]
    held = [p for p in pages if is_heldout(p.path, heldout_per_mille)]
    return train, held
