"""The worker's side of the wire: one ``ShardClient`` per shard and a ``PSClient`` that talks
to all of them at once. ``grpc.RpcError`` becomes a ``pswire.errors`` error here and nowhere else.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from pswire import errors, frames
from pswire.lanes import LaneError
from pswire.consistency import Consistency, Mode
from pswire.codec import (
    DEFAULT_CHUNK_BYTES, WIRE_DTYPES, ChunkAssembler, Part, dtype_to_wire, on_wire, tensor_bytes, wire_dtype_from_proto,
)
from pswire.optim import OptimizerConfig
from pswire.placement import Placement, VariableSpec, place
from pswire.v1 import ps_pb2, ps_pb2_grpc
from pswire.wire import consistency_from_proto, consistency_to_proto, optimizer_to_proto
from psworker.lanes import Lane, LanePool

__all__ = ["ClientOptions", "PSClient", "ShardClient", "parse_addresses"]

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

_CODE_TO_ERROR: dict[grpc.StatusCode, type[errors.PSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.TooLargeError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.PreconditionError,
    grpc.StatusCode.ABORTED: errors.FencedError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineError,
}


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
    wire_dtype: torch.dtype | None = None
    """Wire compression: send floating-point gradients and pull weights in this dtype
    (``torch.bfloat16`` or ``torch.float16``; the shards keep and update full precision).
    Halves the bytes moved; the weights a worker computes with are rounded to it."""
    inline_bytes: int = 256 << 10
    """Pushes and pulls of at most this many bytes to one shard go in a single message
    (PushInline / PullInline) instead of a stream, which costs a round of thread hand-offs
    per call; 0 always streams."""
    bulk: bool = True
    """Send the bytes of larger pushes and pulls on the shard's bulk lanes (plain TCP beside the
    gRPC call, ``pswire.lanes``) when it offers them; False: every byte goes through gRPC."""

    def __post_init__(self) -> None:
        if min(self.timeout, self.min_bandwidth, self.connect_timeout, self.wait_timeout) <= 0:
            raise ValueError("timeouts and min_bandwidth must be > 0")
        if not 1024 <= self.chunk_bytes < (4 << 20):
            raise ValueError("chunk_bytes must be between 1 KiB and 4 MiB")
        if not 0 <= self.inline_bytes <= (4 << 20):
            raise ValueError("inline_bytes must be between 0 and 4 MiB")
        if self.wire_dtype not in (None, *WIRE_DTYPES.values()):
            raise ValueError(f"wire_dtype must be None, torch.bfloat16 or torch.float16, got {self.wire_dtype}")

    def deadline(self, nbytes: int) -> float:
        return self.timeout + nbytes / self.min_bandwidth


def _retrying(call, options: ClientOptions, address: str, what: str):
    """Run ``call`` until it succeeds, retrying with backoff while the shard is unreachable or
    does not answer in time (a restart, a partition), up to ``options.retry_timeout``. A retried
    push carries the same sequence number, so a shard that did apply it acknowledges it again
    instead of applying it twice."""
    deadline = time.monotonic() + options.retry_timeout
    backoff = 0.1
    while True:
        try:
            return call()
        except (errors.UnavailableError, errors.DeadlineError) as exc:
            if time.monotonic() + backoff > deadline:
                raise type(exc)(f"{exc} (gave up after {options.retry_timeout:.0f}s)") from exc
            log.warning("%s to %s failed (%s); retrying in %.1fs", what, address, exc, backoff)
            threading.Event().wait(backoff)  # a plain timed wait; nothing can end it early
            backoff = min(backoff * 2, 5.0)


def _translate(exc: grpc.RpcError, address: str) -> errors.PSError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _CODE_TO_ERROR.get(code, errors.PSError)
    return cls(f"shard {address}: {details} ({code.name})")


class ShardClient:
    """Calls to one shard. Every call has a deadline; errors are ``pswire.errors`` types."""

    def __init__(self, address: str, options: ClientOptions) -> None:
        self.address = address
        self.options = options
        self._channel = grpc.insecure_channel(
            address,
            options=[
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
            ],
        )
        self._stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        self.lanes = LanePool(address.rpartition(":")[0].strip("[]"), enabled=options.bulk)
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
        self._pull_stream = self._channel.unary_stream(
            path + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
            response_deserializer=frames.decoder(ps_pb2.PullMessage), _registered_method=True,
        )

    def wait_connected(self, timeout: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.UnavailableError(
                f"shard {self.address} did not accept a connection within {timeout:.0f}s"
            ) from None

    def _call(self, method, request, *, nbytes: int = 0, timeout: float | None = None, wait_for_ready: bool = True):
        try:
            return method(
                request, timeout=self.options.deadline(nbytes) if timeout is None else timeout,
                wait_for_ready=wait_for_ready,
            )
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from exc

    def register(self, request: ps_pb2.RegisterRequest) -> ps_pb2.RegisterResponse:
        reply = self._call(self._stub.Register, request)
        self.lanes.set_port(reply.bulk_port)
        return reply

    def status(self) -> ps_pb2.StatusResponse:
        return self._call(self._stub.Status, ps_pb2.StatusRequest())

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
            call = method.future(request, timeout=timeout, wait_for_ready=True)
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
            raise _translate(exc, self.address) from exc
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
        self._call(self._stub.Leave, request)

    def heartbeat(self, request: ps_pb2.HeartbeatRequest, timeout: float) -> ps_pb2.HeartbeatResponse:
        # No wait_for_ready: a heartbeat to an unreachable shard fails fast and the next one retries.
        return self._call(self._stub.Heartbeat, request, timeout=timeout, wait_for_ready=False)

    def checkpoint(self, request: ps_pb2.CheckpointRequest) -> ps_pb2.CheckpointResponse:
        return self._call(self._stub.Checkpoint, request)

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
                reply = self._stub.PullInline(request, timeout=timeout, wait_for_ready=True)
                return self._write_inline(reply, destinations)
            stream = self._pull_stream(request, timeout=timeout, wait_for_ready=True)
            first = next(stream, None)
            if not isinstance(first, ps_pb2.PullMessage) or first.WhichOneof("kind") != "header":
                raise errors.PSError(f"shard {self.address}: pull stream did not start with a header")
            targets, versions = self._targets(first.header, destinations)
            # Chunks name the header's part index; skipped parts send none.
            included = {i: n for n, i in enumerate(i for i, p in enumerate(first.header.parts) if p.included)}
            assembler = ChunkAssembler([sent for _, sent, _ in targets], [buffer for _, _, buffer in targets])
            for chunk in stream:
                if not isinstance(chunk, frames.Chunk) or chunk.part_index not in included:
                    raise errors.PSError(f"shard {self.address} sent a chunk of a part not in its header")
                assembler.add(frames.Chunk(included[chunk.part_index], chunk.offset, chunk.data))
            assembler.finish()
            self._widen(targets, destinations)
            return first.header, versions
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from exc

    def push_pull(
        self, header: ps_pb2.TensorHeader, buffers: Sequence[memoryview], request: ps_pb2.PullRequest,
        destinations: Mapping[str, torch.Tensor], nbytes: int, *, may_wait: bool = False,
    ) -> tuple[ps_pb2.PushResponse, ps_pb2.PullHeader, dict[str, int]]:
        """A push and the pull after it in one call: each side inline when within
        ``inline_bytes``, else on a bulk lane. Without a lane for a larger side: a push, then a
        pull (a retry repeats the push's sequence number either way, so it applies once)."""
        pushed = sum(len(b) for b in buffers)
        limit = self.options.inline_bytes
        lane = self.lanes.take() if pushed > limit or nbytes > limit else None
        if lane is None and (pushed > limit or nbytes > limit):
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
                reply = self._stub.PushPull(call, timeout=timeout, wait_for_ready=True)
            except grpc.RpcError as exc:
                raise _translate(exc, self.address) from exc
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
                    self._narrow[sent] = torch.empty(sent.shape, dtype=sent.dtype)
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


@dataclass
class _ShardSession:
    client: ShardClient
    parts: tuple[Part, ...]
    worker_id: int = 0
    generation: int = 0
    sequence: int = 0
    version: int = 0
    clock: int = 0
    """This worker's clock on the shard: the step its next push belongs to."""
    base_clock: int = 0
    """The shard clock of the last pull."""
    narrow: dict[str, torch.Tensor] = field(default_factory=dict)
    """Part key -> buffer its gradient is compressed into (``ClientOptions.wire_dtype``)."""
    known: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Part key -> (version, data pointer of the tensor it was pulled into)."""


class PSClient:
    """A worker's connection to every shard of a job.

    Calls fan out to all shards concurrently and return when every shard has answered; an error
    from any shard is raised (the first one, as a ``pswire.errors`` error).
    """

    def __init__(self, addresses: str | Sequence[str], options: ClientOptions | None = None) -> None:
        self.addresses = parse_addresses(addresses)
        self.options = options or ClientOptions()
        self._clients = [ShardClient(a, self.options) for a in self.addresses]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(self._clients), thread_name_prefix="psclient")
        self._lock = threading.Lock()  # guards _sessions and placement against concurrent step calls
        self.placement: Placement | None = None
        self.consistency = Consistency()
        """The job's setting, as the shards reported it at registration."""
        self._sessions: list[_ShardSession] = []
        self.lease_seconds = 0.0
        """The shortest lease the shards granted at registration (0: no leases)."""
        self.resume_data: dict[str, int] = {}
        """This worker's progress as the shards last recorded it (empty for a new worker)."""
        self.fenced = threading.Event()
        """Set when a shard says this worker's registration is void (evicted): re-register."""
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    def _fan_out(self, fn, items):
        first, *rest = items
        # The first call runs on this thread: a hand-off to the pool costs about as much as a
        # small call, and with one shard there is nothing to overlap.
        futs = [self._pool.submit(fn, item) for item in rest]
        try:
            results = [fn(first)]
        finally:
            # Every call ends before an error is raised, so none is left running (a retry, say)
            # under the caller's next step. Each call carries its own gRPC deadline; this outer
            # bound only guards against a hang.
            futures.wait(futs, timeout=self.options.connect_timeout + 3600)
        return results + [f.result(timeout=0) for f in futs]

    def wait_connected(self) -> None:
        self._fan_out(lambda c: c.wait_connected(self.options.connect_timeout), self._clients)

    def set_placement(self, spec: Sequence[VariableSpec]) -> Placement:
        """Compute the placement of ``spec`` on this job's shards (no RPC)."""
        placement = place(spec, self.num_shards)
        with self._lock:
            self.placement = placement
            self._sessions = [_ShardSession(c, parts) for c, parts in zip(self._clients, placement.shards)]
        return placement

    def register(
        self,
        spec: Sequence[VariableSpec],
        optimizer: OptimizerConfig,
        *,
        worker_name: str,
        job_fingerprint: str = "",
        initial_values: Mapping[str, torch.Tensor] | None = None,
        consistency: Consistency | None = None,
    ) -> bool:
        """Join the job on every shard; upload ``initial_values`` where this worker is chosen to
        initialise. Returns True if this worker initialised at least one shard.

        Raises ``PreconditionError`` when the model or settings disagree with the job's.
        """
        placement = self.set_placement(spec)
        wanted = consistency or Consistency()
        leases: list[float] = []
        positions: list[dict[str, int]] = []

        def one(index: int) -> bool:
            session = self._sessions[index]
            request = ps_pb2.RegisterRequest(
                worker_name=worker_name, shard_index=index, num_shards=self.num_shards,
                placement_digest=placement.digest(), parts=[p.to_proto() for p in session.parts],
                optimizer=optimizer_to_proto(optimizer), job_fingerprint=job_fingerprint,
                consistency=consistency_to_proto(wanted),
            )
            reply = _retrying(lambda: session.client.register(request), self.options, session.client.address, "register")
            session.worker_id, session.generation = reply.worker_id, reply.generation
            session.version, session.sequence = reply.version, 0
            session.clock = session.base_clock = reply.clock
            self.consistency = consistency_from_proto(reply.consistency)
            leases.append(reply.lease_seconds)
            if reply.HasField("data"):
                positions.append({"step": reply.data.step, "epoch": reply.data.epoch, "position": reply.data.position})
            session.known.clear()
            if not reply.must_initialize:
                return False
            if initial_values is None:
                raise errors.PreconditionError(
                    f"shard {session.client.address} asks this worker to initialise it, but no values were given"
                )
            header = self._header(session, 0)
            buffers = [tensor_bytes(_rows(initial_values[p.name], p)) for p in session.parts]
            session.client.initialize(header, buffers)
            return True

        initialised = any(self._fan_out(one, range(self.num_shards)))
        self.fenced.clear()
        self.resume_data = max(positions, key=lambda d: d["step"], default={})
        self.lease_seconds = min((lease for lease in leases if lease > 0), default=0.0)
        if self.lease_seconds and self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeats, name="psclient-heartbeat", daemon=True)
            self._heartbeat.start()
        return initialised

    def _heartbeats(self) -> None:
        """Renew the lease on every shard, three times per lease, from its own thread so that a
        long training step never starves it."""
        while not self._heartbeat_stop.wait(timeout=self.lease_seconds / 3):
            with self._lock:
                sessions = list(self._sessions)
            for session in sessions:
                request = ps_pb2.HeartbeatRequest(worker_id=session.worker_id, generation=session.generation)
                try:
                    session.client.heartbeat(request, timeout=max(1.0, self.lease_seconds / 3))
                except errors.FencedError as exc:
                    with self._lock:  # a registration that was renewed meanwhile is not fenced
                        current = any(s is session for s in self._sessions) and session.generation == request.generation
                    if current and not self.fenced.is_set():
                        log.warning("%s", exc)
                        self.fenced.set()
                except errors.PSError as exc:
                    log.debug("heartbeat to %s failed: %s", session.client.address, exc)

    def _header(self, session: _ShardSession, base_version: int, parts: Sequence[Part] | None = None) -> ps_pb2.TensorHeader:
        return ps_pb2.TensorHeader(
            worker_id=session.worker_id, generation=session.generation, sequence=session.sequence,
            base_version=base_version, parts=[p.to_proto() for p in (session.parts if parts is None else parts)],
            clock=session.clock, base_clock=session.base_clock,
        )

    def _pull_request(
        self, session: _ShardSession, destinations: Mapping[str, torch.Tensor], *, skip_unchanged: bool,
        may_wait: bool, clock: int,
    ) -> tuple[ps_pb2.PullRequest, dict[str, torch.Tensor], int]:
        dest = {p.key: _rows(destinations[p.name], p) for p in session.parts}
        known = {}
        if skip_unchanged:
            for key, (version, ptr) in session.known.items():
                if dest[key].data_ptr() == ptr:
                    known[key] = version
        wire = self.options.wire_dtype
        request = ps_pb2.PullRequest(worker_id=session.worker_id, generation=session.generation,
                                     known_versions=known, clock=clock if may_wait else -1,
                                     wire_dtype=dtype_to_wire(wire) if wire is not None else 0)
        return request, dest, sum(on_wire(p, wire).nbytes for p in session.parts)

    @staticmethod
    def _pulled(session: _ShardSession, header: ps_pb2.PullHeader, written: Mapping[str, int], dest) -> int:
        for key, part_version in written.items():
            session.known[key] = (part_version, dest[key].data_ptr())
        session.version, session.base_clock = header.version, header.clock
        return header.version

    def _push_message(
        self, session: _ShardSession, grads: Mapping[str, torch.Tensor], data: Mapping[str, int] | None,
        base_version: int | None = None,
    ) -> tuple[ps_pb2.TensorHeader, list[memoryview]] | None:
        """The next push to ``session`` (None when it holds none of ``grads`` and, in async,
        needs no clock tick); takes the next sequence number. ``base_version``: the version the
        gradient was computed from, when not that of the last pull."""
        parts = [p for p in session.parts if p.name in grads]
        if not parts and self.consistency.mode is Mode.ASYNC:
            return None
        session.sequence += 1
        header = self._header(session, session.version if base_version is None else base_version, parts)
        if data:
            header.data.CopyFrom(ps_pb2.DataPosition(**data))
        wire = self.options.wire_dtype
        if wire is None:
            return header, [tensor_bytes(_rows(grads[p.name], p)) for p in parts]
        header.wire_dtype = dtype_to_wire(wire)
        buffers = []
        for part in parts:
            grad, sent = _rows(grads[part.name], part), on_wire(part, wire)
            if sent is not part:  # compressed into a buffer reused step after step
                narrow = session.narrow.get(part.key)
                if narrow is None:
                    narrow = session.narrow[part.key] = torch.empty(sent.shape, dtype=wire)
                grad = narrow.copy_(grad)
            buffers.append(tensor_bytes(grad))
        return header, buffers

    def pull(
        self, destinations: Mapping[str, torch.Tensor], *, skip_unchanged: bool = True, wait: bool = True
    ) -> list[int]:
        """Write every shard's current values into ``destinations`` (variable name -> contiguous
        CPU tensor of the full shape). Returns each shard's version.

        In ssp/sync a registered worker's pull waits as the bound requires (``wait=False`` reads
        at once: for evaluation, never for training steps)."""
        sessions = self._require_sessions()
        may_wait = wait and self.consistency.mode is not Mode.ASYNC

        def one(session: _ShardSession) -> int:
            request, dest, nbytes = self._pull_request(
                session, destinations, skip_unchanged=skip_unchanged, may_wait=may_wait, clock=session.clock
            )
            header, written = _retrying(
                lambda: session.client.pull(request, dest, nbytes, may_wait=may_wait),
                self.options, session.client.address, "pull",
            )
            return self._pulled(session, header, written, dest)

        return self._fan_out_waiting(one, sessions, may_wait)

    def _fan_out_waiting(self, fn, sessions: list[_ShardSession], may_wait: bool) -> list:
        """``_fan_out``, logging every few seconds which worker a waiting call is held back by."""
        if not may_wait:
            return self._fan_out(fn, sessions)
        futs = {self._pool.submit(fn, s): s for s in sessions}
        _, pending = futures.wait(futs, timeout=0.5)
        while pending:
            for fut in pending:
                self._log_wait(futs[fut])
            _, pending = futures.wait(pending, timeout=5.0)
        return [f.result() for f in futs]

    def _log_wait(self, session: _ShardSession) -> None:
        """Say which worker a waiting pull is held back by (the slowest live one)."""
        try:
            status = session.client.status()
        except errors.PSError:
            return
        live = [w for w in status.workers if w.live]
        if live:
            slowest = min(live, key=lambda w: (w.clock, w.worker_name))
            log.info(
                "pull at clock %d waits on shard %s (%s) for %s at clock %d",
                session.clock, session.client.address, self.consistency.describe(),
                slowest.worker_name, slowest.clock,
            )

    def push(
        self, grads: Mapping[str, torch.Tensor], *, data: Mapping[str, int] | None = None
    ) -> list[ps_pb2.PushResponse | None]:
        """Push gradients (variable name -> contiguous CPU tensor) to the shards holding them,
        computed from the versions of the last pull. In async, shards with none of the variables
        are skipped (``None`` in the result); in ssp/sync they get an empty push, which advances
        this worker's clock there."""
        sessions = self._require_sessions()

        def one(session: _ShardSession) -> ps_pb2.PushResponse | None:
            message = self._push_message(session, grads, data)
            if message is None:
                return None
            reply = _retrying(lambda: session.client.push(*message), self.options, session.client.address, "push")
            session.clock += 1
            return reply

        return self._fan_out(one, sessions)

    def push_pull(
        self, grads: Mapping[str, torch.Tensor], destinations: Mapping[str, torch.Tensor], *,
        data: Mapping[str, int] | None = None, base_versions: Sequence[int] | None = None,
    ) -> list[ps_pb2.PushResponse | None]:
        """One training step's traffic: :meth:`push`, then :meth:`pull` into ``destinations``
        (waiting on the bound in ssp/sync). A shard whose push and pull both fit in
        ``inline_bytes``, or whose bulk lanes are open, gets them as one call; the others as two.
        A retried call repeats the push's sequence number, so the shard applies it once.
        ``base_versions`` (one per shard): the versions the gradients were computed from, when
        not those of the last pull (a worker that overlaps steps computes on older weights)."""
        sessions = self._require_sessions()
        may_wait = self.consistency.mode is not Mode.ASYNC
        bases = dict(zip(map(id, sessions), base_versions)) if base_versions is not None else {}

        def one(session: _ShardSession) -> ps_pb2.PushResponse | None:
            message = self._push_message(session, grads, data, bases.get(id(session)))
            request, dest, nbytes = self._pull_request(
                session, destinations, skip_unchanged=True, may_wait=may_wait,
                clock=session.clock + (message is not None),
            )
            address = session.client.address
            reply = None
            if message is not None:
                reply, header, written = _retrying(
                    lambda: session.client.push_pull(*message, request, dest, nbytes, may_wait=may_wait),
                    self.options, address, "push and pull",
                )
                session.clock += 1
            else:
                header, written = _retrying(
                    lambda: session.client.pull(request, dest, nbytes, may_wait=may_wait), self.options, address, "pull"
                )
            self._pulled(session, header, written, dest)
            return reply

        return self._fan_out_waiting(one, sessions, may_wait)

    def versions(self) -> list[int]:
        """Each shard's version as of this worker's last pull."""
        return [session.version for session in self._require_sessions()]

    def leave(self) -> None:
        """Leave the job on every shard (SSP/sync membership shrinks at once). Best effort:
        errors are logged, not raised, as this runs on the way out."""
        sessions = self._require_sessions()

        def one(session: _ShardSession) -> None:
            try:
                session.client.leave(ps_pb2.LeaveRequest(worker_id=session.worker_id, generation=session.generation))
            except errors.PSError as exc:
                log.warning("leaving %s: %s", session.client.address, exc)

        self._fan_out(one, sessions)

    def status(self) -> list[ps_pb2.StatusResponse]:
        return self._fan_out(lambda c: c.status(), self._clients)

    def checkpoint(self, checkpoint_id: int) -> list[ps_pb2.CheckpointResponse]:
        """Ask every shard to write its part of checkpoint ``checkpoint_id`` (admin)."""
        return self._fan_out(
            lambda c: c.checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=checkpoint_id)),
            self._clients,
        )

    def _require_sessions(self) -> list[_ShardSession]:
        with self._lock:
            if not self._sessions:
                raise errors.PreconditionError("register (or set_placement) before pull and push")
            return list(self._sessions)

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._clients:
            c.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rows(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """The rows of ``tensor`` that ``part`` covers, as a view (``tensor`` must be contiguous)."""
    if tuple(tensor.shape) != part.full_shape or tensor.dtype != part.dtype:
        raise ValueError(
            f"tensor for {part.name!r} is {tensor.dtype}{list(tensor.shape)}, "
            f"expected {part.dtype}{list(part.full_shape)}"
        )
    return tensor if part.is_whole else tensor[part.row_start : part.row_end]
