"""One shard's gRPC channel, ``ShardChannel``: its options and credentials (TLS, bearer token:
``ClientOptions.security``), waiting for the connection and saying why it does not come, and the
calls that move no tensors (status, checkpoint, end-job, the standard health check).

It imports no torch, so that ``psctl`` runs in an image without it; ``psworker.shard.ShardClient``
adds the tensor traffic on top. Every ``grpc.RpcError`` caught becomes a ``pswire.errors`` error
through ``psworker.retry.translate``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from pswire import errors
from pswire.security import host_of
from pswire.v1 import ps_pb2, ps_pb2_grpc
from psworker.options import ClientOptions
from psworker.retry import REPORT_EVERY, retrying, translate, unreachable

__all__ = ["KEEPALIVE_MS", "SERVICE", "ShardChannel", "ShardHealth"]

log = logging.getLogger(__name__)

SERVICE = "pswire.v1.ParameterServer"
_MESSAGE_LIMIT = 64 << 20
KEEPALIVE_MS = 5000
"""Interval of the client's keepalive pings (psserver permits one per second at most)."""

# Only reads and the idempotent join are retried by the channel; a push is never replayed
# blindly (it would apply twice).
_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": SERVICE, "method": m} for m in ("Register", "Pull", "Status", "Leave")],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.2s",
            "maxBackoff": "3s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
})

_FIRST_REPORT = 1.0
"""Seconds ``ShardChannel.wait_connected`` waits in silence before it says why the shard does not
answer (a shard that is up answers within milliseconds)."""
_PROBE_TIMEOUT = 2.0
"""Deadline of the health check that finds out why a shard does not answer."""

_UNREACHABLE = "UNREACHABLE"
_FAILED = "FAILED"


@dataclass(frozen=True)
class ShardHealth:
    """One shard's answer to the standard health check (``psctl health``)."""

    address: str
    status: str
    """The health service's word for the server as a whole (``SERVING``, ``NOT_SERVING``, ...);
    ``UNREACHABLE`` when no answer came, ``FAILED`` when the check itself was refused."""
    reason: str = ""
    """Why it is not ``SERVING`` when the status alone does not say (connection refused, no
    answer in time, a failed TLS handshake, the refusal's words); empty otherwise."""

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"


