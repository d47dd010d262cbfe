"""One shard's gRPC stub, ``ShardClient``, with its deadlines, credentials (TLS, bearer token:
``ClientOptions.security``) and bulk lanes. Every ``grpc.RpcError`` it catches becomes a
``pswire.errors`` error through ``psworker.retry.translate``, which with ``retrying`` decides
what is retried and for how long.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from pswire import errors, frames
from pswire.dtypes import dtype_of
from pswire.lanes import LaneError
from pswire.security import ClientSecurity, host_of
from pswire.codec import (
    DEFAULT_CHUNK_BYTES, WIRE_DTYPES, ChunkAssembler, Part, on_wire, wire_dtype_from_proto,
)
from pswire.v1 import ps_pb2, ps_pb2_grpc
from psworker.lanes import Lane, LanePool
from psworker.retry import REPORT_EVERY, retrying, translate, unreachable
from psworker.tensors import tensor_bytes, torch_dtype

__all__ = ["KEEPALIVE_MS", "SERVICE", "ClientOptions", "ClientSecurity", "ShardClient", "parse_addresses"]

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


def parse_addresses(spec: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` (or a list) to a list of addresses; raises ``ValueError`` if malformed."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = [a.strip() for a in items if a.strip()]
    if not out:
        raise ValueError("no parameter-server address given (expected HOST:PORT[,HOST:PORT...])")
    for address in out:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad parameter-server address {address!r}: expected HOST:PORT")
    if len(set(out)) != len(out):
        raise ValueError(f"a parameter-server address is listed twice in {out}")
    return out


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    timeout: float = 30.0
    """Deadline of a small RPC in seconds; large transfers get ``bytes / min_bandwidth`` more."""
    min_bandwidth: float = 20e6
    """Bytes per second a transfer is assumed to reach at worst, to size its deadline."""
    connect_timeout: float = 60.0
    """Seconds to wait for every shard to accept a connection."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Size of the chunks a push or initialisation is cut into."""
    wait_timeout: float = 600.0
    """Seconds a pull may wait on the staleness bound (ssp/sync) before failing."""
    retry_timeout: float = 120.0
    """Seconds a push or pull keeps retrying an unreachable shard (e.g. one being restarted)."""
    wire_dtype: Any = None
    """Wire compression: send floating-point gradients and pull weights in this dtype
    (``torch.bfloat16`` or ``torch.float16``, or the ``pswire.dtypes`` of the same names, which
    it becomes; the shards keep and update full precision).
    Halves the bytes moved; the weights a worker computes with are rounded to it."""
    inline_bytes: int = 256 << 10
    """Pushes and pulls of at most this many bytes to one shard go in a single message
    (PushInline / PullInline) instead of a stream, which costs a round of thread hand-offs
    per call; 0 always streams."""
    bulk: bool = True
    """Send the bytes of larger pushes and pulls on the shard's bulk lanes (plain TCP beside the
    gRPC call, ``pswire.lanes``) when it offers them; False: every byte goes through gRPC."""
    security: ClientSecurity | None = None
    """TLS (the shards' CA; a client certificate for mutual TLS) and the bearer token every call
    carries; None: plaintext without a token."""
    on_retry: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    """Called with what is retried (``"push"``, ``"pull"``, ...) each time a call is retried
    after the shard was unreachable, too slow or overloaded (a hook for metrics; it must not
    raise). The channel's own transparent retries of reads are not seen here."""
    on_exchange: Callable[[float, float, float], None] | None = field(default=None, compare=False, repr=False)
    """Called after each ``PSClient`` push, pull and push-and-pull with its seconds split into
    ``(push, pull, wait)`` (see ``PSClient``; a hook for metrics; it must not raise)."""

    def __post_init__(self) -> None:
        if min(self.timeout, self.min_bandwidth, self.connect_timeout, self.wait_timeout, self.retry_timeout) <= 0:
            raise ValueError("timeouts and min_bandwidth must be > 0")
        if not 1024 <= self.chunk_bytes < (4 << 20):
            raise ValueError("chunk_bytes must be between 1 KiB and 4 MiB")
        if not 0 <= self.inline_bytes <= (4 << 20):
            raise ValueError("inline_bytes must be between 0 and 4 MiB")
        if self.wire_dtype is not None:
            try:
                wire = dtype_of(self.wire_dtype)
            except errors.InvalidArgumentError:
                wire = None
            if wire not in WIRE_DTYPES.values():
                raise ValueError(f"wire_dtype must be None, torch.bfloat16 or torch.float16, got {self.wire_dtype}")
            object.__setattr__(self, "wire_dtype", wire)

    def deadline(self, nbytes: int) -> float:
        return self.timeout + nbytes / self.min_bandwidth


