"""Shutdown that always ends: each step bounded and named, and a way to see what a process that does not stop
waits for.

- `bounded(step, seconds, what)`: awaits one shutdown step for at most `seconds`; past that it is cancelled and
  named in the log (a process always exits; the log says which step overran).
- `dump_tasks()`: every asyncio task of the running loop with its whole await chain (task -> coroutine it awaits
  -> ... -> the innermost one), on stderr. `stop_on_signals` (common/grpc_server.py) binds it to SIGUSR1.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

log = logging.getLogger("mimo_epd")

# A shutdown step that takes longer than this is abandoned with a warning naming it.
STEP_S = 10.0


async def bounded(step, seconds: float, what: str) -> None:
    """Awaits one shutdown step for at most `seconds`; past that it is cancelled and named in the log."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(step, seconds)
    except TimeoutError:
        log.warning("shutdown: %s took over %gs; abandoned", what, seconds)
    except Exception as err:  # noqa: BLE001 - one step failing does not keep the others from running
        log.warning("shutdown: %s failed: %s", what, err)
    else:
        if time.monotonic() - t0 > 2:
            log.info("shutdown: %s took %.1fs", what, time.monotonic() - t0)


def await_chain(task: asyncio.Task) -> str:
    """`outer (file:line) <- inner (file:line) <- ...`: the coroutines a task is suspended in, outermost first.
    (`Task.get_stack()` gives only the outermost frame of a suspended coroutine.)"""
    out: list[str] = []
    coro: Any = task.get_coro()
    seen = 0
    while coro is not None and seen < 64:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:  # a future or a C-level awaitable: the chain ends at the coroutine awaiting it
            break
        out.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
        seen += 1
    return " -> ".join(out) or repr(task.get_coro())


def dump_tasks() -> None:
    """Every task of the running loop with the chain of coroutines it is suspended in, on stderr."""
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} asyncio tasks (SIGUSR1) ---", file=sys.stderr)
    for task in tasks:
        print(f"{task.get_name()}: {await_chain(task)}", file=sys.stderr)
    sys.stderr.flush()