class ShardChannel:
    """A channel to one shard and its calls that move no tensors. Every call has a deadline;
    errors are ``pswire.errors`` types.

    No call waits for the connection (``wait_for_ready``): once :meth:`wait_connected` has
    found the shard, a call to a shard that went away fails at once as ``UnavailableError``
    ("shard H:P unreachable: connection refused"), and the retrying caller decides how long to
    keep trying (``psworker.retry.retrying``), instead of each attempt waiting out its whole
    deadline."""

    def __init__(self, address: str, options: ClientOptions) -> None:
        self.address = address
        self.options = options
        security = options.security
        credentials = security.channel_credentials() if security is not None else None
        self._metadata = security.metadata() if security is not None else None
        """Sent with every call and stream (the token): call credentials would need TLS."""
        channel_options = [
            ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
            ("grpc.max_send_message_length", _MESSAGE_LIMIT),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", _SERVICE_CONFIG),
            # Reconnect quickly to a shard that restarts (the default backoff grows to 2 min).
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
            # Find a connection that went dead (a partition) by pings, rather than waiting out
            # TCP's retransmission backoff once the network heals; the shards allow this rate.
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if credentials is not None:
            self._channel = grpc.secure_channel(address, credentials, options=channel_options)
        else:
            self._channel = grpc.insecure_channel(address, options=channel_options)
        self._stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        # An empty HealthCheckRequest asks about the server as a whole.
        self._health_check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

    def wait_connected(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the shard to accept a connection (it may still be
        starting). Says why not after a second (nothing answers, the name does not resolve, a
        failed TLS handshake) and again every ``REPORT_EVERY`` seconds. Raises
        ``UnavailableError`` naming the address and the reason."""
        ready = grpc.channel_ready_future(self._channel)
        started = time.monotonic()
        deadline = started + timeout
        report_at = started + _FIRST_REPORT
        why: str | None = None
        try:
            while True:
                try:
                    ready.result(timeout=max(0.0, min(report_at, deadline) - time.monotonic()))
                except grpc.FutureTimeoutError:
                    pass
                else:
                    if why is not None:
                        log.info("shard %s answers (after %.0fs)", self.address, time.monotonic() - started)
                    return
                why = self._diagnose(max(0.1, min(_PROBE_TIMEOUT, deadline - time.monotonic()))) or why
                now = time.monotonic()
                if now >= deadline:
                    raise errors.UnavailableError(
                        f"shard {self.address} did not accept a connection within {timeout:.0f}s: {self._explain(why)}"
                    ) from None
                if why is not None and report_at == started + _FIRST_REPORT:
                    explained = self._explain(why, first=True)
                    log.warning("%s%s up to %.0fs more for it to start", explained,
                                " Waiting" if explained.endswith("?") else "; waiting", deadline - now)
                elif why is not None:
                    log.info("still waiting for shard %s (%s) after %.0fs; up to %.0fs more", self.address, why,
                             now - started, deadline - now)
                report_at = now + REPORT_EVERY
        finally:
            ready.cancel()

    def _probe(self, timeout: float) -> tuple[health_pb2.HealthCheckResponse | None, grpc.StatusCode | None, str]:
        """One standard health check within ``timeout`` seconds that neither waits for the
        connection nor carries a token (the health service is open): ``(reply, None, "")``, or
        ``(None, code, details)`` of the error."""
        try:
            return self._health_check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=False), None, ""
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            return None, code, exc.details() if hasattr(exc, "details") else str(exc)

    def health(self, timeout: float) -> ShardHealth:
        """The shard's status from one health check (:meth:`_probe`), not retried. Raises nothing
        for a shard that cannot be reached: the report says why."""
        reply, code, details = self._probe(timeout)
        if reply is not None:
            return ShardHealth(self.address, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return ShardHealth(self.address, _UNREACHABLE, f"no answer within {timeout:g}s")
        why = unreachable(details) if code is grpc.StatusCode.UNAVAILABLE else None
        if why is not None:
            # Refused needs no advice; anything else (TLS, a name) gets what to check.
            return ShardHealth(self.address, _UNREACHABLE, why if why == "connection refused" else self._explain(why))
        return ShardHealth(self.address, _FAILED, f"{details} ({code.name})")

    def _diagnose(self, timeout: float) -> str | None:
        """Why the shard cannot be reached, from one health check (:meth:`_probe`; gRPC's reason:
        "connection refused", ...); None when it answers, if only to refuse the call."""
        _reply, code, details = self._probe(timeout)
        if code is grpc.StatusCode.UNAVAILABLE:
            return unreachable(details) or details
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {timeout:.0f}s"
        return None

    def _explain(self, why: str | None, *, first: bool = False) -> str:
        """``why`` (``_diagnose``) as the sentence a user reads, with what to check."""
        if why == "connection refused":
            if first:
                return f"nothing answers at {self.address} (connection refused): is psserver running there?"
            return f"nothing answers there (connection refused): is psserver running at {self.address}?"
        prefix = f"shard {self.address} unreachable: " if first else ""
        if why is not None and "does not resolve" in why:
            return f"{prefix}{why}: check the host in --ps ({host_of(self.address)})"
        security = self.options.security
        if security is not None and security.tls:
            hint = (f"check that --tls-ca signed the shard's certificate, that the certificate names "
                    f"{host_of(self.address)}, that the shard serves TLS, and give --tls-cert/--tls-key if it "
                    "requires client certificates")
        else:
            hint = "if the shard serves TLS, give --tls-ca (and --tls-cert/--tls-key for mutual TLS)"
        return f"{prefix}{why or 'no connection'} ({hint})"

    def _call(self, method, request, *, nbytes: int = 0, timeout: float | None = None):
        try:
            return method(
                request, timeout=self.options.deadline(nbytes) if timeout is None else timeout,
                wait_for_ready=False, metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise translate(exc, self.address) from exc

    def status(self) -> ps_pb2.StatusResponse:
        """The shard's status; retried while the shard turns it away as overloaded, for up to
        one small call's deadline (``options.timeout``)."""
        return retrying(lambda: self._call(self._stub.Status, ps_pb2.StatusRequest()), self.options, self.address,
                        "status", retry=(errors.OverloadedError,), within=self.options.timeout)

    def checkpoint(self, request: ps_pb2.CheckpointRequest) -> ps_pb2.CheckpointResponse:
        """Retried only while the shard turns it away as overloaded (it then never started)."""
        return retrying(lambda: self._call(self._stub.Checkpoint, request), self.options, self.address,
                        "checkpoint", retry=(errors.OverloadedError,), within=self.options.timeout)

    def end_job(self, request: ps_pb2.EndJobRequest) -> ps_pb2.EndJobResponse:
        """Retried only while the shard turns it away as overloaded (it then never started)."""
        return retrying(lambda: self._call(self._stub.EndJob, request), self.options, self.address,
                        "end-job", retry=(errors.OverloadedError,), within=self.options.timeout)

    def close(self) -> None:
        self._channel.close()