_FIRST_REPORT = 1.0
"""Seconds ``ShardClient.wait_connected`` waits in silence before it says why the shard does not
answer (a shard that is up answers within milliseconds)."""
_PROBE_TIMEOUT = 2.0
"""Deadline of the health check that finds out why a shard does not answer."""
_LEAVE_TIMEOUT = 5.0
"""Deadline of a Leave (at most ``ClientOptions.timeout``): it runs on the way out, and a shard
that does not answer it evicts the worker when its lease runs out anyway."""


class ShardClient:
    """Calls to one shard. Every call has a deadline; errors are ``pswire.errors`` types.

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
        self.session: tuple[int, int, bytes] | None = None
        """(worker id, generation, session secret) of this worker's registration on the shard,
        set by ``PSClient`` after Register; a bulk lane proves it when it opens."""
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
        host = host_of(address)
        self.lanes = LanePool(
            host, enabled=options.bulk, ssl_context=security.ssl_context() if security is not None else None,
            server_hostname=host, credentials=lambda: self.session,
        )
        self._narrow: dict[Part, torch.Tensor] = {}
        """Reused receive buffers of compressed parts (see ``ClientOptions.wire_dtype``)."""
        self._parts: dict[tuple, Part] = {}
        """Parts as the shard's pull headers describe them (``_part``)."""
        # The bulk methods with the chunk codecs of pswire.frames (the same bytes on the wire).
        path = f"/{SERVICE}/"
        self._push_stream = self._channel.stream_unary(
            path + "Push", request_serializer=frames.serialize,
            response_deserializer=ps_pb2.PushResponse.FromString, _registered_method=True,
        )
        self._initialize_stream = self._channel.stream_unary(
            path + "Initialize", request_serializer=frames.serialize,
            response_deserializer=ps_pb2.InitializeResponse.FromString, _registered_method=True,
        )
        # The standard health check, as raw bytes (an empty HealthCheckRequest asks about the
        # server as a whole): ``_diagnose`` needs only gRPC's reason when it fails.
        self._health_check = self._channel.unary_unary("/grpc.health.v1.Health/Check")
        self._pull_stream = self._channel.unary_stream(
            path + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
            response_deserializer=frames.decoder(ps_pb2.PullMessage), _registered_method=True,
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

    def _diagnose(self, timeout: float) -> str | None:
        """Why the shard cannot be reached, from one health check that does not wait for the
        connection (gRPC's reason: "connection refused", ...); None when it answers."""
        try:
            self._health_check(b"", timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code is grpc.StatusCode.UNAVAILABLE:
                return unreachable(exc.details()) or exc.details()
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer within {timeout:.0f}s"
        return None  # answered, if only to refuse the call: it is reachable

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

    def register(self, request: ps_pb2.RegisterRequest) -> ps_pb2.RegisterResponse:
        reply = self._call(self._stub.Register, request)
        self.lanes.set_port(reply.bulk_port)
        return reply

    def status(self) -> ps_pb2.StatusResponse:
        """The shard's status; retried while the shard turns it away as overloaded, for up to
        one small call's deadline (``options.timeout``)."""
        return retrying(lambda: self._call(self._stub.Status, ps_pb2.StatusRequest()), self.options, self.address,
                        "status", retry=(errors.OverloadedError,), within=self.options.timeout)

    def _stream(
        self, header: ps_pb2.TensorHeader, buffers: Sequence[memoryview]
    ) -> Iterator[ps_pb2.TensorMessage | bytes]:
        yield ps_pb2.TensorMessage(header=header)
        step = self.options.chunk_bytes
        for index, buf in enumerate(buffers):
            for offset in range(0, len(buf), step):
                yield frames.encode_chunk(index, offset, buf[offset : offset + step])

    def initialize(self, header: ps_pb2.TensorHeader, buffers: Sequence[memoryview]) -> ps_pb2.InitializeResponse:
        nbytes = sum(len(b) for b in buffers)
        return self._call(self._initialize_stream, self._stream(header, buffers), nbytes=nbytes)

    def push(self, header: ps_pb2.TensorHeader, buffers: Sequence[memoryview]) -> ps_pb2.PushResponse:
        """Up to ``inline_bytes`` in one message; beyond, on a bulk lane, or else as a stream."""
        nbytes = sum(len(b) for b in buffers)
        if nbytes <= self.options.inline_bytes:
            request = ps_pb2.InlinePush(header=header, data=[bytes(b) for b in buffers])
            return self._call(self._stub.PushInline, request, nbytes=nbytes)
        lane = self.lanes.take()
        if lane is None:
            return self._call(self._push_stream, self._stream(header, buffers), nbytes=nbytes)
        token = lane.next_token()
        request = ps_pb2.InlinePush(header=header, bulk=ps_pb2.BulkRef(lane=lane.lane_id, token=token, nbytes=nbytes))
        reply, _ = self._on_lane(lane, self._stub.PushInline, request, self.options.deadline(nbytes), (token, buffers))
        return reply

    def _on_lane(self, lane: Lane, method, request, timeout: float, stage=None, receive=None):
        """One call whose bytes travel on ``lane``: ``stage`` (token, views) is sent before the
        call, ``receive()`` reads what the shard sends on the lane while the call runs. Returns
        ``(reply, received)``. The lane goes back to the pool after a success and is closed after
        any failure; a broken lane is an ``UnavailableError`` (retried like a lost connection)."""
        received = None
        try:
            if stage is not None:
                lane.stage(*stage, timeout)
            call = method.future(request, timeout=timeout, wait_for_ready=False, metadata=self._metadata)
            if receive is not None:
                # A call that fails never sends on the lane: wake the reader instead of waiting.
                call.add_done_callback(lambda c: c.code() is not grpc.StatusCode.OK and lane.abort())
                try:
                    received = receive()
                except (OSError, LaneError):
                    if call.done():
                        call.result()  # the call's own error explains the lane's
                    call.cancel()
                    raise
            reply = call.result()
        except grpc.RpcError as exc:
            lane.close()
            raise translate(exc, self.address) from exc
        except (OSError, LaneError) as exc:
            lane.close()
            raise errors.UnavailableError(f"shard {self.address}: bulk lane broke: {exc}") from exc
        except BaseException:
            lane.close()
            raise
        self.lanes.give(lane)
        return reply, received

    def _receive_on_lane(
        self, lane: Lane, token: int, destinations: Mapping[str, torch.Tensor], timeout: float
    ) -> tuple[ps_pb2.PullHeader, dict[str, int]]:
        """Read a pull sent on ``lane`` straight into ``destinations`` (no copy unless compressed)."""
        raw, nbytes = lane.receive_header(token, timeout)
        header = ps_pb2.PullHeader.FromString(raw)
        targets, versions = self._targets(header, destinations)
        expected = sum(sent.nbytes for _, sent, _ in targets)
        if expected != nbytes:
            raise errors.PSError(f"shard {self.address} sent {nbytes} bytes on the lane for parts of {expected}")
        for _, _, buffer in targets:
            lane.receive_into(tensor_bytes(buffer))
        self._widen(targets, destinations)
        return header, versions

    def leave(self, request: ps_pb2.LeaveRequest) -> None:
        """Leave the job on this shard, within ``_LEAVE_TIMEOUT`` (it runs on the way out; an
        unreachable shard fails it at once). Raises ``pswire.errors`` errors."""
        # Leave is never capped by admission control; gRPC's own limit may still turn it away.
        timeout = min(self.options.timeout, _LEAVE_TIMEOUT)
        retrying(lambda: self._call(self._stub.Leave, request, timeout=timeout), self.options, self.address,
                 "leave", retry=(errors.OverloadedError,), within=timeout)

    def heartbeat(self, request: ps_pb2.HeartbeatRequest, timeout: float) -> ps_pb2.HeartbeatResponse:
        # A heartbeat to an unreachable shard fails fast and the next one retries.
        return self._call(self._stub.Heartbeat, request, timeout=timeout)

    def data(self, request: ps_pb2.DataRequest) -> ps_pb2.DataResponse:
        """Retried while the shard is unreachable or overloaded: a repeat is harmless, as every
        reply names all the tasks the worker holds (``psworker.elastic``)."""
        return retrying(lambda: self._call(self._stub.Data, request), self.options, self.address, "data")

    def checkpoint(self, request: ps_pb2.CheckpointRequest) -> ps_pb2.CheckpointResponse:
        """Retried only while the shard turns it away as overloaded (it then never started)."""
        return retrying(lambda: self._call(self._stub.Checkpoint, request), self.options, self.address,
                        "checkpoint", retry=(errors.OverloadedError,), within=self.options.timeout)

    def end_job(self, request: ps_pb2.EndJobRequest) -> ps_pb2.EndJobResponse:
        """Retried only while the shard turns it away as overloaded (it then never started)."""
        return retrying(lambda: self._call(self._stub.EndJob, request), self.options, self.address,
                        "end-job", retry=(errors.OverloadedError,), within=self.options.timeout)

    def pull(
        self, request: ps_pb2.PullRequest, destinations: Mapping[str, torch.Tensor], nbytes: int,
        *, may_wait: bool = False,
    ) -> tuple[ps_pb2.PullHeader, dict[str, int]]:
        """Stream a snapshot into ``destinations`` (part key -> tensor of the part's shape).
        Returns the snapshot's header and the version of every part written. ``may_wait``: the
        shard may hold the pull on the consistency bound, so the deadline allows for that."""
        timeout = self._pull_deadline(nbytes, may_wait)
        lane = self.lanes.take() if nbytes > self.options.inline_bytes else None
        if lane is not None:
            token = lane.next_token()
            on_lane = ps_pb2.PullRequest()
            on_lane.CopyFrom(request)
            on_lane.bulk.CopyFrom(ps_pb2.BulkRef(lane=lane.lane_id, token=token))
            _, received = self._on_lane(
                lane, self._stub.PullInline, on_lane, timeout,
                receive=lambda: self._receive_on_lane(lane, token, destinations, timeout),
            )
            return received
        try:
            if nbytes <= self.options.inline_bytes:
                reply = self._stub.PullInline(request, timeout=timeout, wait_for_ready=False, metadata=self._metadata)
                return self._write_inline(reply, destinations)
            stream = self._pull_stream(request, timeout=timeout, wait_for_ready=False, metadata=self._metadata)
            first = next(stream, None)
            if not isinstance(first, ps_pb2.PullMessage) or first.WhichOneof("kind") != "header":
                raise errors.PSError(f"shard {self.address}: pull stream did not start with a header")
            targets, versions = self._targets(first.header, destinations)
            # Chunks name the header's part index; skipped parts send none.
            included = {i: n for n, i in enumerate(i for i, p in enumerate(first.header.parts) if p.included)}
            assembler = ChunkAssembler([sent for _, sent, _ in targets], [tensor_bytes(b) for _, _, b in targets])
            for chunk in stream:
                if not isinstance(chunk, frames.Chunk) or chunk.part_index not in included:
                    raise errors.PSError(f"shard {self.address} sent a chunk of a part not in its header")
                assembler.add(frames.Chunk(included[chunk.part_index], chunk.offset, chunk.data))
            assembler.finish()
            self._widen(targets, destinations)
            return first.header, versions
        except grpc.RpcError as exc:
            raise translate(exc, self.address) from exc

    def push_pull(
        self, header: ps_pb2.TensorHeader, buffers: Sequence[memoryview], request: ps_pb2.PullRequest,
        destinations: Mapping[str, torch.Tensor], nbytes: int, *, may_wait: bool = False,
    ) -> tuple[ps_pb2.PushResponse, ps_pb2.PullHeader, dict[str, int]]:
        """A push and the pull after it in one call: each side inline when within
        ``inline_bytes``, else on a bulk lane. Without a lane for a larger side: a push, then a
        pull (a retry repeats the push's sequence number either way, so it applies once)."""
        pushed = sum(len(b) for b in buffers)
        limit = self.options.inline_bytes
        large = pushed > limit or nbytes > limit
        lane = self.lanes.take() if large else None
        if lane is None and large:
            return (self.push(header, buffers), *self.pull(request, destinations, nbytes, may_wait=may_wait))
        timeout = self._pull_deadline(nbytes + pushed, may_wait)
        call = ps_pb2.PushPullRequest(pull=request)
        stage = receive = None
        if pushed > limit:
            stage = (lane.next_token(), buffers)
            call.push.CopyFrom(ps_pb2.InlinePush(
                header=header, bulk=ps_pb2.BulkRef(lane=lane.lane_id, token=stage[0], nbytes=pushed)
            ))
        else:
            call.push.CopyFrom(ps_pb2.InlinePush(header=header, data=[bytes(b) for b in buffers]))
        if nbytes > limit:
            token = lane.next_token()
            call.pull.bulk.CopyFrom(ps_pb2.BulkRef(lane=lane.lane_id, token=token))
            receive = lambda: self._receive_on_lane(lane, token, destinations, timeout)  # noqa: E731
        if lane is None:
            try:
                reply = self._stub.PushPull(call, timeout=timeout, wait_for_ready=False, metadata=self._metadata)
            except grpc.RpcError as exc:
                raise translate(exc, self.address) from exc
            return (reply.push, *self._write_inline(reply.pull, destinations))
        reply, received = self._on_lane(lane, self._stub.PushPull, call, timeout, stage, receive)
        return (reply.push, *(received or self._write_inline(reply.pull, destinations)))

    def _pull_deadline(self, nbytes: int, may_wait: bool) -> float:
        return self.options.deadline(nbytes) + (self.options.wait_timeout if may_wait else 0.0)

    def _part(self, spec: ps_pb2.PartSpec) -> Part:
        """``Part.from_proto``, remembered: a shard sends the same few parts on every pull."""
        key = (spec.name, spec.dtype, spec.row_start, spec.row_end, tuple(spec.full_shape))
        part = self._parts.get(key)
        if part is None:
            if len(self._parts) > 4096:
                self._parts.clear()
            part = self._parts[key] = Part.from_proto(spec)
        return part

    def _targets(
        self, header: ps_pb2.PullHeader, destinations: Mapping[str, torch.Tensor]
    ) -> tuple[list[tuple[str, Part, torch.Tensor]], dict[str, int]]:
        """Where the bytes of each part the header includes land, in order, as (part key, part
        as sent, tensor): the destination itself, or a reused narrow buffer when the part
        travels compressed (widened into the destination by ``_widen``); and each one's version."""
        targets, versions = [], {}
        wire = wire_dtype_from_proto(header.wire_dtype) if header.wire_dtype else None
        for pulled in header.parts:
            part = self._part(pulled.spec)
            if part.key not in destinations:
                raise errors.PreconditionError(
                    f"shard {self.address} holds {part.key!r}, which this worker's placement does not put there"
                )
            if not pulled.included:
                continue
            sent = on_wire(part, wire)
            if sent is part:
                targets.append((part.key, part, destinations[part.key]))
            else:
                if sent not in self._narrow:
                    self._narrow[sent] = torch.empty(sent.shape, dtype=torch_dtype(sent.dtype))
                targets.append((part.key, sent, self._narrow[sent]))
            versions[part.key] = pulled.version
        return targets, versions

    @staticmethod
    def _widen(targets: list[tuple[str, Part, torch.Tensor]], destinations: Mapping[str, torch.Tensor]) -> None:
        for key, _, buffer in targets:
            target = destinations[key]
            if buffer.data_ptr() != target.data_ptr():
                target.copy_(buffer)

    def _write_inline(
        self, reply: ps_pb2.InlinePull, destinations: Mapping[str, torch.Tensor]
    ) -> tuple[ps_pb2.PullHeader, dict[str, int]]:
        targets, versions = self._targets(reply.header, destinations)
        if len(reply.data) != len(targets):
            raise errors.PSError(f"shard {self.address} sent {len(reply.data)} tensors for {len(targets)} parts")
        for (key, sent, buffer), data in zip(targets, reply.data):
            if len(data) != sent.nbytes:
                raise errors.PSError(f"shard {self.address} sent {len(data)} bytes of {key!r}, expected {sent.nbytes}")
            tensor_bytes(buffer)[:] = data
        self._widen(targets, destinations)
        return reply.header, versions

    def close(self) -> None:
        self.lanes.close()
        self._channel.close()
