"""One shard's tensor traffic, ``ShardClient``: registration, pushes, pulls and their bulk lanes,
on top of the torch-free ``psworker.channel.ShardChannel`` (channel, credentials, waiting for
the connection, status and the administrative calls). Every ``grpc.RpcError`` it catches
becomes a ``pswire.errors`` error through ``psworker.retry.translate``, which with ``retrying``
decides what is retried and for how long.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from pswire import errors, frames
from pswire.lanes import CALL_LIMIT, LANE_METHODS, RETRYABLE_FLAG, LaneError
from pswire.security import ClientSecurity, host_of
from pswire.codec import ChunkAssembler, Part, on_wire, wire_dtype_from_proto
from pswire.v1 import ps_pb2
from psworker.channel import KEEPALIVE_MS, SERVICE, ShardChannel
from psworker.lanes import Lane, LanePool, ReplyFirst
from psworker.options import ClientOptions, parse_addresses
from psworker.retry import retrying, translate
from psworker.tensors import tensor_bytes, torch_dtype, write_bytes

if TYPE_CHECKING:
    from psworker.client import DataRider

__all__ = ["KEEPALIVE_MS", "SERVICE", "ClientOptions", "ClientSecurity", "ShardClient", "parse_addresses"]

_LEAVE_TIMEOUT = 5.0
"""Deadline of a Leave (at most ``ClientOptions.timeout``): it runs on the way out, and a shard
that does not answer it evicts the worker when its lease runs out anyway."""


_RESPONSES = {
    name: getattr(ps_pb2, ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name[name].output_type.name)
    for name in LANE_METHODS if name != "Step"  # no gRPC method: its reply is pswire.step's layout
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LaneCallError(grpc.RpcError):
    """A call a bulk lane carried that the shard answered with an error status, in the shape of
    gRPC's error (``code``, ``details``, ``trailing_metadata``) for ``psworker.retry.translate``."""

    def __init__(self, status: int, details: bytes) -> None:
        super().__init__(details.decode("utf-8", "replace"))
        self._code = _CODES.get(status & 0xFF, grpc.StatusCode.UNKNOWN)
        self._details = details.decode("utf-8", "replace")
        self._retryable = bool(status & RETRYABLE_FLAG)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return (("ps-retryable", "1"),) if self._retryable else ()


def _session_of(method: str, request) -> tuple[int, int]:
    """``(worker_id, generation)`` that a call of the data path names (a push-and-pull: its push's)."""
    if method == "PushPull":
        request = request.push
    if method in ("PushPull", "PushInline"):
        request = request.header
    return request.worker_id, request.generation


def _rows_of(reply: ps_pb2.PushPullResponse) -> ps_pb2.PullRowsResponse | None:
    """The rows a push-and-pull's reply carries (None: it carries none)."""
    return reply.rows if reply.HasField("rows") else None


def _settle(rider: "DataRider | None", reply: ps_pb2.PushPullResponse, address: str) -> None:
    """Hand ``rider`` (the data exchange a push-and-pull carried) the queue's answer in ``reply``:
    its reply, or its refusal as the error a Data call would have raised."""
    if rider is None:
        return
    if reply.HasField("data_refused"):
        refused = LaneCallError(reply.data_refused.code, reply.data_refused.details.encode())
        rider.answer(None, translate(refused, address))
    else:
        rider.answer(reply.data if reply.HasField("data") else None, None)


@dataclass(eq=False)
class _Pending:
    """A call sent whole on a lane (``ShardClient._start``) whose reply is still to be read;
    ``failed``: why its sending failed (raised when it is finished)."""

    method: str
    lane: Lane
    token: int
    deadline: float
    timeout: float
    failed: BaseException | None = None


