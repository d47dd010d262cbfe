"""The arithmetic under the shard's update rules that is no rule itself: how an array is cut
into slices and into ranges for threads, how its largest magnitude is read from its bits, the
bounds with which :meth:`psserver.optimizers.UpdateRule.verify` proves an update finite, and the
rounding to a 16-bit dtype after every operation.

Kept apart from the rules (``psserver.optimizers``) because none of it depends on an optimizer:
each rule there reads as torch's algorithm, operation for operation, while this serves every rule
alike, and a push's check of its gradients for NaN (:func:`magnitude`) before any rule runs.

Arrays are updated in slices of ``CHUNK_ELEMENTS``: the temporaries a rule needs (``lr * grad``,
Adam's denominator, a weight-decayed gradient) then cost one slice, not a second copy of the
variable, and each slice stays in cache across the rule's several passes.

This module imports no gRPC and no torch, as the rules do not: a shard's resident size stays its
variables.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import numpy as np

from pswire.dtypes import dtype_of
from pswire.errors import InvalidArgumentError

__all__ = ["CHUNK_ELEMENTS", "PARALLEL_ELEMENTS", "magnitude", "magnitude_later"]

CHUNK_ELEMENTS = 1 << 18
"""Elements per slice of an update (1 MiB of float32). Each slice costs the rule's Python a few
calls, which hold the GIL that the update threads share: 64 MiB updated on 2 threads took SGD
3.3 ms in slices of 1 MiB against 3.6-5.8 in slices of 256 KiB, Adam 15.5-16.2 against 19.2-19.4,
and a shard's SGD update of a 64 MiB push 4.9-5.0 against 5.6-6.1 ms. A slice's temporaries stay
below glibc's mmap threshold once the shard settled its heap (``psserver.buffers.settle_heap``),
so they are reused heap memory rather than fresh pages faulted in per slice."""

PARALLEL_ELEMENTS = 1 << 21
"""Elements (8 MiB of float32) per thread from which an update, and the reads that check an
array for non-finite values, are cut into ranges run on several threads at once (numpy releases
the GIL in its loops; every rule is elementwise). A shard applies a push under its store's lock
and its worker waits for the reply meanwhile: on 2 cores, a 64 MiB SGD update took 5.2 ms on
one thread and 3.6 ms on two; a gradient's read for NaN, bound by memory, 2.2 and 1.8 ms."""

T = TypeVar("T")
_THREADS = max(1, min(4, os.cpu_count() or 1))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_THREADS, thread_name_prefix="psserver-update")


