"""What a push's gradients are read for before a shard applies it: each one's largest
magnitude, which is a test for NaN and infinity and the bound that lets
:meth:`psserver.optimizers.UpdateRule.verify` prove the update finite without reading the
gradient again; and the refusal of a push that fails it (``NonFiniteError``). Read outside the
store's lock (``psserver.store.ShardStore.apply_push``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pswire.codec import Part
from pswire.errors import InvalidArgumentError
from psserver.groups import GROUP_PART_BYTES
from psserver.numerics import magnitude, magnitude_later

__all__ = ["ArrivalScreen", "NonFiniteError", "gradient_bounds"]


class NonFiniteError(InvalidArgumentError):
    """A push refused for a non-finite gradient, or for an update that would have made a
    variable or its optimizer state non-finite (INVALID_ARGUMENT on the wire, like its parent;
    counted apart from other refusals)."""


class ArrivalScreen:
    """A buffer's bytes read as float32 words, a piece at a time on the update threads while the
    pieces after it still arrive: a bulk push's float32 gradients then need no read after its last
    byte (on loopback, the receiving thread waits on the sender half the time, and a read on that
    thread itself would slow the transfer). ``add`` each piece once its bytes are in; ``bound``
    is the largest magnitude over every whole word added, or None when a word is a NaN or an
    infinity pattern (the bytes may hold other dtypes: the gradients are then read one by one)."""

    def __init__(self, buffer: np.ndarray) -> None:
        self._words = buffer[: buffer.size - buffer.size % 4].view(np.float32)
        self._pieces: list = []

    def add(self, start: int, stop: int) -> None:
        """Read bytes ``[start, stop)`` (``start`` a multiple of 4; a partial last word is left out)."""
        assert start % 4 == 0, start
        self._pieces.append(magnitude_later(self._words[start // 4 : stop // 4]))

    def bound(self) -> float | None:
        """The largest magnitude over the words added (waits for their reads); None if one is not finite."""
        tops = [piece.result() for piece in self._pieces]
        return None if not tops or None in tops else max(tops)


def gradient_bounds(
    parts: Sequence[Part], grads: Sequence[np.ndarray], screened: Sequence[float | None] = ()
) -> list[float]:
    """Each gradient's largest magnitude (0.0 for one that is not floating point); raises
    ``NonFiniteError`` naming the first that holds a NaN or an infinity. Small gradients of one
    dtype are read as one (their concatenation, which bounds each), as the shard updates them.
    ``screened``: per gradient, a bound already read (each of its elements finite and at most
    that), or None; those gradients are not read again."""
    if len(parts) != len(grads) or (screened and len(screened) != len(grads)):
        raise ValueError(f"{len(grads)} gradients ({len(screened)} screened) for {len(parts)} parts")
    known: list[float] = [0.0] * len(parts)
    small: dict[np.dtype, list[int]] = {}
    for i, (part, grad) in enumerate(zip(parts, grads)):
        if not part.dtype.is_floating_point:
            continue
        if screened and screened[i] is not None:
            known[i] = screened[i]
            continue
        if grad.nbytes <= GROUP_PART_BYTES:
            small.setdefault(grad.dtype, []).append(i)
            continue
        largest = magnitude(grad)
        if largest is None:
            raise NonFiniteError(f"gradient for {part.key!r} contains NaN or Inf")
        known[i] = largest
    for indices in small.values():
        together = np.concatenate([grads[i].reshape(-1) for i in indices]) if len(indices) > 1 else grads[indices[0]]
        largest = magnitude(together)
        if largest is None:
            first = next(i for i in indices if magnitude(grads[i]) is None)
            raise NonFiniteError(f"gradient for {parts[first].key!r} contains NaN or Inf")
        for i in indices:
            known[i] = largest
    return known
