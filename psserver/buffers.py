"""Reusable receive buffers for pushes.

A fresh buffer of a few MiB costs a page fault per 4 KiB on first touch, which on a loaded
machine made receiving a 64 MiB push slower than the network; a reused one is already mapped.
Both receive paths take from a pool: gRPC pushes (one buffer per part) and bulk lanes (one flat
buffer per push).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Free buffers by shape and dtype. ``keep``: the most free buffers kept per shape and dtype
    (None: every one given back, so the pool grows to the pushes that were once in flight at
    the same time)."""

    def __init__(self, *, keep: int | None = None) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` with undefined contents."""
        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype)

    def give(self, *tensors: torch.Tensor) -> None:
        """Return tensors :meth:`take` handed out; the caller no longer uses them."""
        with self._lock:
            for tensor in tensors:
                free = self._free.setdefault((tuple(tensor.shape), tensor.dtype), [])
                if self._keep is None or len(free) < self._keep:
                    free.append(tensor)
