"""The gRPC face of a shard: translates messages to ``ShardStore`` calls and domain errors to
status codes (one table), and nothing else."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc
import numpy as np

from pswire import errors, frames
from pswire.codec import ChunkAssembler, Part, array_bytes, on_wire, wire_dtype_from_proto
from pswire.v1 import ps_pb2, ps_pb2_grpc
from psserver.buffers import BufferPool, trim_heap
from pswire.data import DataTask
from psserver.guard import CallGuard, IdleStreams, Undecodable, tolerant
from psserver.inflight import InflightBudget, Transfer
from psserver.lanes import LaneServer
from psserver.checkpoint import CheckpointError
from psserver.store import PullSnapshot, Registration, ShardStore
from pswire.wire import (
    consistency_from_proto, consistency_to_proto, data_plan_from_proto, data_plan_to_proto, data_status_to_proto,
    optimizer_from_proto, optimizer_to_proto, rows_from_proto, rows_to_proto, table_from_proto, table_to_proto,
)

__all__ = ["INLINE_LIMIT", "ROWS_LIMIT", "ParameterServerServicer", "STATUS_CODES", "Traffic", "add_to_server"]

log = logging.getLogger(__name__)

STATUS_CODES: dict[type[errors.PSError], grpc.StatusCode] = {
    errors.InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FencedError: grpc.StatusCode.ABORTED,
    errors.TooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.OverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    errors.PreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotReadyError: grpc.StatusCode.UNAVAILABLE,
    errors.UnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineError: grpc.StatusCode.DEADLINE_EXCEEDED,
}


SERVICE = "pswire.v1.ParameterServer"

RETRYABLE = ("ps-retryable", "1")
"""Trailing metadata of a RESOURCE_EXHAUSTED that is admission control (retry after a backoff),
not a request too large to ever succeed."""

INLINE_LIMIT = 4 << 20
"""The most bytes a PullInline answers with; larger shards are pulled as a stream."""

ROWS_LIMIT = 32 << 20
"""The most bytes of rows one PullRows answers with (clients split larger reads): checked before
any row is read, so a request for millions of rows costs the shard nothing."""

# Chunks skip protobuf both ways (pswire.frames): streamed requests are decoded to views of the
# received bytes, and a pull's chunks are encoded straight from the variables' memory (the
# snapshot holds the variables themselves until the stream ends).
_REQUEST_DECODERS = {"Push": frames.decoder(ps_pb2.TensorMessage), "Initialize": frames.decoder(ps_pb2.TensorMessage)}
_RESPONSE_ENCODERS = {"Pull": frames.serialize}


def add_to_server(servicer: "ParameterServerServicer", server: grpc.Server) -> None:
    """Register every method of the service in ``ps.proto`` (what the generated
    ``add_ParameterServerServicer_to_server`` does), with the chunk codecs above, tolerant
    decoding and the guard that maps every exception to a status."""
    handlers = {}
    guard = servicer.guard
    for method in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods:
        request_type = getattr(ps_pb2, method.input_type.name)
        response_type = getattr(ps_pb2, method.output_type.name)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        behavior = getattr(servicer, method.name)
        wrap = guard.streaming if method.server_streaming else guard.unary
        handlers[method.name] = kind(
            wrap(method.name, behavior),
            request_deserializer=tolerant(_REQUEST_DECODERS.get(method.name, request_type.FromString)),
            response_serializer=_RESPONSE_ENCODERS.get(method.name, response_type.SerializeToString),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def _time_left(context: grpc.ServicerContext | None, margin: float = 0.0) -> float:
    """Seconds a handler may wait: the call's remaining deadline less ``margin`` (kept to answer
    in time), or 30 s for a call without a deadline."""
    remaining = context.time_remaining() if context is not None else None
    return 30.0 if remaining is None else max(0.0, remaining - margin)


def _transport(context) -> str:
    """How a call's own bytes came or go: in gRPC messages, or in a call a bulk lane carried
    (``psserver.lanecalls.LaneContext``)."""
    return getattr(context, "transport", "grpc")


def _views(snapshot: PullSnapshot) -> list[memoryview]:
    """The bytes of every part a pull sends, in order."""
    return [array_bytes(p.value) for p in snapshot.parts if p.value is not None]


class Traffic:
    """Tensor bytes of pushes received and of pulls sent, by transport (``grpc``: in gRPC
    messages; ``lane``: on a bulk lane), counted where the bytes are taken or handed over."""

    TRANSPORTS = ("grpc", "lane")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _pushed and _pulled
        self._pushed = dict.fromkeys(self.TRANSPORTS, 0)
        self._pulled = dict.fromkeys(self.TRANSPORTS, 0)

    def pushed(self, transport: str, nbytes: int) -> None:
        with self._lock:
            self._pushed[transport] += nbytes

    def pulled(self, transport: str, nbytes: int) -> None:
        with self._lock:
            self._pulled[transport] += nbytes

    def totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(pushed, pulled)``: bytes by transport so far."""
        with self._lock:
            return dict(self._pushed), dict(self._pulled)


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            if isinstance(exc, errors.OverloadedError):
                context.set_trailing_metadata((RETRYABLE,))
            context.abort(code, str(exc))
    if isinstance(exc, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    raise exc


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(
        self, store: ShardStore, *, address: str, chunk_bytes: int, max_request_bytes: int, checkpointer=None,
        lanes: LaneServer | None = None, budget: InflightBudget | None = None, stream_idle_timeout: float = 10.0,
    ) -> None:
        self._store = store
        self.guard = CallGuard()
        self._idle = IdleStreams(stream_idle_timeout)
        self._lanes = lanes
        self._budget = budget or InflightBudget(0)
        self._checkpointer = checkpointer
        self._address = address
        self._chunk_bytes = chunk_bytes
        self._max_request_bytes = max_request_bytes
        self._buffers = BufferPool()  # one free buffer per part and push once in flight at once
        self.traffic = Traffic()

    def stop(self) -> None:
        """Stop the idle-stream watchdog (the server has stopped serving)."""
        self._idle.stop()

    def Register(self, request: ps_pb2.RegisterRequest, context: grpc.ServicerContext) -> ps_pb2.RegisterResponse:
        try:
            if not request.worker_name:
                raise errors.InvalidArgumentError("worker_name is empty")
            if request.num_shards < 1 or not 0 <= request.shard_index < request.num_shards:
                raise errors.InvalidArgumentError(
                    f"shard index {request.shard_index} of {request.num_shards} shards is impossible"
                )
            reg = Registration(
                worker_name=request.worker_name,
                shard_index=request.shard_index,
                num_shards=request.num_shards,
                placement_digest=request.placement_digest,
                parts=tuple(Part.from_proto(p) for p in request.parts),
                optimizer=optimizer_from_proto(request.optimizer),
                job_fingerprint=request.job_fingerprint,
                consistency=consistency_from_proto(request.consistency),
                tables=tuple(table_from_proto(t) for t in request.tables),
            )
            result = self._store.register(reg, session=request.session)
        except (errors.PSError, ValueError) as exc:
            log.warning("register of %r refused: %s", request.worker_name, exc)
            _abort(context, exc)
        return ps_pb2.RegisterResponse(
            worker_id=result.worker_id,
            generation=result.generation,
            must_initialize=result.must_initialize,
            version=result.version,
            clock=result.clock,
            consistency=consistency_to_proto(result.consistency),
            lease_seconds=result.lease_seconds,
            data=ps_pb2.DataPosition(**result.data) if result.data else None,
            bulk_port=self._lanes.port if self._lanes is not None else 0,
            session=result.session,
            workers_live=result.workers_live,
        )

    def _receive(
        self, request_iterator: Iterator[ps_pb2.TensorMessage], *, initialize: bool,
        context: grpc.ServicerContext | None = None,
    ) -> tuple[ps_pb2.TensorHeader, list[Part], list, Callable[[], None]]:
        messages = self._idle.watch(iter(request_iterator), context)
        first = next(messages, None)
        if isinstance(first, Undecodable):
            raise errors.InvalidArgumentError(f"undecodable stream message: {first.reason}")
        if not isinstance(first, ps_pb2.TensorMessage) or first.WhichOneof("kind") != "header":
            raise errors.InvalidArgumentError("the stream must start with a header")
        header = first.header
        # Who is sending is settled before any of its bytes are read.
        if initialize:
            if not self._store.may_initialize(header.worker_id, header.generation, session=header.session):
                self._expect(header, initialize=True)  # still a well-formed upload, or told why not
                return header, [], [], None
        else:
            self._store.check_session(header.worker_id, header.generation, header.session)

        def chunks() -> Iterator[frames.Chunk]:
            for message in messages:
                if isinstance(message, Undecodable):
                    raise errors.InvalidArgumentError(f"undecodable stream message: {message.reason}")
                if not isinstance(message, frames.Chunk):
                    raise errors.InvalidArgumentError("only chunks may follow the header")
                yield message

        return (header, *self._assemble(header, chunks(), initialize=initialize, context=context))

    def _take(self, parts: Sequence[Part]) -> list[np.ndarray]:
        return [self._buffers.take(p.shape, p.dtype) for p in parts]

    def _expect(self, header: ps_pb2.TensorHeader, *, initialize: bool) -> tuple[list[Part], list[Part]]:
        """The parts a push or initialisation announces, validated, and the same parts as they
        travel (narrower when the worker compresses them)."""
        parts = self._store.upload_parts([Part.parsed(p) for p in header.parts], initialize=initialize,
                                         rows=bool(header.rows))
        if initialize and header.rows:
            raise errors.InvalidArgumentError("an initialisation carries no table rows (rows start at their initial "
                                              "values on the shards)")
        wire = wire_dtype_from_proto(header.wire_dtype)
        if wire is not None and initialize:
            raise errors.InvalidArgumentError("initial values must be sent in their own dtypes, not compressed")
        sent = [on_wire(p, wire) for p in parts]
        total = sum(p.nbytes for p in sent) + sum(len(b.ids) + len(b.values) for b in header.rows)
        if total > self._max_request_bytes:
            raise errors.TooLargeError(
                f"request carries {total} bytes, above this shard's limit of {self._max_request_bytes}"
            )
        return parts, sent

    def _assemble(
        self, header: ps_pb2.TensorHeader, chunks: Iterable[frames.Chunk], *, initialize: bool,
        context: grpc.ServicerContext | None = None,
    ) -> tuple[list[Part], list[np.ndarray], Callable[[], None]]:
        """Validate the header's parts, then copy the chunks into place. A push's gradients land
        in pooled buffers (given back by the returned release, once applied) and, when compressed,
        are widened to the variables' dtypes; initial values become the variables, so they get
        buffers of their own. Every chunk's bytes are taken from the in-flight budget as they
        arrive (initial values' too, until adopted), waiting for room until the call's deadline
        (``NotReadyError`` then: retryable)."""
        parts, sent = self._expect(header, initialize=initialize)
        transfer = self._budget.transfer()
        timeout = _time_left(context, margin=0.05)
        deadline = time.monotonic() + timeout
        buffers = None if initialize else self._take(sent)
        try:
            assembler = ChunkAssembler(sent, None if buffers is None else [array_bytes(b) for b in buffers])
            for chunk in chunks:
                self._take_budget(transfer, len(chunk.data), deadline)
                assembler.add(chunk)
            allocated = assembler.finish()
            received = allocated if buffers is None else buffers
        except BaseException:
            if buffers is not None:
                self._buffers.give(*buffers)
            transfer.close()
            raise
        if initialize:
            return parts, received, transfer.close
        self.traffic.pushed(_transport(context), sum(p.nbytes for p in sent))

        def release() -> None:
            self._buffers.give(*received)
            transfer.close()

        return (parts, *self._widen(parts, sent, received, release))

    def _inline(
        self, header: ps_pb2.TensorHeader, data: Sequence[bytes], context: grpc.ServicerContext | None,
    ) -> tuple[list[Part], list[np.ndarray], Callable[[], None]]:
        """An inline push's gradients: read-only views of the request's own bytes (copies where
        a part's bytes are not aligned for its dtype), budgeted at once. A compressed push is
        assembled and widened as a streamed one is."""
        if header.wire_dtype:  # compressed: widened into pooled buffers
            chunks = (frames.Chunk(index, 0, blob) for index, blob in enumerate(data))
            return self._assemble(header, chunks, initialize=False, context=context)
        parts, _ = self._expect(header, initialize=False)
        blobs = list(data)
        for part, blob in zip(parts, blobs):
            if len(blob) != part.nbytes:
                raise errors.InvalidArgumentError(
                    f"byte length of {part.key!r} is {len(blob)}, expected {part.nbytes} ({part.describe()})"
                )
        total = sum(map(len, blobs))
        transfer = self._budget.transfer()
        try:
            self._take_budget(transfer, total, time.monotonic() + _time_left(context, margin=0.05))
        except BaseException:
            transfer.close()
            raise
        grads = []
        for part, blob in zip(parts, blobs):
            grad = np.frombuffer(blob, dtype=part.dtype.numpy).reshape(part.shape)
            grads.append(grad if grad.flags.aligned else grad.copy())
        self.traffic.pushed(_transport(context), total)
        return parts, grads, transfer.close

    def _take_budget(self, transfer: Transfer, nbytes: int, deadline: float) -> None:
        if not transfer.acquire(nbytes, max(0.0, deadline - time.monotonic())):
            raise errors.NotReadyError(
                f"no room for a push's bytes: {self._budget.held} bytes of pushes in flight on this shard "
                f"(--max-inflight-bytes {self._budget.limit}); retry"
            )

    def _widen(
        self, parts: list[Part], sent: list[Part], received: list[np.ndarray], release: Callable[[], None]
    ) -> tuple[list[np.ndarray], Callable[[], None]]:
        """``received`` in the variables' dtypes: as is when nothing was compressed, else in
        pooled buffers (and ``received`` released at once)."""
        if all(s is p for s, p in zip(sent, parts)):  # nothing compressed: on_wire returned the parts
            return received, release
        widened = self._take(parts)
        for full, narrow in zip(widened, received):
            full[...] = narrow
        release()
        return widened, lambda: self._buffers.give(*widened)

    def _staged(
        self, header: ps_pb2.TensorHeader, bulk: ps_pb2.BulkRef, context: grpc.ServicerContext
    ) -> tuple[list[Part], list[np.ndarray], Callable[[], None]]:
        """A push whose bytes were staged on a bulk lane: the gradients are views of the staged
        buffer (no copy), which goes back to the lanes' pool on release."""
        if self._lanes is None:
            raise errors.PreconditionError("this shard has no bulk lanes (--bulk-port off): send the bytes inline")
        self._store.check_session(header.worker_id, header.generation, header.session)
        parts, sent = self._expect(header, initialize=False)
        total = sum(p.nbytes for p in sent)
        if bulk.nbytes != total:
            raise errors.InvalidArgumentError(f"bulk push names {bulk.nbytes} bytes, but its parts hold {total}")
        buffer = self._lanes.claim(
            bulk.lane, bulk.token, total, _time_left(context), owner=(header.worker_id, header.generation)
        )
        self.traffic.pushed("lane", total)
        views, copies, offset = [], [], 0
        for part in sent:
            piece = buffer[offset : offset + part.nbytes]
            offset += part.nbytes
            if piece.size and piece.ctypes.data % part.dtype.itemsize:  # misaligned for a view
                own = self._buffers.take(part.shape, part.dtype)
                array_bytes(own)[:] = piece
                copies.append(own)
                views.append(own)
            else:
                views.append(piece.view(part.dtype.numpy).reshape(part.shape))

        def release() -> None:
            self._lanes.give_back(buffer)
            self._buffers.give(*copies)

        return (parts, *self._widen(parts, sent, views, release))

    def Initialize(self, request_iterator, context: grpc.ServicerContext) -> ps_pb2.InitializeResponse:
        try:
            header, _, values, release = self._receive(request_iterator, initialize=True, context=context)
            if release is None:  # initialised already: the bytes are not read
                return ps_pb2.InitializeResponse(applied=False, version=self._store.status()["version"])
            try:
                applied, version = self._store.initialize(
                    header.worker_id, header.generation, values, session=header.session
                )
            finally:
                release()
            del values
            trim_heap()
        except (errors.PSError, ValueError) as exc:
            log.warning("initialise refused: %s", exc)
            _abort(context, exc)
        return ps_pb2.InitializeResponse(applied=applied, version=version)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        try:
            header, parts, grads, release = self._receive(request_iterator, initialize=False, context=context)
        except (errors.PSError, ValueError) as exc:
            self._store.note_rejected(exc, received=True)
            log.warning("push refused: %s", exc)
            _abort(context, exc)
        return self._push(context, header, parts, grads, release)

    def PushInline(self, request: ps_pb2.InlinePush, context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        try:
            if request.HasField("bulk"):
                if request.data:
                    raise errors.InvalidArgumentError("a push staged on a bulk lane carries no inline data")
                parts, grads, release = self._staged(request.header, request.bulk, context)
            else:
                if len(request.data) != len(request.header.parts):
                    raise errors.InvalidArgumentError(
                        f"inline push carries {len(request.data)} tensors for {len(request.header.parts)} parts"
                    )
                self._store.check_session(request.header.worker_id, request.header.generation, request.header.session)
                parts, grads, release = self._inline(request.header, request.data, context)
        except (errors.PSError, ValueError) as exc:
            self._store.note_rejected(exc, received=True)
            log.warning("push refused: %s", exc)
            _abort(context, exc)
        return self._push(context, request.header, parts, grads, release)

    def PushPull(self, request: ps_pb2.PushPullRequest, context: grpc.ServicerContext) -> ps_pb2.PushPullResponse:
        asked = None
        if request.HasField("rows"):
            # Checked before the push, so that a read this shard would refuse applies nothing.
            try:
                header, rows = request.push.header, request.rows
                if (rows.worker_id, rows.generation, rows.session) != (header.worker_id, header.generation,
                                                                       header.session):
                    raise errors.InvalidArgumentError(
                        f"a push-and-pull's rows are read by worker {rows.worker_id}/{rows.generation}, its push is "
                        f"worker {header.worker_id}/{header.generation}'s: they must be the same registration"
                    )
                asked = self._rows_asked(rows)
                self._store.check_rows(asked)
            except (errors.PSError, ValueError) as exc:
                _abort(context, exc)
        pushed = self.PushInline(request.push, context)
        reply = ps_pb2.PushPullResponse(push=pushed, pull=self.PullInline(request.pull, context))
        if asked is not None:
            reply.rows.CopyFrom(self._read_rows(request.rows, asked, context))
        return reply

    def _push(
        self, context, header: ps_pb2.TensorHeader, parts: list[Part], grads: list, release: Callable[[], None]
    ) -> ps_pb2.PushResponse:
        """Apply an assembled push; its buffers are released either way."""
        try:
            rows = self._store.decode_rows(header.rows) if header.rows else ()
            if rows:
                self.traffic.pushed(_transport(context), sum(len(b.ids) + len(b.values) for b in header.rows))
            result = self._store.apply_push(
                header.worker_id, header.generation, header.sequence, header.base_version, parts, grads,
                clock=header.clock, base_clock=header.base_clock,
                data={"step": header.data.step, "epoch": header.data.epoch, "position": header.data.position}
                if header.HasField("data") else None,
                session=header.session, rows=rows,
            )
        except (errors.PSError, ValueError) as exc:
            self._store.note_rejected(exc)
            log.warning("push refused: %s", exc)
            _abort(context, exc)
        finally:
            release()
        return ps_pb2.PushResponse(version=result.version, staleness=result.staleness, action=result.action.value)

    def Checkpoint(self, request: ps_pb2.CheckpointRequest, context: grpc.ServicerContext) -> ps_pb2.CheckpointResponse:
        try:
            if self._checkpointer is None:
                raise errors.PreconditionError("this shard has no --checkpoint-dir")
            try:
                path, version, complete = self._checkpointer.checkpoint(request.checkpoint_id)
            except OSError as exc:
                raise errors.PreconditionError(
                    f"cannot write checkpoint {request.checkpoint_id} in {self._checkpointer.directory}: "
                    f"{exc.strerror or exc}"
                ) from exc
        except (errors.PSError, ValueError) as exc:
            log.warning("checkpoint %d refused: %s", request.checkpoint_id, exc)
            _abort(context, exc)
        return ps_pb2.CheckpointResponse(
            checkpoint_id=request.checkpoint_id, path=path, version=version, complete=complete
        )

    def EndJob(self, request: ps_pb2.EndJobRequest, context: grpc.ServicerContext) -> ps_pb2.EndJobResponse:
        checkpointer, checkpoint_id = self._checkpointer, request.checkpoint_id

        def final(exported: tuple[int, dict, dict]) -> tuple[str, int, bool]:
            assert checkpointer is not None
            try:
                return checkpointer.write(checkpoint_id, exported)
            except OSError as exc:
                raise errors.PreconditionError(
                    f"cannot write checkpoint {checkpoint_id} in {checkpointer.directory}: {exc.strerror or exc}; "
                    "the job goes on"
                ) from exc

        try:
            if checkpoint_id and checkpointer is None:
                raise errors.PreconditionError(
                    "this shard has no --checkpoint-dir, so it cannot write a final checkpoint: the job goes on"
                )
            ended = self._store.end_job(final if checkpoint_id else None, job_fingerprint=request.job_fingerprint)
        except (errors.PSError, ValueError) as exc:
            log.warning("end-job refused: %s", exc)
            _abort(context, exc)
        if ended is None:
            return ps_pb2.EndJobResponse(ended=False)
        if checkpointer is not None:
            try:
                checkpointer.mark_ended(ended.job_fingerprint)
            except (OSError, CheckpointError) as exc:  # the job has ended all the same
                log.warning("could not mark the ended job's checkpoints in %s: %s; a --restore from there would "
                            "bring it back", checkpointer.directory, exc)
        path, _, complete = ended.final if ended.final is not None else ("", 0, False)
        return ps_pb2.EndJobResponse(
            ended=True, job_fingerprint=ended.job_fingerprint, version=ended.version,
            workers_live=ended.workers_live, checkpoint_path=path, checkpoint_complete=complete,
        )

    def Heartbeat(self, request: ps_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> ps_pb2.HeartbeatResponse:
        try:
            lease = self._store.heartbeat(request.worker_id, request.generation, session=request.session)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        return ps_pb2.HeartbeatResponse(lease_seconds=lease)

    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        try:
            self._store.leave(request.worker_id, request.generation, session=request.session)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        return ps_pb2.LeaveResponse()

    def Data(self, request: ps_pb2.DataRequest, context: grpc.ServicerContext) -> ps_pb2.DataResponse:
        try:
            plan = data_plan_from_proto(request.plan) if request.HasField("plan") else None
            finished = [(DataTask(t.epoch, t.start, t.end), t.trained) for t in request.finished]
            tasks, job_plan, queue = self._store.data(
                request.worker_id, request.generation, plan=plan, finished=finished, want=request.want,
                session=request.session,
            )
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        return ps_pb2.DataResponse(
            tasks=[ps_pb2.DataTask(epoch=t.epoch, start=t.start, end=t.end) for t in tasks],
            plan=data_plan_to_proto(job_plan), queue=data_status_to_proto(queue),
        )

    def _snapshot(
        self, request: ps_pb2.PullRequest, context: grpc.ServicerContext
    ) -> tuple[ps_pb2.PullHeader, PullSnapshot]:
        """The pull's header and snapshot; the caller releases the snapshot once it is sent."""
        try:
            snapshot = self._store.pull(
                dict(request.known_versions), timeout=_time_left(context, margin=0.05),
                worker_id=request.worker_id, generation=request.generation,
                clock=request.clock if request.worker_id else -1, wire_dtype=wire_dtype_from_proto(request.wire_dtype),
                session=request.session,
            )
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        header = ps_pb2.PullHeader(
            version=snapshot.version,
            clock=snapshot.clock,
            wire_dtype=request.wire_dtype,
            parts=[
                ps_pb2.PulledPart(spec=p.part.spec, version=p.version, included=p.value is not None)
                for p in snapshot.parts
            ],
        )
        return header, snapshot

    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[ps_pb2.PullMessage | bytes]:
        header, snapshot = self._snapshot(request, context)
        with snapshot:
            yield ps_pb2.PullMessage(header=header)
            step = self._chunk_bytes
            for index, pulled in enumerate(snapshot.parts):  # chunks name the header's part index
                if pulled.value is not None:
                    view = array_bytes(pulled.value)
                    for offset in range(0, len(view), step):  # encoded as the stream asks for them
                        yield frames.encode_chunk(index, offset, view[offset : offset + step])
                    self.traffic.pulled("grpc", len(view))

    def PullInline(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> ps_pb2.InlinePull:
        if request.HasField("bulk"):
            return self._pull_on_lane(request, context)
        header, snapshot = self._snapshot(request, context)
        with snapshot:
            views = _views(snapshot)
            nbytes = sum(map(len, views))
            if nbytes > INLINE_LIMIT:
                _abort(context, errors.TooLargeError(f"this shard holds over {INLINE_LIMIT} bytes: use Pull"))
            reply = ps_pb2.InlinePull(header=header, data=[bytes(v) for v in views])
        self.traffic.pulled(_transport(context), nbytes)
        return reply

    def _pull_on_lane(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> ps_pb2.InlinePull:
        """Send the pull's header and bytes on the lane the request names, straight from the
        variables, before answering."""
        if self._lanes is None:
            _abort(context, errors.PreconditionError("this shard has no bulk lanes (--bulk-port off): pull inline"))
        if not request.worker_id:
            _abort(context, errors.InvalidArgumentError("a pull on a bulk lane must name the worker whose lane it is"))
        header, snapshot = self._snapshot(request, context)
        with snapshot:
            views = _views(snapshot)
            try:
                self._lanes.deliver(
                    request.bulk.lane, request.bulk.token, header.SerializeToString(), views,
                    timeout=_time_left(context), owner=(request.worker_id, request.generation),
                )
            except errors.PSError as exc:
                _abort(context, exc)
        nbytes = sum(len(v) for v in views)
        self.traffic.pulled("lane", nbytes)
        return ps_pb2.InlinePull(header=header, bulk_bytes=nbytes)

    def PullRows(self, request: ps_pb2.PullRowsRequest, context: grpc.ServicerContext) -> ps_pb2.PullRowsResponse:
        try:
            asked = self._rows_asked(request)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        return self._read_rows(request, asked, context)

    def _rows_asked(self, request: ps_pb2.PullRowsRequest) -> list[tuple[str, np.ndarray]]:
        """A rows read's ``(table, ids)``; raises ``InvalidArgumentError`` for bad ids or a table
        listed twice, ``TooLargeError`` for more rows than one reply carries."""
        asked = []
        for block in request.rows:
            ids, _ = rows_from_proto(block, None)
            asked.append((block.table, ids))
        if len({name for name, _ in asked}) != len(asked):
            raise errors.InvalidArgumentError("a table is listed twice in one PullRows")
        nbytes = self._store.rows_bytes(asked)
        if nbytes > ROWS_LIMIT:
            raise errors.TooLargeError(
                f"PullRows asks for {nbytes} bytes of rows, above the {ROWS_LIMIT} one call answers with: "
                "ask in pieces"
            )
        return asked

    def _read_rows(self, request: ps_pb2.PullRowsRequest, asked: list[tuple[str, np.ndarray]],
                   context: grpc.ServicerContext) -> ps_pb2.PullRowsResponse:
        """The rows ``asked`` (:meth:`_rows_asked`), read as ``request`` says; aborts ``context``
        on a refusal."""
        try:
            version, clock, rows = self._store.pull_rows(
                asked, timeout=_time_left(context, margin=0.05), worker_id=request.worker_id,
                generation=request.generation, clock=request.clock,
                session=request.session if request.worker_id else None,
            )
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        reply = ps_pb2.PullRowsResponse(version=version, clock=clock,
                                        rows=[rows_to_proto(name, ids, values) for name, ids, values in rows])
        self.traffic.pulled(_transport(context), sum(len(b.values) for b in reply.rows))
        return reply

    def Status(self, request: ps_pb2.StatusRequest, context: grpc.ServicerContext) -> ps_pb2.StatusResponse:
        s = self._store.status()
        return ps_pb2.StatusResponse(
            address=self._address,
            shard_index=s["shard_index"],
            num_shards=s["num_shards"],
            state=s["state"],
            version=s["version"],
            num_variables=len(s["parts"]),
            bytes_held=s["bytes_held"],
            optimizer_state_bytes=s["optimizer_state_bytes"],
            optimizer=optimizer_to_proto(s["optimizer"]) if s["optimizer"] else None,
            workers=[ps_pb2.WorkerInfo(**w) for w in s["workers"]],
            pushes_received=s["pushes_received"],
            pushes_applied=s["pushes_applied"],
            pushes_rejected=s["pushes_rejected"],
            pulls_served=s["pulls_served"],
            max_staleness=s["max_staleness"],
            job_fingerprint=s["job_fingerprint"],
            parts=[p.to_proto() for p in s["parts"]],
            uptime_seconds=s["uptime_seconds"],
            placement_digest=s["placement_digest"],
            consistency=consistency_to_proto(s["consistency"]) if s["consistency"] else None,
            clock=s["clock"],
            pushes_dropped=s["pushes_dropped"],
            pushes_scaled=s["pushes_scaled"],
            staleness_histogram=[
                ps_pb2.StalenessBucket(staleness=i, count=c) for i, c in enumerate(s["staleness_histogram"])
            ],
            pulls_waiting=s["pulls_waiting"],
            pull_wait_seconds=s["pull_wait_seconds"],
            workers_evicted=s["workers_evicted"],
            lease_seconds=s["lease_seconds"],
            last_checkpoint_id=self._checkpointer.last_id if self._checkpointer else 0,
            last_checkpoint_path=self._checkpointer.last_path if self._checkpointer else "",
            checkpoint_dir=self._checkpointer.directory if self._checkpointer else "",
            push_bytes_in_flight=self._budget.held,
            push_bytes_in_flight_peak=self._budget.peak,
            max_inflight_bytes=self._budget.limit,
            updates_nonfinite=s["updates_nonfinite"],
            data=data_status_to_proto(s["data"]) if s["data"] else None,
            tables=[ps_pb2.TableStatus(spec=table_to_proto(t.pop("spec")), **t) for t in s["tables"]],
        )
