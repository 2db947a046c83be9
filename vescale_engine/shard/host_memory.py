"""Handing the heap's free pages back to the system (glibc's malloc_trim) without paying page
faults every step: `release_free_host_memory`, called once the step's full buffers are free.
"""
from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["release_free_host_memory"]


def _glibc_malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return None


_MALLOC_TRIM = _glibc_malloc_trim()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class _HeapTrimmer:
    """Keeps resident memory from climbing step after step without paying page faults every
    step.

    Full buffers are freed and made again every step. glibc keeps freed pages resident and its
    heap fragments, so resident memory climbs a little every step; handing all free pages back
    after every backward (malloc_trim) stops that, but then each step touches fresh pages
    (page faults: about 6% of a CPU step). So: note the largest resident size over the first
    backwards (warm-up), and trim only once it has grown past that by `GROWTH`."""

    GROWTH = 1.1
    LEARN_CALLS = 4

    def __init__(self):
        self.calls = 0
        self.limit = None

    def __call__(self) -> None:
        if _MALLOC_TRIM is None:
            return
        self.calls += 1
        resident = _resident_bytes()
        if resident is None:  # cannot watch it: trim every time
            _MALLOC_TRIM(0)
        elif self.calls <= self.LEARN_CALLS:
            self.limit = max(self.limit or 0, resident * self.GROWTH)
        elif resident > self.limit:
            _MALLOC_TRIM(0)


release_free_host_memory = _HeapTrimmer()
