"""How a worker's call to a shard fails and when it is tried again.

``translate`` is the one place on the worker where a ``grpc.RpcError`` becomes a
``pswire.errors`` error: by status code (``_CODE_TO_ERROR``), telling a shard's admission
control (``OverloadedError``) from a request too large (``TooLargeError``), and with a reason a
user can act on: why gRPC could not reach the shard (``unreachable``: "connection refused", a
name that does not resolve, a failed TLS handshake) rather than its raw details, and which token
to give when a shard refused one.

``retrying`` decides how long a call is tried again: while its errors are transient
(``TRANSIENT``: the shard is unreachable, too slow, or turned the call away as overloaded), for
a budget of seconds (``ClientOptions.retry_timeout``) spent on attempts a couple of seconds apart
with jittered exponential backoff, after which it raises the last error naming the shard, the
reason, since when and how many attempts were made. The channel's own transparent retries of
reads (``psworker.channel``'s service config) happen below this and are not seen here.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import TYPE_CHECKING

import grpc

from pswire import errors
from pswire.security import TOKEN_ENV

if TYPE_CHECKING:
    from psworker.options import ClientOptions

__all__ = ["REPORT_EVERY", "TRANSIENT", "retrying", "translate", "unreachable"]

log = logging.getLogger(__name__)

_CODE_TO_ERROR: dict[grpc.StatusCode, type[errors.PSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.TooLargeError,  # OverloadedError when retryable: translate
    grpc.StatusCode.UNAUTHENTICATED: errors.UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDeniedError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.PreconditionError,
    grpc.StatusCode.ABORTED: errors.FencedError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineError,
}

_RETRYABLE = ("ps-retryable", "1")
"""Trailing metadata of a RESOURCE_EXHAUSTED that is the shard's admission control."""
_GRPC_OVERLOAD = "Concurrent RPC limit exceeded"
"""gRPC's own refusal beyond the server's ``maximum_concurrent_rpcs`` (no metadata)."""
_HINTS = {
    errors.UnauthenticatedError: f"give the shard's token with --token-file FILE or the {TOKEN_ENV} environment "
                                 "variable (in code: ClientOptions(security=ClientSecurity(token=...)))",
    errors.PermissionDeniedError: f"use a token of the role named (--token-file FILE or {TOKEN_ENV})",
}

TRANSIENT = (errors.UnavailableError, errors.DeadlineError, errors.OverloadedError)

_MAX_BACKOFF = 2.0
"""Longest pause between attempts at a shard that is unreachable or slow: the channel's own
reconnection backoff (``grpc.max_reconnect_backoff_ms``), so that a restarted shard is found
again within a few seconds."""
_MAX_OVERLOAD_BACKOFF = 5.0
"""Longest pause after a shard turned a call away as overloaded (longer: the callers it turned
away together spread out)."""
REPORT_EVERY = 15.0
"""Seconds between the warnings that a shard is still unreachable while a call keeps retrying,
or still does not answer while a worker waits to connect."""


