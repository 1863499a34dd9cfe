"""What every command shares: logging and messages on stderr, results on stdout, one progress bar style.

The rule for every command: stdout carries only the result (JSON lines, generated text, `ready host:port`),
so `mimo-epd encode-video x.mp4 | jq` works; progress bars, notices, logs and errors go to stderr.
"""

from __future__ import annotations

import logging
import sys
import time


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def error(message: str, status: int = 2) -> int:
    """Prints `error: message` on stderr and returns `status` (2: bad usage or input, 1: the operation failed)."""
    print(f"error: {message}", file=sys.stderr)
    return status


def one_line(e: BaseException) -> str:
    """An exception as one line (torch's load errors span several): its first line, and how many more there were."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
    return lines[0] + (f" (and {len(lines) - 1} more lines like it)" if len(lines) > 1 else "")


def notice(message: str) -> None:
    print(f"notice: {message}", file=sys.stderr)


class FrameProgress:
    """Rich progress bars on stderr with a count, a rate and an ETA; one task per named counter.

        with FrameProgress(["decoded", "encoded"], unit="frames", disable=args.no_progress) as bar:
            bar.update(decoded=10, encoded=4, total=100)

    Rich draws on stderr (never stdout) and ends its last line with a newline. When stderr is not a
    terminal, rich prints the final state once instead of redrawing."""

    def __init__(self, names: list[str], unit: str = "frames", disable: bool = False):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.unit = unit
        self._progress = Progress(
            TextColumn("{task.description:>8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
            disable=disable,
        )
        self._tasks = {n: self._progress.add_task(n, total=None, rate="") for n in names}
        self._start = time.perf_counter()

    def __enter__(self) -> "FrameProgress":
        self._progress.__enter__()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, total: int | None = None, **counts: int) -> None:
        elapsed = max(time.perf_counter() - self._start, 1e-6)
        for name, done in counts.items():
            self._progress.update(
                self._tasks[name], completed=done, total=total, rate=f"{done / elapsed:7.1f} {self.unit}/s"
            )
