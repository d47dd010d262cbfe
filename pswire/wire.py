"""Conversions between domain values and their protobuf messages that both sides use."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pswire.consistency import Consistency
from pswire.data import DataPlan, DataTask
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig
from pswire.tables import TableSpec
from pswire.v1 import ps_pb2

__all__ = [
    "MAX_COUNT", "check_count", "consistency_from_proto", "consistency_to_proto", "data_plan_from_proto",
    "data_plan_to_proto", "data_status_to_proto", "data_task_to_proto", "optimizer_from_proto", "optimizer_to_proto",
    "rows_from_proto", "rows_to_proto", "table_from_proto", "table_to_proto",
]

MAX_COUNT = 1 << 53
"""The largest clock, step, sequence, version or position a shard accepts: far beyond any job
(a step per nanosecond for a century), and small enough that nothing derived from it (a clock
plus one, a sum of counts) leaves protobuf's int64 or a float's exact integers."""


def check_count(what: str, value: int) -> None:
    """Raises ``InvalidArgumentError`` unless ``0 <= value <= MAX_COUNT``."""
    if not 0 <= value <= MAX_COUNT:
        raise InvalidArgumentError(f"{what} {value} is out of range (0..{MAX_COUNT})")


def optimizer_to_proto(config: OptimizerConfig) -> ps_pb2.OptimizerSettings:
    return ps_pb2.OptimizerSettings(**dataclasses.asdict(config))


def optimizer_from_proto(msg: ps_pb2.OptimizerSettings) -> OptimizerConfig:
    """Raises ``InvalidArgumentError`` naming the bad setting."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(OptimizerConfig)}
    try:
        return OptimizerConfig(**values)
    except ValueError as exc:
        raise InvalidArgumentError(f"optimizer settings: {exc}") from None


def consistency_to_proto(c: Consistency) -> ps_pb2.ConsistencySettings:
    return ps_pb2.ConsistencySettings(
        mode=c.mode.value, staleness=c.staleness, backup_workers=c.backup_workers,
        stale_policy=c.stale_policy.value,
    )


def consistency_from_proto(msg: ps_pb2.ConsistencySettings) -> Consistency:
    """An unset message means async. Raises ``InvalidArgumentError`` naming the bad setting."""
    try:
        return Consistency(
            mode=msg.mode or "async", staleness=msg.staleness, backup_workers=msg.backup_workers,
            stale_policy=msg.stale_policy or "drop",
        )
    except ValueError as exc:
        raise InvalidArgumentError(f"consistency settings: {exc}") from None


def data_plan_to_proto(plan: DataPlan) -> ps_pb2.DataPlan:
    return ps_pb2.DataPlan(**plan.to_dict())


def data_plan_from_proto(msg: ps_pb2.DataPlan) -> DataPlan:
    """Raises ``InvalidArgumentError`` naming the field out of range."""
    return DataPlan(examples=msg.examples, task_size=msg.task_size, seed=msg.seed, total=msg.total)


def data_task_to_proto(task: DataTask, trained: int = 0) -> ps_pb2.DataTask:
    return ps_pb2.DataTask(epoch=task.epoch, start=task.start, end=task.end, trained=trained)


def data_status_to_proto(status: dict[str, Any]) -> ps_pb2.DataQueueStatus:
    """``DataQueue.status()`` as its message."""
    fields = {k: v for k, v in status.items() if k not in ("holders", "plan")}
    return ps_pb2.DataQueueStatus(
        **fields, plan=data_plan_to_proto(status["plan"]),
        holders=[ps_pb2.DataHolder(worker_name=name, generation=generation, task=data_task_to_proto(task))
                 for name, generation, task in status["holders"]],
    )


def table_to_proto(spec: TableSpec) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(name=spec.name, num_rows=spec.num_rows, dim=spec.dim,
                            optimizer=optimizer_to_proto(spec.optimizer), init=spec.init,
                            init_scale=spec.init_scale, seed=spec.seed)


def table_from_proto(msg: ps_pb2.TableSpec) -> TableSpec:
    """Raises ``InvalidArgumentError`` naming the bad setting."""
    optimizer = optimizer_from_proto(msg.optimizer)
    try:
        return TableSpec(name=msg.name, num_rows=msg.num_rows, dim=msg.dim, optimizer=optimizer, init=msg.init,
                         init_scale=msg.init_scale, seed=msg.seed)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def rows_to_proto(table: str, ids: np.ndarray, values: np.ndarray | None = None, *, add_to=None) -> ps_pb2.RowBlock:
    """A ``RowBlock`` of int64 ``ids`` and, for a push or a reply, their float32 ``values``;
    made in place as the next block of ``add_to`` (a repeated ``RowBlock`` field) when given,
    rather than made apart and copied in."""
    block = ps_pb2.RowBlock() if add_to is None else add_to.add()
    block.table, block.ids = table, np.ascontiguousarray(ids, dtype="<i8").tobytes()
    if values is not None:
        block.values = np.ascontiguousarray(values, dtype="<f4").tobytes()
    return block


def rows_from_proto(block: ps_pb2.RowBlock, dim: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """``(ids, values)`` of a ``RowBlock`` as read-only views of its bytes (``values`` None when
    ``dim`` is None: a pull's request). Raises ``InvalidArgumentError`` when the sizes disagree."""
    if len(block.ids) % 8:
        raise InvalidArgumentError(f"rows of table {block.table!r}: {len(block.ids)} bytes of ids, not a whole "
                                   "number of int64")
    ids = np.frombuffer(block.ids, dtype="<i8")
    if dim is None:
        if block.values:
            raise InvalidArgumentError(f"rows of table {block.table!r}: a pull's request carries no values")
        return ids, None
    expected = ids.size * dim * 4
    if len(block.values) != expected:
        raise InvalidArgumentError(
            f"rows of table {block.table!r}: {len(block.values)} bytes of values for {ids.size} ids of {dim} "
            f"float32 each ({expected} bytes)"
        )
    return ids, np.frombuffer(block.values, dtype="<f4").reshape(ids.size, dim)
