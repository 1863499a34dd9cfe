"""`keep_freed_memory`: glibc takes the thresholds, and with them the buffers a decode process allocates and frees
per item come from the heap instead of fresh pages."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from mimo_epd.common.malloc import keep_freed_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

ALLOCATE = """
import resource, sys
import numpy as np
from mimo_epd.common.malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
sizes = [1 << 20, 6 << 20, 24 << 20]  # a small image's, a 1080p one's and a 4K one's decoded pixels
def item(n):  # what a decode process allocates per image
    decoded = np.ones(n, np.uint8)
    resized = np.ones(n // 2, np.uint8)
    del decoded
    patches = np.ones(n // 2, np.uint8)
    return int(resized[0]) + int(patches[0])
for n in sizes:  # warm: the heap grows to the working set once
    item(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(30):
    item(sizes[i % 3])
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ALLOCATE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@glibc
def test_glibc_takes_the_thresholds():
    assert keep_freed_memory() is True


@glibc
def test_items_of_mixed_sizes_fault_no_fresh_pages_once_the_heap_holds_them():
    """Thirty items of three sizes, after one of each: glibc's adaptive thresholds still map or trim some of
    them (about a thousand faults here); with the thresholds raised, none."""
    assert faults("default") >= 500
    assert faults("keep") <= 50
