"""The worker side of the parameter server: connect a PyTorch training loop to the shards.

    import psworker
    session = psworker.connect("127.0.0.1:7000,127.0.0.1:7001")
    model, optimizer = session.prepare(model, optimizer)
    # the loop is unchanged: optimizer.step() pushes gradients and pulls the new weights

Errors raised are ``pswire.errors`` types (re-exported here): ``PreconditionError`` when the
model or settings disagree with the job, ``InvalidArgumentError`` for bad input,
``UnavailableError`` / ``DeadlineError`` when shards cannot be reached in time.
"""

from pswire.errors import (
    DeadlineError,
    FencedError,
    InvalidArgumentError,
    NotReadyError,
    PreconditionError,
    PSError,
    TooLargeError,
    UnavailableError,
)
from pswire.consistency import Consistency
from pswire.optim import OptimizerConfig
from psworker.api import DistributedOptimizer, Session, connect
from psworker.client import ClientOptions, PSClient
from psworker.tasks import Task, TaskDefaults, evaluate, load_task

__all__ = [
    "ClientOptions",
    "Consistency",
    "DeadlineError",
    "DistributedOptimizer",
    "FencedError",
    "InvalidArgumentError",
    "NotReadyError",
    "OptimizerConfig",
    "PSClient",
    "PSError",
    "PreconditionError",
    "Session",
    "Task",
    "TaskDefaults",
    "TooLargeError",
    "UnavailableError",
    "connect",
    "evaluate",
    "load_task",
]
