"""Keeping freed tensor memory in the process while a build verifies large subgraphs.

Verifying a decode-attention bucket evaluates both graphs over K/V-sized tensors, tile by
tile: every loop iteration allocates and frees temporaries of tens to hundreds of MiB. glibc
serves each allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
returns it with ``munmap`` on free, so every iteration faults its temporaries in anew from
zeroed pages. On virtual machines that hand freed guest memory back to the host, a fault costs
tens of microseconds: measured on a 2-core VM, verifying attention at batch 16 and KV 4096 made
4.6 million page faults and spent more time in the kernel than computing.

:func:`retained_heap` makes glibc serve large blocks from its heap instead, where freed memory
is reused by the next allocation of the same size, and gives the heap's free memory back to the
system (``malloc_trim``) when the block of work ends, so memory checks between work items see
what is really available. Elsewhere (macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX = 65536  # glibc's default number of mmapped chunks
DEFAULT_TRIM_THRESHOLD = 128 * 1024
RETAINED_TRIM_THRESHOLD = 1 << 62

_lock = threading.Lock()
_depth = 0


@lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (has mallopt and malloc_trim), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def supported() -> bool:
    """Whether :func:`retained_heap` changes anything here (the C library is glibc)."""
    return _glibc() is not None


def _set(mmap_max: int, trim_threshold: int) -> bool:
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_MAX, mmap_max) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)) == 1 and ok
    if not ok:
        log.debug("mallopt refused the heap settings; large allocations stay mmapped")
    return ok


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def trim() -> None:
    """Return the heap's free memory to the system (glibc ``malloc_trim``); a no-op elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextmanager
def retained_heap() -> Iterator[None]:
    """Within the block, large allocations come from the heap and freed memory stays there for
    reuse; on leaving the outermost block, defaults are restored and the free heap is trimmed.
    Nesting and threads are safe; a no-op where the C library is not glibc."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            _set(0, RETAINED_TRIM_THRESHOLD)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _set(DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
                trim()
