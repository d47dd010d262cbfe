"""Conversions between domain values and their protobuf messages that both sides use."""

from __future__ import annotations

import dataclasses

from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig
from pswire.v1 import ps_pb2

__all__ = ["optimizer_from_proto", "optimizer_to_proto"]


def optimizer_to_proto(config: OptimizerConfig) -> ps_pb2.OptimizerSettings:
    return ps_pb2.OptimizerSettings(**dataclasses.asdict(config))


def optimizer_from_proto(msg: ps_pb2.OptimizerSettings) -> OptimizerConfig:
    """Raises ``InvalidArgumentError`` naming the bad setting."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(OptimizerConfig)}
    try:
        return OptimizerConfig(**values)
    except ValueError as exc:
        raise InvalidArgumentError(f"optimizer settings: {exc}") from None