class ShardClient(ShardChannel):
    """Calls to one shard, tensors included. Every call has a deadline; errors are
    ``pswire.errors`` types; no call waits for the connection (see ``ShardChannel``)."""

    def __init__(self, address: str, options: ClientOptions) -> None:
        super().__init__(address, options)
        security = options.security
        self.session: tuple[int, int, bytes] | None = None
        """(worker id, generation, session secret) of this worker's registration on the shard,
        set by ``PSClient`` after Register; a bulk lane proves it when it opens."""
        host = host_of(address)
        self.lanes = LanePool(
            host, enabled=options.bulk, ssl_context=security.ssl_context() if security is not None else None,
            server_hostname=host, credentials=lambda: self.session,
        )
        self._narrow: dict[Part, torch.Tensor] = {}
        """Reused receive buffers of compressed parts (see ``ClientOptions.wire_dtype``)."""
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

    def register(self, request: ps_pb2.RegisterRequest) -> ps_pb2.RegisterResponse:
        reply = self._call(self._stub.Register, request)
        self.lanes.set_port(reply.bulk_port)
        return reply

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
            return self._small("PushInline", request, self.options.deadline(nbytes))
        lane = self.lanes.take()
        if lane is None:
            return self._call(self._push_stream, self._stream(header, buffers), nbytes=nbytes)
        token = lane.next_token()
        request = ps_pb2.InlinePush(header=header, bulk=ps_pb2.BulkRef(lane=lane.lane_id, token=token, nbytes=nbytes))
        reply, _ = self._on_lane(lane, "PushInline", request, self.options.deadline(nbytes), (token, buffers))
        return reply

    def _small(self, method: str, request, timeout: float):
        """A unary call of the data path (``pswire.lanes.LANE_METHODS``): whole on a bulk lane
        when one is to be had (``ClientOptions.lane_calls``), else through gRPC. Raises
        ``pswire.errors`` errors, the same for both: a lane that breaks or times out is closed
        and the call fails as ``UnavailableError`` or ``DeadlineError`` (retried as gRPC's)."""
        pending = self._start(method, request, timeout)
        if pending is None:
            return self._call(getattr(self._stub, method), request, timeout=timeout)
        return self._finish(pending)

    def _start(self, method: str, request, timeout: float) -> "_Pending | None":
        """Send a call whole on a lane, without waiting for its reply (``_finish`` reads it);
        None when lane calls are off, the request is too large or no lane is to be had (the
        request was not sent: use gRPC)."""
        if not self._lane_carries(method, request):
            return None
        return self._start_body(method, request.SerializeToString(), timeout)

    def _start_body(self, method: str, body: bytes | Sequence[memoryview | bytes], timeout: float) -> "_Pending | None":
        """``_start`` of a request already serialized (``body``: whole, or its pieces)."""
        if (len(body) if isinstance(body, bytes) else sum(map(len, body))) >= CALL_LIMIT - 64:
            return None
        lane = self.lanes.take()
        if lane is None:
            return None
        deadline = time.monotonic() + timeout
        try:
            token = lane.send_call(LANE_METHODS.index(method), body, timeout)
        except BaseException as exc:  # raised by _finish, which closes the lane
            return _Pending(method, lane, 0, deadline, timeout, exc)
        return _Pending(method, lane, token, deadline, timeout)

    def _lane_carries(self, method: str, request) -> bool:
        """Whether ``request`` may travel whole on a lane: lane calls are on, and it names this
        worker's session here (a lane carries only its own session's calls; a read without a
        registration goes through gRPC)."""
        return self.options.lane_calls and self.session is not None and _session_of(method, request) == self.session[:2]

    def _finish(self, pending: "_Pending"):
        """The reply to a call ``_start`` sent: the response, or its error raised as ``_small``
        says."""
        with self._lane_failures(pending.lane, pending.method, pending.timeout):
            if pending.failed is not None:
                raise pending.failed
            status, reply = pending.lane.receive_reply(pending.token, pending.deadline)
        return self._answer(pending.lane, pending.method, status, reply)

    @contextlib.contextmanager
    def _lane_failures(self, lane: Lane, method: str, timeout: float) -> Iterator[None]:
        """A lane call's failures as ``pswire.errors`` errors, the lane closed: no answer in
        time is a ``DeadlineError``, a broken lane an ``UnavailableError`` (both retried as
        gRPC's)."""
        try:
            yield
        except TimeoutError as exc:
            lane.close()
            raise errors.DeadlineError(f"shard {self.address}: {method} not answered on its bulk lane within "
                                       f"{timeout:.1f}s (DEADLINE_EXCEEDED)") from exc
        except (OSError, LaneError) as exc:
            lane.close()
            raise errors.UnavailableError(f"shard {self.address}: bulk lane broke: {exc}") from exc
        except BaseException:
            lane.close()
            raise

    def _answer(self, lane: Lane, method: str, status: int, body: bytes):
        """A lane call's reply, once read whole: the lane back in the pool, and the response, or
        the error the shard answered with raised as gRPC's would be."""
        self.lanes.give(lane)
        if status:
            failed = LaneCallError(status, body)
            raise translate(failed, self.address) from failed
        return _RESPONSES[method].FromString(body) if method != "Step" else body

    def start_push_pull(
        self, header: ps_pb2.TensorHeader, buffers: Sequence[memoryview], request: ps_pb2.PullRequest | None,
        nbytes: int, rows: ps_pb2.PullRowsRequest | None = None, rows_bytes: int = 0, data: "DataRider | None" = None,
    ) -> "_Pending | None":
        """Send a push and the pull after it (not waiting on a bound) as one call whole on a
        lane, and return at once: ``finish_push_pull`` reads the reply, so that a worker's calls
        to several shards are all under way before it waits for any, on one thread. None when
        either side is above ``inline_bytes`` or the call cannot go on a lane (use
        :meth:`push_pull`; nothing was sent). ``rows`` and ``data`` as in :meth:`push_pull`
        (``data`` is answered by :meth:`finish_push_pull`)."""
        pushed, limit = sum(len(b) for b in buffers), self.options.inline_bytes
        if nbytes > limit or pushed > limit:
            return None
        push = ps_pb2.InlinePush(header=header, data=[bytes(b) for b in buffers])
        data_request = data.request if data is not None else None
        return self._start("PushPull", ps_pb2.PushPullRequest(push=push, pull=request, rows=rows, data=data_request),
                           self._pull_deadline(nbytes + pushed + rows_bytes, False))

    def start_step(self, pieces: Sequence[memoryview | bytes], nbytes: int) -> "_Pending | None":
        """Send a ``Step`` (``pswire.step.encode_request``'s ``pieces``; ``nbytes``: the bytes
        both ways, for its deadline) whole on a lane, without waiting: :meth:`finish_step` reads
        the reply. None when it cannot go on a lane (lane calls off, no lane to be had, too
        large): nothing was sent."""
        if not self.options.lane_calls or self.session is None:
            return None
        return self._start_body("Step", pieces, self._pull_deadline(nbytes, False))

    def finish_step(self, pending: "_Pending") -> bytes:
        """The reply's body to a ``Step`` :meth:`start_step` sent; raises as :meth:`push_pull`."""
        return self._finish(pending)

    def finish_push_pull(
        self, pending: "_Pending", destinations: Mapping[str, torch.Tensor] | None, data: "DataRider | None" = None,
    ) -> tuple[ps_pb2.PushResponse, ps_pb2.PullHeader | None, dict[str, int], ps_pb2.PullRowsResponse | None]:
        """:meth:`push_pull`'s result for a call :meth:`start_push_pull` sent (``data``: the
        exchange it carried, answered here); raises as it."""
        reply = self._finish(pending)
        _settle(data, reply, self.address)
        return (reply.push, *self._pulled_inline(reply, destinations), _rows_of(reply))

    def _on_lane(self, lane: Lane, method: str, request, timeout: float, stage=None, receive=None):
        """One call whose bytes travel on ``lane``: ``stage`` (token, views) is sent before the
        call, ``receive()`` reads what the shard sends on the lane while the call runs. Returns
        ``(reply, received)``. The lane goes back to the pool after a success and is closed after
        any failure; a broken lane is an ``UnavailableError`` (retried like a lost connection).
        With lane calls the call itself goes on the lane too (``_whole_on_lane``), else through
        gRPC."""
        if self._lane_carries(method, request):
            return self._whole_on_lane(lane, method, request, timeout, stage, receive)
        received = None
        try:
            if stage is not None:
                lane.stage(*stage, timeout)
            call = getattr(self._stub, method).future(request, timeout=timeout, wait_for_ready=False,
                                                      metadata=self._metadata)
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

    def _whole_on_lane(self, lane: Lane, method: str, request, timeout: float, stage=None, receive=None):
        """``_on_lane`` with the call sent whole on the lane after the staged bytes, answered by
        the lane's thread on the shard: the pull it asks for (read by ``receive()``), then its
        reply; or at once its reply when it failed."""
        deadline = time.monotonic() + timeout
        received = None
        try:
            with self._lane_failures(lane, method, timeout):
                if stage is not None:
                    lane.stage(*stage, timeout)
                token = lane.send_call(LANE_METHODS.index(method), request.SerializeToString(), timeout)
                answer = None
                if receive is not None:
                    try:
                        received = receive()
                    except ReplyFirst as first:  # the call failed before sending its pull
                        if first.token != token:
                            raise LaneError(f"expected call {token}'s reply on the lane, got {first.token}'s") from None
                        answer = first.status, first.body
                status, body = answer or lane.receive_reply(token, deadline)
        except errors.UnavailableError:
            if stage is not None:
                # The shard may have refused the staged bytes (too large, say) and closed the lane
                # before it read the call: the refusal waits for a call naming them, through gRPC.
                reply = self._call(getattr(self._stub, method), request, timeout=min(timeout, self.options.timeout))
                if receive is None:
                    return reply, None
            raise
        return self._answer(lane, method, status, body), received

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
        return retrying(lambda: self._small("Data", request, self.options.timeout), self.options, self.address, "data")

    def pull_rows(self, request: ps_pb2.PullRowsRequest, nbytes: int, *, may_wait: bool) -> ps_pb2.PullRowsResponse:
        """Rows of the job's tables (``nbytes`` of values expected); ``may_wait`` as :meth:`pull`."""
        return self._small("PullRows", request, self._pull_deadline(nbytes, may_wait))

    def start_pull_rows(self, request: ps_pb2.PullRowsRequest, nbytes: int, *, may_wait: bool) -> "_Pending | None":
        """:meth:`pull_rows` sent whole on a lane without waiting (``finish_pull_rows`` reads
        the reply); None when it cannot go on a lane (use :meth:`pull_rows`; nothing was sent)."""
        return self._start("PullRows", request, self._pull_deadline(nbytes, may_wait))

    def finish_pull_rows(self, pending: "_Pending") -> ps_pb2.PullRowsResponse:
        return self._finish(pending)

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
                lane, "PullInline", on_lane, timeout,
                receive=lambda: self._receive_on_lane(lane, token, destinations, timeout),
            )
            return received
        try:
            if nbytes <= self.options.inline_bytes:
                return self._write_inline(self._small("PullInline", request, timeout), destinations)
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
        self, header: ps_pb2.TensorHeader, buffers: Sequence[memoryview], request: ps_pb2.PullRequest | None,
        destinations: Mapping[str, torch.Tensor] | None, nbytes: int, *, may_wait: bool = False,
        rows: ps_pb2.PullRowsRequest | None = None, rows_bytes: int = 0, data: "DataRider | None" = None,
    ) -> tuple[ps_pb2.PushResponse, ps_pb2.PullHeader | None, dict[str, int], ps_pb2.PullRowsResponse | None]:
        """A push and the pull after it in one call: each side inline when within
        ``inline_bytes``, else on a bulk lane. Without a lane for a larger side: a push, then a
        pull (a retry repeats the push's sequence number either way, so it applies once).
        ``rows``: a read of table rows (``rows_bytes`` of values) once the push is applied, in
        the same call; its reply is the last of the four results (None without ``rows``).
        ``data``: a data exchange to make in the same call (shard 0), answered through it when
        the reply comes (the push-then-pull fallback carries none and leaves it unanswered).
        ``request`` None (``destinations`` None too): no pull, the second result None; for a
        shard holding only table rows, whose ``rows`` reply says its version and clock."""
        pushed = sum(len(b) for b in buffers)
        limit = self.options.inline_bytes
        large = pushed > limit or nbytes > limit
        lane = self.lanes.take() if large else None
        if lane is None and large:
            pushed_reply = self.push(header, buffers)
            pulled = self.pull(request, destinations, nbytes, may_wait=may_wait) if request is not None else (None, {})
            return (pushed_reply, *pulled,
                    self.pull_rows(rows, rows_bytes, may_wait=False) if rows is not None else None)
        timeout = self._pull_deadline(nbytes + pushed + rows_bytes, may_wait)
        call = ps_pb2.PushPullRequest(pull=request, rows=rows, data=data.request if data is not None else None)
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
            reply = self._small("PushPull", call, timeout)
            _settle(data, reply, self.address)
            return (reply.push, *self._pulled_inline(reply, destinations), _rows_of(reply))
        reply, received = self._on_lane(lane, "PushPull", call, timeout, stage, receive)
        _settle(data, reply, self.address)
        return (reply.push, *(received or self._pulled_inline(reply, destinations)), _rows_of(reply))

    def _pull_deadline(self, nbytes: int, may_wait: bool) -> float:
        return self.options.deadline(nbytes) + (self.options.wait_timeout if may_wait else 0.0)

    def _targets(
        self, header: ps_pb2.PullHeader, destinations: Mapping[str, torch.Tensor]
    ) -> tuple[list[tuple[str, Part, torch.Tensor]], dict[str, int]]:
        """Where the bytes of each part the header includes land, in order, as (part key, part
        as sent, tensor): the destination itself, or a reused narrow buffer when the part
        travels compressed (widened into the destination by ``_widen``); and each one's version."""
        targets, versions = [], {}
        wire = wire_dtype_from_proto(header.wire_dtype) if header.wire_dtype else None
        for pulled in header.parts:
            part = Part.parsed(pulled.spec)
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
            if buffer is not target and buffer.data_ptr() != target.data_ptr():
                target.copy_(buffer)

    def _pulled_inline(
        self, reply: ps_pb2.PushPullResponse, destinations: Mapping[str, torch.Tensor] | None
    ) -> tuple[ps_pb2.PullHeader | None, dict[str, int]]:
        """A push-and-pull's pull written into ``destinations``; ``(None, {})`` for a call that
        asked for none (``destinations`` None)."""
        if destinations is None:
            if reply.HasField("pull"):
                raise errors.PSError(f"shard {self.address} answered a push-and-pull with a pull it was not asked for")
            return None, {}
        return self._write_inline(reply.pull, destinations)

    def _write_inline(
        self, reply: ps_pb2.InlinePull, destinations: Mapping[str, torch.Tensor]
    ) -> tuple[ps_pb2.PullHeader, dict[str, int]]:
        targets, versions = self._targets(reply.header, destinations)
        if len(reply.data) != len(targets):
            raise errors.PSError(f"shard {self.address} sent {len(reply.data)} tensors for {len(targets)} parts")
        for (key, sent, buffer), data in zip(targets, reply.data):
            if len(data) != sent.nbytes:
                raise errors.PSError(f"shard {self.address} sent {len(data)} bytes of {key!r}, expected {sent.nbytes}")
            write_bytes(buffer, data)
        self._widen(targets, destinations)
        return reply.header, versions

    def close(self) -> None:
        self.lanes.close()
        super().close()