def retrying(call, options: ClientOptions, address: str, what: str,
             retry: tuple[type[errors.PSError], ...] = TRANSIENT, within: float | None = None):
    """Run ``call`` until it succeeds, retrying with backoff while the shard is unreachable,
    does not answer in time (a restart, a partition) or turns the call away as overloaded (the
    errors in ``retry``), for up to ``within`` seconds (default ``options.retry_timeout``). A
    retried push carries the same sequence number, so a shard that did apply it acknowledges it
    again instead of applying it twice; an overloaded call never ran at all.

    Calls to an unreachable shard fail at once (no ``wait_for_ready``), so the budget is spent
    on attempts a couple of seconds apart rather than on one call's deadline. Raises the last
    error's type once the budget is spent, naming the shard, the reason, since when it has
    failed and how many attempts were made."""
    within = options.retry_timeout if within is None else within
    started = time.monotonic()
    deadline = started + within
    since = 0.0  # the first failure's wall-clock time, as the logs show time
    backoff = 0.1
    attempts = 0
    reported = started
    while True:
        attempts += 1
        try:
            result = call()
        except retry as exc:
            overloaded = isinstance(exc, errors.OverloadedError)
            now = time.monotonic()
            if attempts == 1:
                since = time.time()
            if now >= deadline:
                raise type(exc)(
                    f"{exc} since {_clock(since)}; giving up on {what} after {now - started:.0f}s "
                    f"({attempts} attempt{'s' if attempts > 1 else ''})"
                ) from exc
            # Jitter, so that the callers an overloaded shard turned away together do not return
            # together; the last attempt comes when the budget runs out.
            pause = min(backoff * random.uniform(0.5, 1.0), deadline - now)
            if overloaded:
                log.info("%s to %s failed (%s); retrying in %.2fs", what, address, exc, pause)
            elif attempts == 1:
                log.warning("%s to %s failed (%s); retrying for up to %.0fs", what, address, exc, deadline - now)
            elif now - reported >= REPORT_EVERY:
                reported = now
                log.warning("%s to %s still failing (%s since %s, %d attempts); retrying for %.0fs more",
                            what, address, exc, _clock(since), attempts, deadline - now)
            else:
                log.debug("%s to %s failed (%s); retrying in %.2fs", what, address, exc, pause)
            if options.on_retry is not None:
                options.on_retry(what)
            threading.Event().wait(pause)  # a plain timed wait; nothing can end it early
            backoff = min(backoff * 2, _MAX_OVERLOAD_BACKOFF if overloaded else _MAX_BACKOFF)
        else:
            if attempts > 1:
                log.info("%s to %s went through after %.1fs and %d attempts", what, address,
                         time.monotonic() - started, attempts)
            return result


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


_CONNECTION_FAILURES = (
    ("connection refused", "connection refused"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network unreachable"),
    ("domain name not found", "its host name does not resolve"),
    ("errors resolving", "its host name does not resolve"),
    ("handshake", "TLS handshake failed"),
    ("connection reset", "connection reset"),
    ("socket closed", "connection lost"),
    ("broken pipe", "connection lost"),
    ("connection timed out", "connection timed out"),
    ("failed to connect to all addresses", "cannot connect"),
)
"""Pieces of gRPC's own UNAVAILABLE details (the C core's, never a shard's) and what they mean,
first match wins: gRPC says "failed to connect to all addresses; last error: ... Connection
refused"."""


def unreachable(details: str) -> str | None:
    """Why gRPC could not reach a shard, from an UNAVAILABLE's details; None when the shard
    itself sent it (it is reachable: "not initialised", a lease not yet expired, ...)."""
    lower = (details or "").lower()
    for piece, reason in _CONNECTION_FAILURES:
        if piece in lower:
            # A TLS failure or an unknown one keeps gRPC's words: they say which certificate, say.
            return reason if reason not in ("TLS handshake failed", "cannot connect") else f"{reason} ({details})"
    return None


def _overloaded(exc: grpc.RpcError, details: str) -> bool:
    """Whether a RESOURCE_EXHAUSTED is admission control (retry later), not a request too large."""
    try:
        trailing = exc.trailing_metadata() or ()
    except (AttributeError, ValueError):
        trailing = ()
    return any(tuple(item) == _RETRYABLE for item in trailing) or _GRPC_OVERLOAD in (details or "")


def translate(exc: grpc.RpcError, address: str) -> errors.PSError:
    """The ``pswire.errors`` error that stands for ``exc``, a failed call to the shard at
    ``address``, for the caller to raise ``from exc``; it raises nothing itself."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _CODE_TO_ERROR.get(code, errors.PSError)
    if cls is errors.TooLargeError and _overloaded(exc, details):
        cls = errors.OverloadedError
    reason = unreachable(details) if code is grpc.StatusCode.UNAVAILABLE else None
    if reason is not None:
        return cls(f"shard {address} unreachable: {reason}")
    # Only a refused token gets the hint (UNAUTHENTICATED also answers a wrong session secret).
    hint = _HINTS.get(cls) if "token" in (details or "") else None
    return cls(f"shard {address}: {details} ({code.name})" + (f"; {hint}" if hint else ""))
