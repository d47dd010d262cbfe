"""The gRPC face of a shard: translates messages to ``ShardStore`` calls and domain errors to
status codes (one table), and nothing else."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc
import numpy as np

from pswire import errors, frames, step
from pswire.codec import Part, array_bytes, wire_dtype_from_proto
from pswire.v1 import ps_pb2, ps_pb2_grpc
from psserver.buffers import settle_heap, trim_heap
from pswire.data import DataTask
from psserver.guard import CallGuard, IdleStreams, tolerant
from psserver.inflight import InflightBudget
from psserver.intake import PushIntake, Traffic, time_left, transport
from psserver.lanes import LaneServer
from psserver.checkpoint import CheckpointError
from psserver.store import PullSnapshot, Registration, ShardStore
from pswire.wire import (
    consistency_from_proto, consistency_to_proto, data_plan_from_proto, data_plan_to_proto, data_status_to_proto,
    optimizer_from_proto, optimizer_to_proto, rows_from_proto, rows_to_proto, table_from_proto, table_to_proto,
)

__all__ = ["INLINE_LIMIT", "ROWS_LIMIT", "ParameterServerServicer", "STATUS_CODES", "Traffic", "add_to_server"]

if TYPE_CHECKING:
    from psserver.lanecalls import StepCall

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


def _views(snapshot: PullSnapshot) -> list[memoryview]:
    """The bytes of every part a pull sends, in order."""
    return [array_bytes(p.value) for p in snapshot.parts if p.value is not None]


def _status(exc: Exception) -> grpc.StatusCode | None:
    """The status a domain error is answered with (None: not one of ours, a bug)."""
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, ValueError) else None


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    code = _status(exc)
    if code is None:
        raise exc
    if isinstance(exc, errors.OverloadedError):
        context.set_trailing_metadata((RETRYABLE,))
    context.abort(code, str(exc))


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
        self.traffic = Traffic()
        self._intake = PushIntake(store, max_request_bytes=max_request_bytes, budget=self._budget, idle=self._idle,
                                  lanes=lanes, traffic=self.traffic)
        self._heap_settled = False  # by the first applied push (psserver.buffers.settle_heap)

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

    def Initialize(self, request_iterator, context: grpc.ServicerContext) -> ps_pb2.InitializeResponse:
        try:
            header, _, values, release = self._intake.stream(request_iterator, initialize=True, context=context)
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
            header, parts, grads, release = self._intake.stream(request_iterator, initialize=False, context=context)
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
                parts, grads, release, screened = self._intake.staged(request.header, request.bulk, context)
            else:
                if len(request.data) != len(request.header.parts):
                    raise errors.InvalidArgumentError(
                        f"inline push carries {len(request.data)} tensors for {len(request.header.parts)} parts"
                    )
                self._store.check_session(request.header.worker_id, request.header.generation, request.header.session)
                parts, grads, release, screened = (*self._intake.inline(request.header, request.data, context), ())
        except (errors.PSError, ValueError) as exc:
            self._store.note_rejected(exc, received=True)
            log.warning("push refused: %s", exc)
            _abort(context, exc)
        return self._push(context, request.header, parts, grads, release, screened)

    def PushPull(self, request: ps_pb2.PushPullRequest, context: grpc.ServicerContext) -> ps_pb2.PushPullResponse:
        asked = checked = None
        header = request.push.header
        # Checked before the push, so that a read this shard would refuse applies nothing.
        try:
            for name in ("rows", "data"):
                extra = getattr(request, name)
                if request.HasField(name) and (extra.worker_id, extra.generation, extra.session) != (
                        header.worker_id, header.generation, header.session):
                    raise errors.InvalidArgumentError(
                        f"a push-and-pull's {name} name worker {extra.worker_id}/{extra.generation}, its push is "
                        f"worker {header.worker_id}/{header.generation}'s: they must be the same registration"
                    )
            if request.HasField("rows"):
                asked = self._rows_asked(request.rows)
                checked = self._store.check_rows(asked)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        pushed = self.PushInline(request.push, context)
        # No pull: a shard holding only table rows, whose rows read says the version and clock.
        pulled = self.PullInline(request.pull, context) if request.HasField("pull") else None
        reply = ps_pb2.PushPullResponse(push=pushed, pull=pulled)
        if asked is not None:
            self._read_rows(request.rows, asked, context, checked, into=reply.rows)
        if request.HasField("data"):
            # The queue's answer, or its refusal: the push is applied either way, so a refusal
            # fails only the exchange (a retried call's reports meet the queue's precondition).
            try:
                reply.data.CopyFrom(self._data(request.data))
            except (errors.PSError, ValueError) as exc:
                code = _status(exc) or grpc.StatusCode.UNKNOWN
                reply.data_refused.CopyFrom(ps_pb2.DataRefusal(code=code.value[0], details=str(exc)))
        return reply

    def Step(self, call: "StepCall", context) -> list:
        """The lean step (``pswire.step``, on bulk lanes only): what ``PushPull`` does with a push
        of every part (or of rows alone), a pull of every part and a read of rows, in the same
        order and with the same checks; answers with the reply's pieces."""
        try:
            request = step.decode_request(call.body)
        except ValueError as exc:
            _abort(context, errors.InvalidArgumentError(f"undecodable Step request: {exc}"))
        asked = [(name, ids) for name, ids in request.reads if ids.size]
        checked = None
        try:
            self._store.check_session(request.worker_id, request.generation, request.session)
            parts, dims = self._store.step_layout()
            for (name, _), dim in zip(request.reads, request.dims):
                if name in dims and dims[name] != dim:
                    raise errors.InvalidArgumentError(f"table {name!r} has rows of {dims[name]} values, the Step "
                                                      f"says {dim}")
            if asked:
                self._check_rows_size(asked)
                checked = self._store.check_rows(asked)  # before the push: a read refused applies nothing
            pushing = parts if len(request.dense) else []
            if not pushing and not request.pushed:
                raise errors.InvalidArgumentError("the request names no variables and no tables")
            rows_bytes = sum(len(b.ids) + len(b.values) for b in request.pushed)
            grads, release = self._intake.flat(pushing, request.dense, rows_bytes, context)
        except (errors.PSError, ValueError) as exc:
            self._store.note_rejected(exc, received=True)
            log.warning("push refused: %s", exc)
            _abort(context, exc)
        result = self._applied(context, request, request.pushed, request.data, pushing, grads, release)
        try:
            values, version, clock = [], result.version, None
            if parts:
                snapshot = self._store.pull({}, timeout=time_left(context, margin=0.05), worker_id=request.worker_id,
                                            generation=request.generation, session=request.session)
                with snapshot:  # copied before the variables are released to the next push
                    values = [b"".join(_views(snapshot))]
                version, clock = snapshot.version, snapshot.clock
                self.traffic.pulled(transport(context), len(values[0]))
            rows = []
            if asked or clock is None:  # with no variables here, the read says where the shard is
                read_version, read_clock, rows = self._store.pull_rows(
                    asked, timeout=time_left(context, margin=0.05), worker_id=request.worker_id,
                    generation=request.generation, session=request.session, checked=checked)
                if clock is None:
                    version, clock = read_version, read_clock
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        got = iter(values for _, _, values in rows)
        read = [next(got) if ids.size else np.empty((0, dim), np.float32) for (_, ids), dim in
                zip(request.reads, request.dims)]
        self.traffic.pulled(transport(context), sum(r.nbytes for r in read))
        return step.encode_reply(result.version, result.staleness, result.action.value, version, clock, values, read)

    def _push(
        self, context, header: ps_pb2.TensorHeader, parts: list[Part], grads: list, release: Callable[[], None],
        screened: Sequence[float | None] = (),
    ) -> ps_pb2.PushResponse:
        """Apply an assembled push (``screened`` as ``ShardStore.apply_push`` takes it); its buffers are released either way."""
        data = ({"step": header.data.step, "epoch": header.data.epoch, "position": header.data.position}
                if header.HasField("data") else None)
        result = self._applied(context, header, header.rows, data, parts, grads, release, screened)
        return ps_pb2.PushResponse(version=result.version, staleness=result.staleness, action=result.action.value)

    def _applied(self, context, who, blocks, data, parts: list[Part], grads: list, release: Callable[[], None],
                 screened: Sequence[float | None] = ()):
        """``ShardStore.apply_push``'s result for a push by ``who`` (its ``worker_id``,
        ``generation``, ``session``, ``sequence``, ``base_version``, ``clock`` and ``base_clock``:
        a ``TensorHeader`` or a ``pswire.step.StepRequest``) of ``parts`` and the row ``blocks``;
        the buffers are released either way, a refusal aborts ``context``."""
        try:
            rows = self._store.decode_rows(blocks) if blocks else ()
            if rows:
                self.traffic.pushed(transport(context), sum(len(b.ids) + len(b.values) for b in blocks))
            result = self._store.apply_push(
                who.worker_id, who.generation, who.sequence, who.base_version, parts, grads,
                clock=who.clock, base_clock=who.base_clock, data=data, session=who.session, rows=rows,
                screened=screened,
            )
        except (errors.PSError, ValueError) as exc:
            self._store.note_rejected(exc)
            log.warning("push refused: %s", exc)
            _abort(context, exc)
        finally:
            release()
        if not self._heap_settled:
            # Training has begun: the initial values (uploaded as glibc's defaults have it, so
            # their chunks were returned at once) are in place, and each call's temporaries
            # should now stay in the heap.
            self._heap_settled = True
            if not settle_heap():
                log.debug("the C heap is left as it is (not glibc, or malloc's bounds set in the environment)")
        return result

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
            return self._data(request)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)

    def _data(self, request: ps_pb2.DataRequest) -> ps_pb2.DataResponse:
        """An exchange with the data queue; raises the queue's refusal (``PSError``, ``ValueError``)."""
        plan = data_plan_from_proto(request.plan) if request.HasField("plan") else None
        finished = [(DataTask(t.epoch, t.start, t.end), t.trained) for t in request.finished]
        tasks, job_plan, queue = self._store.data(
            request.worker_id, request.generation, plan=plan, finished=finished, want=request.want,
            session=request.session,
        )
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
                dict(request.known_versions), timeout=time_left(context, margin=0.05),
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
        self.traffic.pulled(transport(context), nbytes)
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
                    timeout=time_left(context), owner=(request.worker_id, request.generation),
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
        self._check_rows_size(asked)
        return asked

    def _check_rows_size(self, asked: list[tuple[str, np.ndarray]]) -> None:
        """Raises ``TooLargeError`` for a read of more rows than one reply carries."""
        nbytes = self._store.rows_bytes(asked)
        if nbytes > ROWS_LIMIT:
            raise errors.TooLargeError(
                f"PullRows asks for {nbytes} bytes of rows, above the {ROWS_LIMIT} one call answers with: "
                "ask in pieces"
            )

    def _read_rows(self, request: ps_pb2.PullRowsRequest, asked: list[tuple[str, np.ndarray]],
                   context: grpc.ServicerContext, checked: list | None = None,
                   into: ps_pb2.PullRowsResponse | None = None) -> ps_pb2.PullRowsResponse:
        """The rows ``asked`` (:meth:`_rows_asked`), read as ``request`` says (``checked``: the
        store's ``check_rows`` of them), written into ``into`` (a reply's part: the rows are not
        copied again) or a new response; aborts ``context`` on a refusal."""
        try:
            version, clock, rows = self._store.pull_rows(
                asked, timeout=time_left(context, margin=0.05), worker_id=request.worker_id,
                generation=request.generation, clock=request.clock,
                session=request.session if request.worker_id else None, checked=checked,
            )
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        reply = ps_pb2.PullRowsResponse() if into is None else into
        reply.version, reply.clock = version, clock
        for name, ids, values in rows:
            rows_to_proto(name, ids, values, add_to=reply.rows)
        self.traffic.pulled(transport(context), sum(len(b.values) for b in reply.rows))
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
