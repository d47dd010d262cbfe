"""Which shard holds what: a pure, deterministic function of (model spec, number of shards).

Every worker computes the same map and sends its digest with ``Register``; shards refuse a
worker whose map disagrees. Variables larger than a threshold are split by rows into one range
per shard (TensorFlow's variable partitioner, ps-lite key ranges); the rest are placed largest
first on the least-loaded shard, so no shard holds more than its share plus one small variable
(and a row of rounding). A split variable's pieces need distinct shards, so small variables
placed first can leave its last piece only a shard they filled; a model that this would put
above the bound has its split pieces placed first instead (every other model keeps the
largest-first placement, and with it the layout of its checkpoints).
A model of at most ``PACK_BELOW`` bytes in all lives whole on shard 0: spread, it would cost a
call per shard per step for bytes that cost less to move than a call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pswire.codec import Part
from pswire.dtypes import DType, dtype_name, dtype_of

__all__ = ["MIN_SPLIT_BYTES", "PACK_BELOW", "Placement", "VariableSpec", "model_spec", "place"]

MIN_SPLIT_BYTES = 256 << 10
"""Variables below this are never split: a row range costs a message per shard per step."""

PACK_BELOW = MIN_SPLIT_BYTES
"""Models of at most this many bytes are not spread: every variable lives on shard 0, so a step
is one call (a small call costs a worker and a shard 0.2-0.4 ms of CPU each, moving 256 KiB about
as much). Measured on the 15K-parameter MLP, 2 workers x 2 shards: 82-85K samples/s spread,
117-127K packed (docs/benchmarks.md)."""


@dataclass(frozen=True)
class VariableSpec:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    """Given as a DType, a torch or numpy dtype or a name; kept as the DType (raises
    ``InvalidArgumentError`` for a dtype the wire cannot carry)."""

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", dtype_of(self.dtype))

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def model_spec(named_tensors: Iterable[tuple[str, Any]]) -> list[VariableSpec]:
    """Spec of a model's variables (e.g. ``model.named_parameters()``: anything with a ``shape``
    and a torch or numpy ``dtype``), in the given order.

    Raises ``ValueError`` on duplicate names or dtypes the wire cannot carry.
    """
    spec, seen = [], set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"duplicate variable name {name!r}")
        seen.add(name)
        spec.append(VariableSpec(name, tuple(tensor.shape), dtype_of(tensor.dtype)))
    return spec


@dataclass(frozen=True)
class Placement:
    num_shards: int
    shards: tuple[tuple[Part, ...], ...]
    """Parts held by each shard, in the model's variable order."""

    def shard_bytes(self) -> list[int]:
        return [sum(p.nbytes for p in parts) for parts in self.shards]

    def parts_of(self, name: str) -> list[tuple[int, Part]]:
        """(shard index, part) of every piece of variable ``name``, by row order."""
        found = [(i, p) for i, parts in enumerate(self.shards) for p in parts if p.name == name]
        return sorted(found, key=lambda item: item[1].row_start)

    def digest(self) -> str:
        """Stable identity of the whole map, compared by shards at registration."""
        doc = [
            [[p.name, list(p.full_shape), dtype_name(p.dtype), p.row_start, p.row_end] for p in parts]
            for parts in self.shards
        ]
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:32]


def _row_ranges(rows: int, pieces: int) -> list[tuple[int, int]]:
    return [(rows * i // pieces, rows * (i + 1) // pieces) for i in range(pieces)]


def place(
    spec: Sequence[VariableSpec], num_shards: int, *, min_split_bytes: int = MIN_SPLIT_BYTES,
    pack_below: int = PACK_BELOW,
) -> Placement:
    """Place ``spec`` on ``num_shards`` shards; a model of at most ``pack_below`` bytes whole on
    shard 0 (0: spread every model). Raises ``ValueError`` for an empty spec, duplicate names,
    a shard count below 1 or a negative ``pack_below``."""
    if num_shards < 1:
        raise ValueError(f"number of shards must be >= 1, got {num_shards}")
    if not spec:
        raise ValueError("the model has no variables to place")
    names = [v.name for v in spec]
    if len(set(names)) != len(names):
        raise ValueError("variable names must be unique")
    if pack_below < 0:
        raise ValueError(f"pack_below must be >= 0, got {pack_below}")
    total = sum(v.nbytes for v in spec)
    if num_shards > 1 and total <= pack_below:
        whole = tuple(Part(v.name, v.shape, v.dtype, 0, v.shape[0] if v.shape else 1) for v in spec)
        return Placement(num_shards, (whole,) + ((),) * (num_shards - 1))
    # Split anything bigger than an eighth of a shard's share: then the leftover imbalance after
    # greedy placement is at most that eighth.
    threshold = max(min_split_bytes, total // (8 * num_shards))

    # (order key, var index, part) items; large variables become one row range per shard.
    items: list[tuple[int, int, Part]] = []
    for index, var in enumerate(spec):
        rows = var.shape[0] if var.shape else 1
        pieces = min(num_shards, rows) if var.nbytes > threshold and var.shape else 1
        for start, end in _row_ranges(rows, pieces):
            items.append((index, pieces, Part(var.name, var.shape, var.dtype, start, end)))

    # Largest first, ties broken by name and rows, so the result never depends on dict order.
    assigned = _greedy(items, num_shards, lambda it: (-it[2].nbytes, it[2].name, it[2].row_start))
    widest_row = max(v.nbytes // max(1, v.shape[0] if v.shape else 1) for v in spec)
    if max(sum(p.nbytes for _, p in parts) for parts in assigned) > total / num_shards + threshold + widest_row:
        # Small variables placed before a split variable's smaller pieces can leave those pieces
        # only the shards the small ones filled (a split variable's pieces need distinct shards):
        # then the split pieces go first, which bounds every shard again. Only such models are
        # placed this way, so every other model's placement (and its checkpoints) stays as it was.
        assigned = _greedy(items, num_shards, lambda it: (it[1] == 1, -it[2].nbytes, it[2].name, it[2].row_start))
    shards = tuple(
        tuple(p for _, p in sorted(parts, key=lambda it: (it[0], it[1].row_start))) for parts in assigned
    )
    return Placement(num_shards, shards)


def _greedy(items: list[tuple[int, int, Part]], num_shards: int, order) -> list[list[tuple[int, Part]]]:
    """Each item, in ``order``, on the least-loaded shard (the lowest index among equals) that
    holds no other piece of its variable when the variable is split."""
    load = [0] * num_shards
    holders: dict[str, set[int]] = {}
    assigned: list[list[tuple[int, Part]]] = [[] for _ in range(num_shards)]
    for index, pieces, part in sorted(items, key=order):
        taken = holders.setdefault(part.name, set())
        candidates = [s for s in range(num_shards) if s not in taken] if pieces > 1 else range(num_shards)
        shard = min(candidates, key=lambda s: (load[s], s))
        load[shard] += part.nbytes
        taken.add(shard)
        assigned[shard].append((index, part))
    return assigned
