"""A shard's rows of the job's embedding tables (``pswire.tables``): row ``i`` of a table lives on
shard ``i % num_shards`` at local index ``i // num_shards``.

A table's values and optimizer state are anonymous memory maps (``_zero_pages``), which the
kernel backs with shared zero pages until written: a row costs memory only once it is written,
a 4 KiB page (16 rows of 64 float32) at a time. Not ``np.zeros``: numpy advises the kernel to
back large arrays with 2 MiB transparent huge pages, and a row written in each would make the
whole table resident at once (a 10-million-row table of skewed ids: all of it within seconds). A row never written holds its initial
value (``pswire.tables.initial_rows``), which reads compute rather than store, so pulls never
change the table. ``written`` marks the rows a push has updated.

An update is computed first (:meth:`RowTable.prepare`: the new rows and their state, checked
finite) and written back only once every table and part of the push has been prepared
(:meth:`RowTable.commit`), so a push applies whole or not at all.

Plain data without a lock: ``ShardStore._lock`` guards every table.
"""

from __future__ import annotations

import mmap
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pswire.errors import InvalidArgumentError
from pswire.tables import TableSpec, check_ids, initial_rows, local_index, local_rows
from psserver.rowopt import RowRule, create_row_rule

__all__ = ["PIECE_BYTES", "NonFiniteRows", "RowTable", "RowUpdate"]

PIECE_BYTES = 64 << 20
"""The most bytes of rows (ids, values and state) one checkpoint piece holds."""

RECENT_READS = 4
"""Reads whose computed initial values a table keeps for the pushes of the same rows."""


class NonFiniteRows(InvalidArgumentError):
    """Rows refused for a non-finite gradient, or (``update``) for an update that would have made
    a row or its optimizer state non-finite."""

    def __init__(self, message: str, *, update: bool) -> None:
        super().__init__(message)
        self.update = update


@dataclass(frozen=True)
class RowUpdate:
    """A table's update computed and verified, not yet written (:meth:`RowTable.commit`)."""

    table: "RowTable"
    index: np.ndarray
    values: np.ndarray
    state: dict[str, np.ndarray]


