"""What guards every call a shard serves, below the servicer's translation: requests that do not
decode, exceptions no handler mapped, and client streams that stop sending.

- A request protobuf cannot parse decodes to an :class:`Undecodable` (``tolerant``), which the
  :class:`CallGuard` answers with INVALID_ARGUMENT: an exception from a deserialiser would make
  gRPC log a traceback per request and answer INTERNAL.
- Any exception a handler did not map to a status is INTERNAL with its type and message (a
  traceback logged at most once a minute), never gRPC's UNKNOWN.
- :class:`IdleStreams` cancels a client stream that sent nothing for a while, which frees the
  handler thread it held.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

__all__ = ["CallGuard", "IdleStreams", "Undecodable", "aborted", "tolerant"]

log = logging.getLogger(__name__)


class Undecodable:
    """What a request that protobuf cannot parse decodes to: the handler answers it with
    INVALID_ARGUMENT. (An exception from a deserialiser would make gRPC log a traceback per
    request and answer INTERNAL.)"""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def tolerant(decode: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """``decode``, returning an :class:`Undecodable` instead of raising."""
    def tolerant(raw: bytes) -> object:
        try:
            return decode(raw)
        except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
            return Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

    return tolerant


_UNEXPECTED_LOG_EVERY = 60.0
"""Seconds between tracebacks of unexpected handler errors (each is still answered INTERNAL)."""


class CallGuard:
    """Wraps every handler: an undecodable request is INVALID_ARGUMENT, and an exception no
    handler mapped is INTERNAL with its type and message (a traceback logged at most once a
    minute), never gRPC's UNKNOWN."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged_at = float("-inf")
        self.unexpected = 0

    def _unexpected(self, method: str, exc: BaseException, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.unexpected += 1
            now = time.monotonic()
            loud = now - self._logged_at >= _UNEXPECTED_LOG_EVERY
            if loud:
                self._logged_at = now
        if loud:
            log.error("%s failed unexpectedly (%d so far; tracebacks at most once a minute)", method,
                      self.unexpected, exc_info=exc)
        context.abort(grpc.StatusCode.INTERNAL, f"{method} failed on the shard: {type(exc).__name__}: {exc}")

    def _refuse_undecodable(self, method: str, request, context: grpc.ServicerContext) -> None:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {method} request: {request.reason}")

    def _failed(self, method: str, exc: Exception, context: grpc.ServicerContext) -> None:
        """Re-raise an abort, or the error of a call that is no longer active (cancelled by the
        client, or cut when idle: gRPC ends it quietly); anything else is unexpected."""
        if aborted(context) or not context.is_active():
            raise exc
        self._unexpected(method, exc, context)

    def unary(self, method: str, behavior):
        @functools.wraps(behavior)
        def guarded(request, context):
            self._refuse_undecodable(method, request, context)
            try:
                return behavior(request, context)
            except Exception as exc:
                self._failed(method, exc, context)

        return guarded

    def streaming(self, method: str, behavior):
        @functools.wraps(behavior)
        def guarded(request, context):
            self._refuse_undecodable(method, request, context)
            try:
                yield from behavior(request, context)
            except Exception as exc:
                self._failed(method, exc, context)

        return guarded


def aborted(context: grpc.ServicerContext) -> bool:
    """Whether the handler already ended the call with a status (``context.abort`` raises)."""
    try:
        return context.code() is not None
    except (AttributeError, NotImplementedError):
        return False


class IdleStreams:
    """Cuts client streams that stop sending: a stream whose handler has waited longer than
    ``timeout`` seconds for its next message is cancelled, which frees the handler thread (16
    idle Push streams once held every thread of a shard, and heartbeats timed out behind them).
    One watchdog thread serves every stream; 0 disables it."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()  # guards _waiting
        self._waiting: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def watch(self, messages: Iterator, context: grpc.ServicerContext | None) -> Iterator:
        """``messages``, noting when the handler waits for the next one."""
        if not self.timeout or context is None:
            yield from messages
            return
        self._start()
        key = id(context)
        try:
            while True:
                with self._lock:
                    self._waiting[key] = (time.monotonic(), context)
                try:
                    message = next(messages)
                except StopIteration:
                    return
                finally:
                    with self._lock:
                        self._waiting.pop(key, None)
                yield message
        finally:
            with self._lock:
                self._waiting.pop(key, None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="psserver-idle-streams", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stopped.wait(timeout=period):
            now = time.monotonic()
            with self._lock:
                idle = [(k, c) for k, (since, c) in self._waiting.items() if now - since > self.timeout]
                for key, _ in idle:
                    del self._waiting[key]
            for _, context in idle:
                log.warning("cut a client stream that sent nothing for %.0fs (--stream-idle-timeout)", self.timeout)
                context.cancel()

    def stop(self) -> None:
        self._stopped.set()
