"""The trained model out of a checkpoint directory, with no shard running and no torch (DESIGN §9).

    model = read_checkpoint("/ckpt")              # the newest complete checkpoint under the root
    model.variables["0.weight"]                   # numpy, named by the model's state_dict() keys

A checkpoint holds one part per shard (``psserver.checkpoint``); each part names the row ranges
of the variables it holds (``job.parts`` of its metadata, as ``psserver.snapshot`` writes them).
Reading verifies every part against its manifest (sizes and sha256) before anything is returned,
checks that the parts make up the job's placement (its digest) and that every variable's row
ranges cover it exactly once, and reassembles variables that placement split by rows.

Shards hold the model's parameters only: buffers (BatchNorm statistics) stay on the workers.
:func:`layout` is the same check for what running shards report (``psworker.export``).

Embedding tables (``pswire.tables``) are not variables: a part holds only the rows a push wrote,
in pieces (``rows/NNNNN/ids`` and ``values``, numbered across the job's tables in order), and
every other row is its initial value. :attr:`CheckpointModel.tables` indexes the written rows of
each table (sorted ids, no copy of the values) and gives any range of rows,
:meth:`CheckpointTable.rows`, so a whole table is never needed in memory at once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pswire.codec import Part
from pswire.dtypes import dtype_of
from pswire.errors import InvalidArgumentError
from pswire.placement import Placement
from pswire.tables import TableSpec, check_ids, initial_rows
from psserver.checkpoint import CheckpointError, CheckpointStore, ShardPart
from psserver.snapshot import FORMAT

__all__ = ["CheckpointModel", "CheckpointTable", "layout", "read_checkpoint"]

log = logging.getLogger(__name__)

_CKPT_DIR = re.compile(r"ckpt-(\d{12})")


class CheckpointTable:
    """One embedding table as a checkpoint holds it: the rows pushed at least once (the shards'
    pieces, by reference) and the spec that gives every other row its initial value.

    Besides the pieces' values this keeps 16 bytes per written row (the written ids, sorted,
    and where each one is)."""

    def __init__(self, spec: TableSpec, pieces: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """``pieces``: ``(ids, values)`` of the written rows (int64 global ids, float32
        ``[len(ids), dim]``). Raises ``ValueError`` for a row written twice."""
        self.spec = spec
        self._values = tuple(values for _, values in pieces)
        self._starts = np.cumsum([0] + [ids.size for ids, _ in pieces], dtype=np.int64)
        flat = np.concatenate([ids for ids, _ in pieces]) if pieces else np.zeros(0, dtype=np.int64)
        self._where = np.argsort(flat, kind="stable")
        """For each written id in sorted order, its index in the pieces laid end to end."""
        self._ids = flat[self._where]
        del flat
        repeats = self._ids[1:] == self._ids[:-1]
        if repeats.any():
            raise ValueError(f"table {spec.name!r}: row {int(self._ids[1:][repeats][0])} is in two pieces")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.spec.num_rows, self.spec.dim)

    @property
    def rows_written(self) -> int:
        """Rows the checkpoint holds values of (the rest hold their initial values)."""
        return int(self._ids.size)

    def __repr__(self) -> str:
        spec = self.spec
        return f"CheckpointTable({spec.name!r}, {spec.num_rows} x {spec.dim}, {self.rows_written} written)"

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as float32 ``[stop - start, dim]`` (a new array): the written
        ones from the pieces, the others their initial values."""
        if not 0 <= start <= stop <= self.spec.num_rows:
            raise ValueError(f"table {self.spec.name!r}: rows [{start}, {stop}) outside its {self.spec.num_rows}")
        out = np.empty((stop - start, self.spec.dim), dtype=np.float32)
        low, high = (int(i) for i in np.searchsorted(self._ids, [start, stop]))
        local = self._ids[low:high] - start
        fresh = np.ones(stop - start, dtype=bool)
        fresh[local] = False
        if fresh.any():
            out[fresh] = initial_rows(self.spec, np.flatnonzero(fresh) + start)
        if high > low:
            flat = self._where[low:high]
            piece = np.searchsorted(self._starts, flat, side="right") - 1
            for k in np.unique(piece):
                mine = piece == k
                out[local[mine]] = self._values[k][flat[mine] - self._starts[k]]
        return out

    def array(self, *, chunk_rows: int = 1 << 16) -> np.ndarray:
        """The whole table, float32 ``[num_rows, dim]`` (``num_rows * dim * 4`` bytes)."""
        out = np.empty(self.shape, dtype=np.float32)
        for start in range(0, self.spec.num_rows, chunk_rows):
            stop = min(start + chunk_rows, self.spec.num_rows)
            out[start:stop] = self.rows(start, stop)
        return out


