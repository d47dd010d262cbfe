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
from pswire.consistency import Consistency
from pswire.optim import OptimizerConfig
from pswire.security import ClientSecurity
from psworker.api import DistributedOptimizer, Session, connect
from psworker.client import ClientOptions, PSClient
from psworker.elastic import DataFeed, ElasticSampler
from psworker.export import load_checkpoint
from psworker.tasks import Task, TaskDefaults, evaluate, load_task

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
