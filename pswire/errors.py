"""The parameter server's domain errors, shared by shards and workers.

    PSError
     +-- InvalidArgumentError   bad input: unknown variable, wrong dtype/shape/length, NaN/Inf
     +-- TooLargeError          a request beyond the shard's size limits
     +-- OverloadedError        admission control turned the call away (too many calls or
     |                          streams at once): retry with backoff
     +-- UnauthenticatedError   no credentials, or credentials the shard does not accept
     +-- PermissionDeniedError  credentials whose role may not make this call
     +-- PreconditionError      the job disagrees: mismatching model or settings
     |    +-- FencedError       this worker's registration is void (evicted, left, replaced by a
     |                          newer generation, or unknown to the shard): re-register
     +-- NotReadyError          the shard cannot serve yet (not initialised); retry later
     +-- UnavailableError       a shard cannot be reached (client side, after retries)
     +-- DeadlineError          a call or a wait ran past its deadline (also a ``TimeoutError``)

Shards raise these from the store; the servicer maps them to gRPC status codes in one table and
the worker's client maps ``grpc.RpcError`` back to them in one place.
"""

from __future__ import annotations

__all__ = [
    "DeadlineError",
    "FencedError",
    "InvalidArgumentError",
    "NotReadyError",
    "OverloadedError",
    "PermissionDeniedError",
    "PSError",
    "PreconditionError",
    "TooLargeError",
    "UnauthenticatedError",
    "UnavailableError",
]


class PSError(Exception):
    """Base class of every error this system raises on purpose."""


class InvalidArgumentError(PSError, ValueError):
    """The request is malformed; the shard's state is unchanged."""


class TooLargeError(PSError):
    """The request exceeds a configured size limit; the shard's state is unchanged."""


class OverloadedError(PSError):
    """The shard turned the call away to protect itself (too many calls, streams or waiting
    pulls at once); nothing changed, and a retry after a backoff may succeed."""


class UnauthenticatedError(PSError):
    """The call carried no credentials, or ones the shard does not accept (token, session)."""


class PermissionDeniedError(PSError):
    """The credentials are valid, but their role may not make this call."""


class PreconditionError(PSError):
    """The request disagrees with the job's state (model, settings, membership)."""


class FencedError(PreconditionError):
    """The worker was fenced off (evicted, departed, superseded or unknown): re-register, pull,
    and carry on. Sent as ``ABORTED`` so clients can tell it from other preconditions."""


class NotReadyError(PSError):
    """The shard is not ready to serve this request yet; retrying later may succeed."""


class UnavailableError(PSError):
    """A shard could not be reached."""


class DeadlineError(PSError, TimeoutError):
    """A call or a wait did not finish before its deadline."""