@dataclass(frozen=True)
class CheckpointModel:
    """A job's variables as one checkpoint holds them, every row range put back in place."""

    checkpoint_id: int
    num_shards: int
    path: Path
    """The checkpoint's own directory (``ROOT/ckpt-{id:012d}``)."""
    variables: dict[str, np.ndarray]
    """Whole variables by name (the model's ``state_dict()`` keys), in the dtypes the shards held."""
    optimizer: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """Per variable, the update rule's state by name (``exp_avg``, ``step`` ...), whole like the
    variables; empty unless asked for."""
    tables: dict[str, CheckpointTable] = field(default_factory=dict)
    """The job's embedding tables by name, in the job's order (their rows read on demand; the
    tables' optimizer state is not read)."""


def layout(shards: Sequence[Sequence[Part]]) -> dict[str, list[tuple[int, Part]]]:
    """Each variable's ``(shard index, part)`` pieces in row order, from the parts every shard
    holds. Raises ``ValueError`` when the pieces of a variable disagree on its shape or dtype, or
    do not cover its rows exactly once."""
    pieces: dict[str, list[tuple[int, Part]]] = {}
    for index, parts in enumerate(shards):
        for part in parts:
            pieces.setdefault(part.name, []).append((index, part))
    for name, found in pieces.items():
        found.sort(key=lambda item: item[1].row_start)
        first = found[0][1]
        for index, part in found:
            if part.full_shape != first.full_shape or part.dtype != first.dtype:
                raise ValueError(f"variable {name!r} is {first.dtype}{list(first.full_shape)} on shard {found[0][0]} "
                                 f"but {part.dtype}{list(part.full_shape)} on shard {index}")
        row = 0
        for index, part in found:
            if part.row_start != row or (part.row_end <= part.row_start and first.rows):
                raise ValueError(f"variable {name!r}: shard {index} holds rows [{part.row_start}, {part.row_end}), "
                                 f"expected a range from row {row}")
            row = part.row_end
        if row != first.rows:
            raise ValueError(f"variable {name!r}: the shards hold rows up to {row} of its {first.rows}")
    return pieces


def read_checkpoint(path: str | Path, *, checkpoint_id: int | None = None, optimizer: bool = False) -> CheckpointModel:
    """The model in a checkpoint. ``path`` is the checkpoint root (the directory holding LATEST,
    as given to ``psserver --checkpoint-dir``) or one checkpoint's directory (``ckpt-{id}``).
    Default: the newest complete checkpoint (LATEST's; an older complete one, with a warning
    logged, if that one is damaged); ``checkpoint_id`` asks for one. ``optimizer``: also the
    update rule's state (:attr:`CheckpointModel.optimizer`). The job's embedding tables come in
    :attr:`CheckpointModel.tables`, their written rows checked (ids on the right shard, each
    once, dtypes and shapes).

    Raises ``CheckpointError`` naming the problem: no such directory, no checkpoint, a part
    missing or unfinished (incomplete), a file that does not match its manifest's size or
    sha256 (damaged), or parts that do not make up one job's variables. Raises ``ValueError``
    when ``checkpoint_id`` disagrees with a checkpoint directory given as ``path``.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if match := _CKPT_DIR.fullmatch(root.name):
        if checkpoint_id is not None and checkpoint_id != int(match[1]):
            raise ValueError(f"{root} is checkpoint {int(match[1])}, not {checkpoint_id}")
        root, checkpoint_id = root.parent, int(match[1])
    cid, parts = CheckpointStore(root).load_all(checkpoint_id)
    where = f"checkpoint {cid} in {root}"
    try:
        held = [_parts_of(part, i, len(parts)) for i, part in enumerate(parts)]
        digests = {part.metadata["job"]["placement_digest"] for part in parts}
        if len(digests) != 1 or Placement(len(parts), tuple(held)).digest() not in digests:
            raise ValueError("its parts do not make up one job's placement (their placement digests disagree)")
        pieces = layout(held)
        variables = {name: _assemble(found, parts, lambda key: f"var/{key}") for name, found in pieces.items()}
        states = {}
        for name, found in pieces.items() if optimizer else ():
            prefix = f"opt/{found[0][1].key}/"
            names = sorted(k[len(prefix):] for k in parts[found[0][0]].tensors if k.startswith(prefix))
            states[name] = {s: _assemble(found, parts, lambda key, s=s: f"opt/{key}/{s}") for s in names}
        tables = _tables_of(parts)
    except KeyError as exc:
        raise CheckpointError(f"{where}: a part's metadata lacks {exc}") from exc
    except (ValueError, TypeError, InvalidArgumentError) as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    return CheckpointModel(cid, len(parts), root / f"ckpt-{cid:012d}", variables, states, tables)


def _parts_of(part: ShardPart, index: int, count: int) -> tuple[Part, ...]:
    """The parts one shard's metadata says it held, checked against its tensors."""
    meta = part.metadata
    if meta.get("format") != FORMAT:
        raise ValueError(f"part {index} has format {meta.get('format')!r}, this reader reads format {FORMAT}")
    job = meta["job"]
    if (job["shard_index"], job["num_shards"]) != (index, count):
        raise ValueError(f"part {index} of {count} says it is shard {job['shard_index']} of {job['num_shards']}")
    held = []
    for name, shape, dtype, start, end in job["parts"]:
        p = Part(str(name), tuple(int(d) for d in shape), dtype_of(str(dtype)), int(start), int(end))
        value = part.tensors.get(f"var/{p.key}")
        if value is None:
            raise ValueError(f"part {index} lacks the values of {p.key!r}")
        if value.dtype != p.dtype.numpy or tuple(value.shape) != p.shape:
            raise ValueError(f"part {index} holds {p.key!r} as {value.dtype}{list(value.shape)}, "
                             f"its metadata says {p.dtype}{list(p.shape)}")
        held.append(p)
    return tuple(held)


