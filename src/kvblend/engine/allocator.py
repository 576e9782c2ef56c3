"""Keep freed CPU memory in the process instead of handing it back to the OS.

Every request allocates and frees ~100-250 MB of tensors (the prompt's KV cache, per-layer
activations). glibc's malloc returns such blocks to the kernel on free (mmap for large
blocks, heap trimming for the rest), so the next request takes a page fault on every
4 KiB it touches again. Measured on SmolLM2 (blend after full/reuse requests, 3169-token
prompt, 2-core CPU): ~55k minor faults and 0.13-0.26 s of system time per blend request;
with the settings below, none, and the median request 6 % faster.

The cost is resident memory: the process keeps its high-water mark, as a serving process
with a steady working set should. Set ``KVBLEND_MALLOC_TUNING=0`` to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling: blocks above it are still mmap'ed
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only past 2 GiB of free heap top

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tell glibc to serve blocks up to 32 MiB from the heap and (almost) never trim it.

    Process-wide and idempotent. Returns whether the settings are in force (False off
    Linux/glibc or when ``KVBLEND_MALLOC_TUNING=0``)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("KVBLEND_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