@dataclass
class RowTable:
    spec: TableSpec
    shard: int
    num_shards: int
    rule: RowRule = field(init=False)
    rows: int = field(init=False)
    values: np.ndarray = field(init=False, repr=False)
    state: dict[str, np.ndarray] = field(init=False, repr=False)
    written: np.ndarray = field(init=False, repr=False)
    step: int = 0
    rows_written: int = 0
    rows_pushed: int = 0
    rows_pulled: int = 0
    _recent: deque = field(init=False, repr=False)
    """The initial values the last few reads computed, as ``(sorted ids, rows)``."""

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=RECENT_READS)
        self.rule = create_row_rule(self.spec.optimizer)
        self.rows = local_rows(self.spec.num_rows, self.shard, self.num_shards)
        shape = (self.rows, self.spec.dim)
        self.values = _zero_pages(shape)
        self.state = {name: _zero_pages(shape) for name in self.rule.state_names}
        self.written = np.zeros(self.rows, dtype=bool)

    @staticmethod
    def reserved_bytes(spec: TableSpec, shard: int, num_shards: int) -> int:
        """:attr:`nbytes` of a table not yet made."""
        state = len(create_row_rule(spec.optimizer).state_names)
        return local_rows(spec.num_rows, shard, num_shards) * spec.row_bytes * (1 + state)

    @property
    def nbytes(self) -> int:
        """Values and state of every row this shard holds (what is reserved, not resident)."""
        return self.rows * self.spec.row_bytes * (1 + len(self.state))

    @property
    def resident_bytes(self) -> int:
        return self.rows_written * self.spec.row_bytes * (1 + len(self.state))

    def locate(self, ids: np.ndarray, *, unique: bool) -> np.ndarray:
        """The local indices of ``ids`` (int64 row ids of this table on this shard). Raises
        ``InvalidArgumentError`` for an id outside the table or on another shard, and with
        ``unique`` for an id given twice."""
        try:
            check_ids(self.spec, ids, shard=self.shard, num_shards=self.num_shards)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if unique and ids.size > 1 and not (ids[1:] > ids[:-1]).all():  # sorted and distinct: as workers send
            ordered = np.sort(ids)
            repeats = ordered[1:] == ordered[:-1]
            if repeats.any():
                raise InvalidArgumentError(
                    f"table {self.spec.name!r}: row id {int(ordered[1:][repeats][0])} is given twice in one push "
                    "(send each row once, with its gradients summed)"
                )
        return local_index(ids, self.num_shards)

    def read(self, ids: np.ndarray, index: np.ndarray) -> np.ndarray:
        """A copy of rows ``ids`` at their local ``index`` (:meth:`locate`), initial values for
        rows never written."""
        out = _gather(self.values, index)
        fresh = ~self.written[index]
        if fresh.any():
            fresh_ids = ids[fresh]
            # Computed afresh rather than looked up: a read's fresh rows are mostly rows no read
            # has asked for yet (the rare ids of a skewed stream), where the search of the last
            # reads cost half as much again as computing them.
            rows = initial_rows(self.spec, fresh_ids)
            out[fresh] = rows
            if (fresh_ids[1:] > fresh_ids[:-1]).all():  # sorted, as searchsorted needs (workers send them so)
                self._recent.appendleft((fresh_ids, rows))
        self.rows_pulled += ids.size
        return out

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        """``initial_rows`` of ``ids``, taken from the last reads' where they computed them (a
        worker pulls a batch's rows and then pushes the same rows, the fresh ones computed once)."""
        out = np.empty((ids.size, self.spec.dim), dtype=np.float32)
        missing = np.ones(ids.size, dtype=bool)
        for known_ids, known in self._recent:
            if not missing.any():
                break
            want = np.flatnonzero(missing)
            at = np.minimum(np.searchsorted(known_ids, ids[want]), known_ids.size - 1)
            hit = known_ids[at] == ids[want]
            out[want[hit]] = _gather(known, at[hit])
            missing[want[hit]] = False
        if missing.any():
            out[missing] = initial_rows(self.spec, ids[missing])
        return out

    def prepare(self, ids: np.ndarray, grads: np.ndarray, lr_scale: float = 1.0) -> RowUpdate:
        """This table's update by the gradients ``grads`` of rows ``ids`` (each once), computed
        and checked, the table unchanged. Raises ``InvalidArgumentError`` for bad ids or shapes,
        and for a gradient or an update that is not finite."""
        index = self.locate(ids, unique=True)
        if grads.shape != (ids.size, self.spec.dim):
            raise InvalidArgumentError(
                f"table {self.spec.name!r}: gradients of shape {list(grads.shape)} for {ids.size} rows of dim "
                f"{self.spec.dim}"
            )
        if not np.isfinite(grads).all():
            raise NonFiniteRows(f"table {self.spec.name!r}: gradient contains NaN or Inf", update=False)
        values = _gather(self.values, index)
        state = {name: _gather(buf, index) for name, buf in self.state.items()}
        fresh = ~self.written[index]
        if fresh.any():
            values[fresh] = self._initial(ids[fresh])
            for name, rows in self.rule.fresh_state(int(fresh.sum()), self.spec.dim).items():
                state[name][fresh] = rows
        new_values, new_state = self.rule.compute(values, grads, state, self.step + 1, lr_scale)
        bad = [what for what, a in (("the rows", new_values), *((f"state {k!r}", v) for k, v in new_state.items()))
               if not np.isfinite(a).all()]
        if bad:
            raise NonFiniteRows(f"table {self.spec.name!r}: the update would make {', '.join(bad)} non-finite",
                                update=True)
        return RowUpdate(self, index, new_values, new_state)

    def commit(self, update: RowUpdate) -> None:
        """Write a prepared update back (one step of the table's optimizer)."""
        index = update.index
        self.values[index] = update.values
        for name, rows in update.state.items():
            self.state[name][index] = rows
        self.rows_written += int(np.count_nonzero(~self.written[index]))
        self.written[index] = True
        self.rows_pushed += index.size
        self.step += 1

    # -- checkpoints -------------------------------------------------------------------------

    def pieces(self) -> list[dict[str, np.ndarray]]:
        """Copies of the written rows, in pieces of at most ``PIECE_BYTES``: each ``{"ids"
        (global row ids), "values", "state/<name>"}``."""
        index = np.flatnonzero(self.written)
        per_row = 8 + self.spec.row_bytes * (1 + len(self.state))
        step = max(1, PIECE_BYTES // per_row)
        out = []
        for start in range(0, index.size, step):
            chunk = index[start:start + step]
            piece = {"ids": chunk.astype(np.int64) * self.num_shards + self.shard, "values": self.values[chunk]}
            piece.update({f"state/{name}": buf[chunk] for name, buf in self.state.items()})
            out.append(piece)
        return out

    def load(self, piece: dict[str, np.ndarray]) -> None:
        """Write one checkpoint piece's rows back (restore). Raises ``ValueError`` naming what is
        wrong with it."""
        expected = {"ids", "values", *(f"state/{name}" for name in self.state)}
        if set(piece) != expected:
            raise ValueError(f"table {self.spec.name!r}: a piece holds {sorted(piece)}, expected {sorted(expected)}")
        ids = piece["ids"]
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise ValueError(f"table {self.spec.name!r}: a piece's ids are {ids.dtype}{list(ids.shape)}")
        try:
            index = self.locate(ids, unique=True)
        except InvalidArgumentError as exc:
            raise ValueError(str(exc)) from None
        for name in expected - {"ids"}:
            a = piece[name]
            if a.dtype != np.float32 or a.shape != (ids.size, self.spec.dim):
                raise ValueError(f"table {self.spec.name!r}: a piece's {name} is {a.dtype}{list(a.shape)}")
            if not np.isfinite(a).all():
                raise ValueError(f"table {self.spec.name!r}: a piece's {name} is not finite")
        if self.written[index].any():
            raise ValueError(f"table {self.spec.name!r}: a row is in two pieces")
        self.values[index] = piece["values"]
        for name in self.state:
            self.state[name][index] = piece[f"state/{name}"]
        self.written[index] = True
        self.rows_written += ids.size


def _gather(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """A copy of ``table``'s rows at ``index`` (as ``table[index]``): ``np.take`` copies whole rows
    at about twice the speed of advanced indexing for the few hundred rows of a call."""
    return np.take(table, index, axis=0)


def _zero_pages(shape: tuple[int, int]) -> np.ndarray:
    """A float32 array of zeros in an anonymous map advised against huge pages (see above).
    Raises ``OSError`` when the address space cannot hold it."""
    nbytes = max(4, shape[0] * shape[1] * 4)
    # No reservation of swap for the whole map: --max-model-bytes bounds what it may grow to.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    region = mmap.mmap(-1, nbytes, flags=flags)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype=np.float32, count=shape[0] * shape[1]).reshape(shape)


