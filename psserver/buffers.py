"""Reusable receive buffers for pushes.

A fresh buffer of a few MiB costs a page fault per 4 KiB on first touch, which on a loaded
machine made receiving a 64 MiB push slower than the network; a reused one is already mapped.
Both receive paths take from a pool: gRPC pushes (one buffer per part) and bulk lanes (one flat
buffer per push).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np

from pswire.dtypes import DType

__all__ = ["BufferPool", "trim_heap"]


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


def _libc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _libc_trim()


def trim_heap() -> None:
    """Give the free memory of the C heap back to the system (glibc's ``malloc_trim``).

    An initial upload streams the whole model through gRPC in chunks; glibc keeps the freed
    chunks in each thread's arena, about 11 MiB on a 256 MiB model, resident for the life of the
    shard. Trimming once the variables are in place returns them. A no-op without glibc.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
