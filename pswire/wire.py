"""Conversions between domain values and their protobuf messages that both sides use."""

from __future__ import annotations

import dataclasses
from typing import Any

from pswire.consistency import Consistency
from pswire.data import DataPlan, DataTask
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig
from pswire.v1 import ps_pb2

__all__ = [
    "MAX_COUNT", "check_count", "consistency_from_proto", "consistency_to_proto", "data_plan_from_proto",
    "data_plan_to_proto", "data_status_to_proto", "data_task_to_proto", "optimizer_from_proto", "optimizer_to_proto",
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
