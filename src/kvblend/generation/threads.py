"""One thread's torch ops without intra-op parallelism, for the small per-token work.

torch splits an elementwise op or reduction over more than 32,768 elements across its
OpenMP team. On a thread other than the one that made the team (the server's worker) each
such op wakes sleeping threads first: on a 2-core host ``isfinite(logits).all()`` over a
49k vocabulary took 380 µs there against 67 µs on the main thread and ~15 µs serially,
and sampling runs a handful of such ops per token per stream. ``serial_ops`` turns the
calling thread's OpenMP team size to 1 for a block (OpenMP's thread count is a per-thread
setting, so other threads — a prefill on another — keep theirs) and restores it after.
Where torch has no OpenMP runtime loaded, it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

_RUNTIMES = ("libgomp.so.1", "libomp.so", "libiomp5.so", "libomp.dylib", "libiomp5.dylib")


@cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch already loaded (never a new one) and uses, or None: a
    runtime found by name counts only once setting its team size is seen by torch."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return None
    for name in _RUNTIMES:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        lib.omp_get_max_threads.restype = ctypes.c_int
        lib.omp_set_num_threads.argtypes = (ctypes.c_int,)
        if _drives_torch(lib):
            return lib
    return None


def _drives_torch(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s per-thread team size is torch's (not another copy of OpenMP)."""
    torch.get_num_threads()  # torch's per-thread setup first
    before = lib.omp_get_max_threads()
    probe = 1 if before != 1 else 2
    lib.omp_set_num_threads(probe)
    try:
        return torch.get_num_threads() == probe
    finally:
        lib.omp_set_num_threads(before)


@contextmanager
def serial_ops() -> Iterator[None]:
    """Run the block's torch CPU ops on the calling thread alone."""
    lib = _openmp()
    if lib is None:
        yield
        return
    torch.get_num_threads()  # torch sets a thread's team size on its first parallel op: have it done before ours
    before = lib.omp_get_max_threads()
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)
