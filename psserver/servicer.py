"""The gRPC face of a shard: translates messages to ``ShardStore`` calls and domain errors to
status codes (one table), and nothing else."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from pswire import errors
from pswire.codec import ChunkAssembler, Part
from pswire.v1 import ps_pb2, ps_pb2_grpc
from psserver.store import Registration, ShardStore
from pswire.wire import consistency_from_proto, consistency_to_proto, optimizer_from_proto, optimizer_to_proto

__all__ = ["ParameterServerServicer", "STATUS_CODES"]

log = logging.getLogger(__name__)

STATUS_CODES: dict[type[errors.PSError], grpc.StatusCode] = {
    errors.InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FencedError: grpc.StatusCode.ABORTED,
    errors.TooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotReadyError: grpc.StatusCode.UNAVAILABLE,
    errors.UnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineError: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            context.abort(code, str(exc))
    if isinstance(exc, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    raise exc


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(
        self, store: ShardStore, *, address: str, chunk_bytes: int, max_request_bytes: int, checkpointer=None
    ) -> None:
        self._store = store
        self._checkpointer = checkpointer
        self._address = address
        self._chunk_bytes = chunk_bytes
        self._max_request_bytes = max_request_bytes

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
            )
            result = self._store.register(reg)
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
        )

    def _receive(
        self, request_iterator: Iterator[ps_pb2.TensorMessage], *, initialize: bool
    ) -> tuple[ps_pb2.TensorHeader, list[Part], list]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise errors.InvalidArgumentError("the stream must start with a header")
        header = first.header
        announced = [Part.from_proto(p) for p in header.parts]
        parts = self._store.upload_parts(announced, initialize=initialize)
        total = sum(p.nbytes for p in parts)
        if total > self._max_request_bytes:
            raise errors.TooLargeError(
                f"request carries {total} bytes, above this shard's limit of {self._max_request_bytes}"
            )
        assembler = ChunkAssembler(parts)
        for message in request_iterator:
            if message.WhichOneof("kind") != "chunk":
                raise errors.InvalidArgumentError("only chunks may follow the header")
            assembler.add(message.chunk)
        return header, parts, assembler.finish()

    def Initialize(self, request_iterator, context: grpc.ServicerContext) -> ps_pb2.InitializeResponse:
        try:
            header, _, values = self._receive(request_iterator, initialize=True)
            applied, version = self._store.initialize(header.worker_id, header.generation, values)
        except (errors.PSError, ValueError) as exc:
            log.warning("initialise refused: %s", exc)
            _abort(context, exc)
        return ps_pb2.InitializeResponse(applied=applied, version=version)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        try:
            header, parts, grads = self._receive(request_iterator, initialize=False)
            result = self._store.apply_push(
                header.worker_id, header.generation, header.sequence, header.base_version, parts, grads,
                clock=header.clock, base_clock=header.base_clock,
                data={"step": header.data.step, "epoch": header.data.epoch, "position": header.data.position}
                if header.HasField("data") else None,
            )
        except (errors.PSError, ValueError) as exc:
            self._store.note_rejected()
            log.warning("push refused: %s", exc)
            _abort(context, exc)
        return ps_pb2.PushResponse(version=result.version, staleness=result.staleness, action=result.action.value)

    def Checkpoint(self, request: ps_pb2.CheckpointRequest, context: grpc.ServicerContext) -> ps_pb2.CheckpointResponse:
        try:
            if self._checkpointer is None:
                raise errors.PreconditionError("this shard has no --checkpoint-dir")
            path, version, complete = self._checkpointer.checkpoint(request.checkpoint_id)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        return ps_pb2.CheckpointResponse(
            checkpoint_id=request.checkpoint_id, path=path, version=version, complete=complete
        )

    def Heartbeat(self, request: ps_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> ps_pb2.HeartbeatResponse:
        try:
            lease = self._store.heartbeat(request.worker_id, request.generation)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        return ps_pb2.HeartbeatResponse(lease_seconds=lease)

    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        try:
            self._store.leave(request.worker_id, request.generation)
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        return ps_pb2.LeaveResponse()

    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[ps_pb2.PullMessage]:
        remaining = context.time_remaining()
        wait = 30.0 if remaining is None else max(0.0, remaining - 0.05)
        try:
            snapshot = self._store.pull(
                dict(request.known_versions), chunk_bytes=self._chunk_bytes, timeout=wait,
                worker_id=request.worker_id, generation=request.generation,
                clock=request.clock if request.worker_id else -1,
            )
        except (errors.PSError, ValueError) as exc:
            _abort(context, exc)
        pulled = snapshot.parts
        yield ps_pb2.PullMessage(
            header=ps_pb2.PullHeader(
                version=snapshot.version,
                clock=snapshot.clock,
                parts=[
                    ps_pb2.PulledPart(spec=p.part.to_proto(), version=p.version, included=p.chunks is not None)
                    for p in pulled
                ],
            )
        )
        for index, p in enumerate(pulled):
            offset = 0
            for data in p.chunks or ():
                yield ps_pb2.PullMessage(chunk=ps_pb2.TensorChunk(part_index=index, offset=offset, data=data))
                offset += len(data)

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
        )
