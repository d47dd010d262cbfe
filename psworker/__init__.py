"""The worker side of the parameter server: connect a PyTorch training loop to the shards.

    import psworker
    session = psworker.connect("127.0.0.1:7000,127.0.0.1:7001")
    model, optimizer = session.prepare(model, optimizer)
    # the loop is unchanged: optimizer.step() pushes gradients and pulls the new weights

Identical workers that share the job's data without indices draw it through
``psworker.ElasticSampler(session, len(dataset), seed=0)`` (``psworker.elastic``).

The trained model leaves as safetensors named by the model's ``state_dict()`` keys
(``psworker.export``): ``psworker --save F``, ``psctl export``, or, from a checkpoint directory
with no shard running, ``model.load_state_dict(psworker.load_checkpoint("/ckpt"))``.

Errors raised are ``pswire.errors`` types (re-exported here): ``PreconditionError`` when the
model or settings disagree with the job, ``InvalidArgumentError`` for bad input,
``UnavailableError`` / ``DeadlineError`` when shards cannot be reached in time,
``UnauthenticatedError`` / ``PermissionDeniedError`` when the shards want a token or TLS client
certificate this worker lacks (``ClientOptions(security=ClientSecurity(...))``), and
``OverloadedError`` when a shard turned a call away (retried with backoff before it is raised).
"""

from __future__ import annotations

import importlib
from typing import Any

from pswire.consistency import Consistency
from pswire.errors import (
    DeadlineError,
    FencedError,
    InvalidArgumentError,
    NotReadyError,
    OverloadedError,
    PermissionDeniedError,
    PreconditionError,
    PSError,
    TooLargeError,
    UnauthenticatedError,
    UnavailableError,
)
from pswire.optim import OptimizerConfig
from pswire.security import ClientSecurity
from psworker.options import ClientOptions

# These need torch, which an operator's tools (psctl) must run without: each is imported on first
# use (PEP 562), so ``import psworker.ctl`` loads none of them.
_LAZY = {
    "DistributedOptimizer": "psworker.api",
    "Session": "psworker.api",
    "connect": "psworker.api",
    "PSClient": "psworker.client",
    "ShardedEmbedding": "psworker.embedding",
    "DataFeed": "psworker.elastic",
    "ElasticSampler": "psworker.elastic",
    "load_checkpoint": "psworker.export",
    "Task": "psworker.tasks",
    "TaskDefaults": "psworker.tasks",
    "evaluate": "psworker.tasks",
    "load_task": "psworker.tasks",
}

__all__ = [
    "ClientOptions",
    "ClientSecurity",
    "Consistency",
    "DataFeed",
    "DeadlineError",
    "DistributedOptimizer",
    "ElasticSampler",
    "FencedError",
    "InvalidArgumentError",
    "NotReadyError",
    "OptimizerConfig",
    "OverloadedError",
    "PSClient",
    "PSError",
    "PermissionDeniedError",
    "PreconditionError",
    "Session",
    "ShardedEmbedding",
    "Task",
    "TaskDefaults",
    "TooLargeError",
    "UnauthenticatedError",
    "UnavailableError",
    "connect",
    "evaluate",
    "load_checkpoint",
    "load_task",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
