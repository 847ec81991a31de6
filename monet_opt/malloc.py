"""Steady CPU allocation for timing: keep freed memory in the process (glibc only).

On CPU, torch allocates tensors with the C library's malloc. glibc hands blocks above its mmap
threshold (which it adapts, up to 32 MiB) straight back to the kernel on free, and trims the top
of its heap once more than twice that is free: the next step's tensors then land in fresh pages,
and the kernel zeroes each page on first touch. On ResNet-50 b8 224 that is ~107k page faults per
training step, in plain PyTorch and in a wrapped model alike, costing 0.1-0.3 s of a 1.5 s step
and varying from step to step (session 19: system time per plain step 0.003-0.27 s). A GPU has
no such cost: torch's caching allocator keeps freed blocks.

`keep_freed_memory()` fixes both thresholds (mmap threshold at glibc's maximum, 32 MiB; trimming
off), so that freed blocks stay in the heap and are reused: no page faults after the first
step, and steadier step times. The price is that the process keeps its high-water mark of heap
memory. It changes neither what torch allocates nor what `monet_opt.measure_peak` counts, only
where the C library takes the pages from; apply it to the whole benchmarking process, so that
every method compared runs with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc rejects larger (HEAP_MAX_SIZE / 2 on 64-bit)
NO_TRIM = 2**31 - 1  # mallopt takes an int: trim only above 2 GiB free

_applied = False


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # glibc only (musl has no mallopt thresholds)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks (see the module doc). True if applied; False where the C
    library is not glibc (nothing changes there)."""
    libc = _libc()
    if libc is None:
        return False
    global _applied
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM) == 1 and ok
    _applied = _applied or ok
    return ok


def freed_memory_kept() -> bool:
    """Whether `keep_freed_memory()` has been applied in this process (calibrations record it:
    times measured with and without it differ by the page faults, see the module doc)."""
    return _applied


def page_faults() -> int:
    """Minor page faults of this process so far (getrusage): a step's count is the difference."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
