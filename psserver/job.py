"""What defines a job on a shard, and how a joining worker is checked against it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pswire.codec import Part, dtype_name
from pswire.errors import InvalidArgumentError, PreconditionError
from pswire.optim import OptimizerConfig
from pswire.consistency import Consistency
from pswire.tables import TableSpec
from pswire.wire import MAX_COUNT, check_count
from psserver.numerics import magnitude

__all__ = ["MAX_COUNT", "Registration", "check_count", "check_finite", "check_parts", "check_tables", "check_same_job", "fmt_bytes"]

MAX_DIMENSION = 1 << 40
"""The largest dimension of a variable's shape."""


@dataclass(frozen=True, kw_only=True)
class Registration:
    """A worker's request to join; the first one defines the job."""

    worker_name: str
    shard_index: int
    num_shards: int
    placement_digest: str
    parts: tuple[Part, ...]
    optimizer: OptimizerConfig
    job_fingerprint: str = ""
    consistency: Consistency = Consistency()
    tables: tuple[TableSpec, ...] = ()
    """The job's embedding tables (``pswire.tables``), whole: this shard holds its rows of each."""


def check_parts(parts: Sequence[Part], max_bytes: int = 1 << 62, *, num_shards: int = 1) -> None:
    """Raises ``InvalidArgumentError`` for a registration that lists a variable twice, an
    impossible shape, or more than ``max_bytes`` of variables for this shard, and for one that
    lists nothing for the only shard of a job (a job of several shards may leave a shard none:
    a small model lives whole on shard 0, ``pswire.placement``)."""
    if not parts and num_shards <= 1:
        raise InvalidArgumentError("registration lists no variables for this shard")
    keys = [p.key for p in parts]
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError("registration lists a variable twice")
    total = 0
    for part in parts:
        if any(d > MAX_DIMENSION for d in part.full_shape) or len(part.full_shape) > 32:
            raise InvalidArgumentError(
                f"variable {part.name!r} has shape {list(part.full_shape)}: at most 32 dimensions of at most "
                f"{MAX_DIMENSION} each"
            )
        whole = part.dtype.itemsize * int(np.prod(part.full_shape, dtype=object))
        if whole > 1 << 62:
            raise InvalidArgumentError(f"variable {part.name!r} of shape {list(part.full_shape)} is impossibly large")
        total += part.nbytes
    if total > max_bytes:
        raise InvalidArgumentError(
            f"registration puts {fmt_bytes(total)} of variables on this shard, above its limit of "
            f"{fmt_bytes(max_bytes)} (--max-model-bytes)"
        )


def check_finite(part: Part, value: np.ndarray, what: str) -> None:
    """Raises ``InvalidArgumentError`` if a floating-point ``value`` holds a NaN or an Inf (read
    as a push's gradients are: ``psserver.numerics.magnitude``)."""
    if part.dtype.is_floating_point and magnitude(value) is None:
        raise InvalidArgumentError(f"{what} for {part.key!r} contains NaN or Inf")


_LAYOUT_HINT = ("; or the layout: by default a model of at most 256 KiB lives whole on shard 0, unless every worker gives "
                "psworker --pack-below 0 (as a job checkpointed before models were packed needs)")


def check_same_job(job: Registration, reg: Registration) -> None:
    """Raises ``PreconditionError`` naming the first way ``reg`` disagrees with ``job``."""
    if reg.num_shards != job.num_shards or reg.shard_index != job.shard_index:
        raise PreconditionError(
            f"this shard is shard {job.shard_index} of {job.num_shards}, but the worker addressed "
            f"it as shard {reg.shard_index} of {reg.num_shards}: give every worker the same "
            "--ps list in the same order"
        )
    mine = {p.key: p for p in job.parts}
    theirs = {p.key: p for p in reg.parts}
    by_name_mine = {p.name: p for p in job.parts}
    # Parts that differ with the placement may be the same model laid out otherwise.
    layout = _LAYOUT_HINT if reg.placement_digest != job.placement_digest else ""
    for part in reg.parts:
        known = mine.get(part.key) or by_name_mine.get(part.name)
        if known is None:
            raise PreconditionError(f"variable {part.name!r} is not in the job's model on this shard{layout}")
        if known.full_shape != part.full_shape or known.dtype != part.dtype:
            raise PreconditionError(
                f"variable {part.name!r} is {dtype_name(known.dtype)}{list(known.full_shape)} in the "
                f"job but {dtype_name(part.dtype)}{list(part.full_shape)} in the worker's model"
            )
    missing = [k for k in mine if k not in theirs]
    if missing or [p.key for p in reg.parts] != list(mine):
        raise PreconditionError(
            f"the worker's model lacks variable(s) {', '.join(missing) or '(order differs)'} of the job{layout}"
        )
    if reg.placement_digest != job.placement_digest:
        raise PreconditionError(
            "the worker's placement differs from the job's on another shard: its model or "
            f"shard count disagrees{_LAYOUT_HINT}"
        )
    diffs = job.optimizer.differences(reg.optimizer)
    if diffs:
        raise PreconditionError("optimizer settings differ from the job's: " + "; ".join(diffs))
    if reg.consistency != job.consistency:
        raise PreconditionError(
            f"consistency differs from the job's: job runs {job.consistency.describe()}, "
            f"worker asked for {reg.consistency.describe()}"
        )
    if reg.job_fingerprint != job.job_fingerprint:
        raise PreconditionError(
            f"job {reg.job_fingerprint!r} differs from the job this shard serves ({job.job_fingerprint!r})"
        )
    mine_tables, their_tables = [t.name for t in job.tables], [t.name for t in reg.tables]
    if mine_tables != their_tables:
        raise PreconditionError(
            f"the worker's embedding tables ({', '.join(their_tables) or 'none'}) differ from the job's "
            f"({', '.join(mine_tables) or 'none'})"
        )
    for table, theirs in zip(job.tables, reg.tables):
        diffs = table.differences(theirs)
        if diffs:
            raise PreconditionError(f"table {table.name!r} differs from the job's: " + "; ".join(diffs))


def check_tables(tables: Sequence[TableSpec], parts: Sequence[Part]) -> None:
    """Raises ``InvalidArgumentError`` for a table named twice or named as a variable."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise InvalidArgumentError("registration lists a table twice")
    clash = set(names) & {p.name for p in parts}
    if clash:
        raise InvalidArgumentError(f"{sorted(clash)[0]!r} names both a table and a variable")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