def _assemble(found: list[tuple[int, Part]], parts: list[ShardPart], tensor: Callable[[str], str]) -> np.ndarray:
    """One whole array from the pieces named ``tensor(part.key)``: row ranges put in place when
    each piece has its part's shape; otherwise (a per-piece scalar, as a step count) the pieces'
    common value (the first piece's, with a warning, when they differ)."""
    arrays = []
    for index, part in found:
        array = parts[index].tensors.get(tensor(part.key))
        if array is None:
            raise ValueError(f"part {index} lacks {tensor(part.key)!r}")
        arrays.append(array)
    first = found[0][1]
    whole = tensor(first.name)
    if all(a.shape == p.shape for a, (_, p) in zip(arrays, found)):
        if len({a.dtype for a in arrays}) != 1:
            raise ValueError(f"the pieces of {whole!r} differ in dtype")
        out = np.empty(first.full_shape, dtype=arrays[0].dtype)
        for array, (_, part) in zip(arrays, found):
            if first.full_shape:
                out[part.row_start:part.row_end] = array
            else:
                out[...] = array
        return out
    if any(a.shape != arrays[0].shape or a.dtype != arrays[0].dtype for a in arrays):
        raise ValueError(f"the pieces of {whole!r} differ in shape or dtype")
    if any(not np.array_equal(a, arrays[0]) for a in arrays[1:]):
        log.warning("the pieces of %r differ (%s): taking the first one's", whole,
                    ", ".join(str(a.tolist()) for a in arrays))
    return arrays[0].copy()


def _tables_of(parts: list[ShardPart]) -> dict[str, CheckpointTable]:
    """Every table of the job from the parts' pieces (``psserver.snapshot``: each part's pieces
    numbered from 0 across the job's tables in order, ``metadata["tables"][i]["pieces"]`` of
    table i). Raises ``ValueError`` naming what does not fit."""
    docs = [part.metadata["job"].get("tables", []) for part in parts]
    if any(d != docs[0] for d in docs[1:]):
        raise ValueError("its parts disagree on the job's embedding tables")
    specs = [TableSpec.from_dict(d) for d in docs[0]]
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("two of the job's embedding tables have one name")
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s.name: [] for s in specs}
    for index, part in enumerate(parts):
        records = part.metadata.get("tables", [])
        if not isinstance(records, list) or [r.get("name") for r in records] != [s.name for s in specs]:
            raise ValueError(f"part {index}'s table records do not match the job's tables")
        number = 0
        for spec, record in zip(specs, records):
            count = record.get("pieces")
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"part {index}: table {spec.name!r} has {count!r} pieces")
            for _ in range(count):
                ids, values = (part.tensors.get(f"rows/{number:05d}/{name}") for name in ("ids", "values"))
                if ids is None or values is None:
                    raise ValueError(f"part {index} lacks piece {number} (of table {spec.name!r})")
                if ids.dtype != np.int64 or ids.ndim != 1:
                    raise ValueError(f"part {index}: piece {number}'s ids are {ids.dtype}{list(ids.shape)}")
                if values.dtype != np.float32 or values.shape != (ids.size, spec.dim):
                    raise ValueError(f"part {index}: piece {number} of table {spec.name!r} holds values "
                                     f"{values.dtype}{list(values.shape)} for {ids.size} rows of dim {spec.dim}")
                check_ids(spec, ids, shard=index, num_shards=len(parts))
                found[spec.name].append((ids, values))
                number += 1
        stray = sorted({key.split("/")[1] for key in part.tensors if key.startswith("rows/")}
                       - {f"{k:05d}" for k in range(number)})
        if stray:
            raise ValueError(f"part {index} holds pieces {stray} of no table")
    return {spec.name: CheckpointTable(spec, found[spec.name]) for spec in specs}
