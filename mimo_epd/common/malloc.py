"""glibc malloc settings for processes that allocate and free the same large buffers over and over.

glibc serves an allocation over its mmap threshold with a fresh mmap and unmaps it on free, and it returns
the top of the heap to the kernel once more than the trim threshold is free there; both thresholds start
small (128 KB) and only adapt slowly. A decode process allocates a decoded image (up to ~8 MB), a resized
copy and its patches per item, so with the defaults every item maps fresh pages and faults each one in
(about 1,300 page faults per image on the benchmark's mix, 14 % of the process's CPU time).
`keep_freed_memory` raises both thresholds: freed buffers stay in the heap and the next item reuses them.
What a process keeps is bounded by its peak working set plus the trim threshold. No-op off glibc."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's own ceiling for its adaptive threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def keep_freed_memory(trim_threshold: int = 64 << 20, mmap_threshold: int = MMAP_THRESHOLD_MAX) -> bool:
    """Allocations up to `mmap_threshold` come from the heap, and up to `trim_threshold` bytes free at its top
    are kept. Returns whether glibc took both settings."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library: no library search (no subprocess)
    except (OSError, AttributeError):
        return False  # no mallopt (musl, macOS): nothing to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
    if not ok:
        log.debug("mallopt refused the thresholds (mmap %d, trim %d)", mmap_threshold, trim_threshold)
    return ok
