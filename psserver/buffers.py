"""Reusable receive buffers for pushes.

A fresh buffer of a few MiB costs a page fault per 4 KiB on first touch, which on a loaded
machine made receiving a 64 MiB push slower than the network; a reused one is already mapped.
Both receive paths take from a pool: gRPC pushes (one buffer per part) and bulk lanes (one flat
buffer per push).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import numpy as np

from pswire.dtypes import DType

__all__ = ["SETTLE_BYTES", "USER_MALLOC_SETTINGS", "BufferPool", "settle_heap", "trim_heap"]


class BufferPool:
    """Free buffers by shape and dtype. ``keep``: the most free buffers kept per shape and dtype
    (None: every one given back, so the pool grows to the pushes that were once in flight at
    the same time)."""

    def __init__(self, *, keep: int | None = None) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
        """A contiguous array of ``shape`` and ``dtype`` with undefined contents."""
        with self._lock:
            free = self._free.get((tuple(shape), dtype.numpy))
            if free:
                return free.pop()
        return np.empty(shape, dtype=dtype.numpy)

    def give(self, *arrays: np.ndarray) -> None:
        """Return arrays :meth:`take` handed out; the caller no longer uses them."""
        with self._lock:
            for array in arrays:
                free = self._free.setdefault((array.shape, array.dtype), [])
                if self._keep is None or len(free) < self._keep:
                    free.append(array)


def _glibc():
    """The C library, or None where it is not glibc (then there is nothing to trim or settle)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()

SETTLE_BYTES = 4 << 20
"""The block :func:`settle_heap` maps and frees: glibc then serves blocks below about this size
from the heap, and keeps up to twice this of freed memory at the heap's top."""
USER_MALLOC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""glibc's environment settings of malloc's bounds: where one is set (or ``GLIBC_TUNABLES``
names a ``glibc.malloc`` one), :func:`settle_heap` leaves malloc as the user set it."""


def settle_heap() -> bool:
    """Move glibc's malloc to where it keeps a shard's per-call memory instead of returning it.

    glibc starts a process mapping every block of 128 KiB or more afresh and giving the free
    top of a heap back to the system beyond 128 KiB; it raises the bounds (to a block's size and
    twice that) each time a mapped block larger than the first bound is freed. A shard serving
    table rows allocates and frees temporaries of up to a few hundred KiB per call and may never
    free a mapped block, so every call's memory went back to the system and was faulted in
    again, page by page. One block of ``SETTLE_BYTES`` mapped and freed here moves the bounds as
    that would have, and glibc's adaptation goes on from there (a larger block freed later
    raises them again).
    The shard does it at its first push, once its initial values are in place: an upload made
    with the bounds raised keeps more of its chunks' memory, and a shard's peak with it.
    Returns whether it was done: not without glibc, nor where the environment sets malloc's
    bounds (``USER_MALLOC_SETTINGS``), which turns that adaptation off.
    """
    if _LIBC is None:
        return False
    if any(os.environ.get(name) for name in USER_MALLOC_SETTINGS) or "glibc.malloc." in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    block = _LIBC.malloc(SETTLE_BYTES)
    if not block:
        return False
    _LIBC.free(block)
    return True


def trim_heap() -> None:
    """Give the free memory of the C heap back to the system (glibc's ``malloc_trim``).

    An initial upload streams the whole model through gRPC in chunks; glibc keeps the freed
    chunks in each thread's arena, about 11 MiB on a 256 MiB model, resident for the life of the
    shard. Trimming once the variables are in place returns them. A no-op without glibc.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
