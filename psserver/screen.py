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
from psserver.numerics import magnitude

__all__ = ["NonFiniteError", "gradient_bounds"]


class NonFiniteError(InvalidArgumentError):
    """A push refused for a non-finite gradient, or for an update that would have made a
    variable or its optimizer state non-finite (INVALID_ARGUMENT on the wire, like its parent;
    counted apart from other refusals)."""


def gradient_bounds(parts: Sequence[Part], grads: Sequence[np.ndarray]) -> list[float]:
    """Each gradient's largest magnitude (0.0 for one that is not floating point); raises
    ``NonFiniteError`` naming the first that holds a NaN or an infinity. Small gradients of one
    dtype are read as one (their concatenation, which bounds each), as the shard updates them."""
    if len(parts) != len(grads):
        raise ValueError(f"{len(grads)} gradients for {len(parts)} parts")
    known: list[float] = [0.0] * len(parts)
    small: dict[np.dtype, list[int]] = {}
    for i, (part, grad) in enumerate(zip(parts, grads)):
        if not part.dtype.is_floating_point:
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