def _ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut into one range per thread, each a whole number of ``chunk`` slices,
    when every range gets at least ``PARALLEL_ELEMENTS``; else the one range."""
    count = min(_THREADS, size // PARALLEL_ELEMENTS)
    if count < 2:
        return [(0, size)]
    per_thread = -(-size // count)
    step = -(-per_thread // chunk) * chunk
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def _each(fn: Callable[[int, int], T], ranges: list[tuple[int, int]]) -> list[T]:
    """``fn(start, stop)`` of every range, in order: on the pool's threads when there are
    several, every one finished before the first error is raised."""
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    futures = [_pool().submit(fn, start, stop) for start, stop in ranges]
    concurrent.futures.wait(futures)
    return [future.result() for future in futures]


def _is_float(dtype: np.dtype) -> bool:
    found = _IS_FLOAT.get(dtype)
    if found is None:
        try:
            found = dtype_of(dtype).is_floating_point
        except InvalidArgumentError:
            found = False
        _IS_FLOAT[dtype] = found
    return found


_IS_FLOAT: dict[np.dtype, bool] = {}


def _flat_slicer(a: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """``(start, stop) -> a.reshape(-1)[start:stop]``: a view of a C-contiguous array; for any other
    layout a copy of that slice alone, never of the whole array."""
    if a.flags.c_contiguous:
        flat = a.reshape(-1)
        return lambda start, stop: flat[start:stop]
    return lambda start, stop: a.flat[start:stop]


_BIT_VIEWS = {2: (np.int16, np.uint16), 4: (np.int32, np.uint32), 8: (np.int64, np.uint64)}


class _Format(NamedTuple):
    """What the overflow screen needs to know about one floating-point storage dtype."""

    limit: float
    """The largest finite value."""
    grow: float
    """1 + 8u (u the unit roundoff): covers the relative error of one operation rounded to the
    dtype, of one rounded first to float32 and then to the dtype, and of the screen's own float64
    arithmetic."""
    tiny: float
    """The smallest subnormal: covers the absolute error of a result rounded in the subnormal range."""
    inf_bits: int
    """The bit pattern of +inf: every magnitude at or above it is an infinity or a NaN."""


def _from_bits(bits: int, dtype: np.dtype) -> float:
    return float(np.array(bits, dtype=_BIT_VIEWS[dtype.itemsize][1]).view(dtype))


@functools.cache
def _format(dtype: np.dtype) -> _Format:
    unsigned = _BIT_VIEWS[dtype.itemsize][1]
    inf_bits = int(np.array(np.inf, dtype=dtype).view(unsigned))
    one_bits = int(np.array(1.0, dtype=dtype).view(unsigned))
    ulp_of_one = _from_bits(one_bits + 1, dtype) - 1.0  # 2u
    return _Format(_from_bits(inf_bits - 1, dtype), 1 + 4 * ulp_of_one, _from_bits(1, dtype), inf_bits)


def _largest_magnitude(a: np.ndarray, chunk: int, *, parallel: bool = True) -> tuple[float | None, bool]:
    """The largest ``|x|`` over ``a``'s elements (None if one is infinite or NaN), and whether an
    element is negative (below -0.0).

    Read from the bits with two integer reductions, which numpy vectorizes for every width (its
    float16 and ml_dtypes' bfloat16 reductions are scalar loops) and which need no temporary: IEEE
    formats order magnitudes as unsigned integers once the sign bit is cleared, so the signed
    view's maximum is the largest magnitude among elements with the sign bit clear and the
    unsigned view's among those with it set. A C-contiguous array is read a slice at a time so
    that the second reduction finds the slice in cache; on the update threads when large, unless
    not ``parallel`` (when called from one of them).
    """
    signed, unsigned = _BIT_VIEWS[a.itemsize]
    as_signed, as_unsigned = a.view(signed), a.view(unsigned)
    if a.flags.c_contiguous:
        as_signed, as_unsigned = as_signed.reshape(-1), as_unsigned.reshape(-1)

        def scan(first: int, last: int) -> tuple[int, int]:
            top_signed = top_unsigned = 0
            for start in range(first, last, chunk):
                stop = min(start + chunk, last)
                top_signed = max(top_signed, int(as_signed[start:stop].max()))
                top_unsigned = max(top_unsigned, int(as_unsigned[start:stop].max()))
            return top_signed, top_unsigned

        tops = _each(scan, _ranges(a.size, chunk)) if parallel else [scan(0, a.size)]
    else:
        tops = [(int(as_signed.max()), int(as_unsigned.max()))]  # a strided reduction copies nothing
    top_signed, top_unsigned = max(t[0] for t in tops), max(t[1] for t in tops)
    sign = 1 << (8 * a.itemsize - 1)
    negative = top_unsigned - sign if top_unsigned >= sign else 0
    top = max(top_signed, negative)
    return (None if top >= _format(a.dtype).inf_bits else _from_bits(top, a.dtype)), negative > 0


def magnitude(a: np.ndarray) -> float | None:
    """The largest ``|x|`` over a floating-point array's elements, or None if one is a NaN or an
    infinity: a test for non-finite values that also gives
    :meth:`~psserver.optimizers.UpdateRule.verify` a ``known`` bound. Reads every element once,
    copies none; 0.0 for an empty array."""
    if a.size == 0:
        return 0.0
    return _largest_magnitude(a, CHUNK_ELEMENTS)[0]


def magnitude_later(a: np.ndarray) -> Future[float | None]:
    """:func:`magnitude` of ``a``, read on one of the update threads while the caller goes on;
    ``a`` must not change until the result is in."""
    return _pool().submit(lambda: None if a.size == 0 else _largest_magnitude(a, CHUNK_ELEMENTS, parallel=False)[0])


class _Bounds:
    """Upper bounds on the magnitudes a rule's arithmetic produces, from bounds on its operands.

    ``up(x)`` takes the exact result of an operation applied to bounds of its operands' magnitudes
    (evaluated in float64) and returns a bound of the magnitude the rule's rounded operation
    gives; it notes when that bound exceeds the storage dtype's largest finite value.

    Why a bound holds: for ``|a| <= A`` and ``|b| <= B``, ``|a + b|`` and ``|a - b|`` are at most
    ``A + B``, ``|a * b| = |a| |b| <= A B``, and ``|a / b| <= A / D`` when ``|b| >= D > 0``;
    rounding to nearest then adds at most a relative ``u`` (twice for a 16-bit result computed in
    float32) or, below the normal range, half the smallest subnormal. ``grow`` and ``tiny`` cover
    those, and the float64 rounding of the bound itself, with room to spare.
    """

    def __init__(self, storage: np.dtype) -> None:
        self._format = _format(storage)
        self.ok = True
        """False once a bound exceeded the largest finite value (or was NaN)."""

    def up(self, exact: float) -> float:
        bound = exact * self._format.grow + self._format.tiny
        if not bound <= self._format.limit:
            self.ok = False
        return bound


class _Rounding:
    """Rounds results computed in a wider dtype to the storage dtype after each operation."""

    def __init__(self, storage: np.dtype) -> None:
        self.storage = storage
        self.needed = storage.itemsize < 4
        self._scalar = np.float64 if storage.itemsize == 8 else np.float32
        self._alpha = np.float32 if storage.itemsize == 4 else storage.type

    def s(self, value: float) -> float:
        """A scalar operand as torch hands it to a kernel: in float32 unless the storage is float64."""
        return float(self._scalar(value))

    def alpha(self, value: float) -> float:
        """The ``alpha`` of torch's ``add_``: rounded to the storage dtype (float64 stays)."""
        return float(self._alpha(value))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.needed:
            x[...] = x.astype(self.storage)
        return x
