"""Conversions between domain values and their protobuf messages that both sides use."""

from __future__ import annotations

import dataclasses

from pswire.consistency import Consistency
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig
from pswire.v1 import ps_pb2

__all__ = ["consistency_from_proto", "consistency_to_proto", "optimizer_from_proto", "optimizer_to_proto"]


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
