"""A push's gradients, from whichever transport carried them: a gRPC stream of chunks, one
inline message, or a buffer a bulk lane staged. Each is validated against the job's parts before
its bytes are read (``ShardStore.upload_parts``), budgeted as it arrives (``--max-inflight-bytes``),
and widened to the variables' dtypes when the worker compressed it; what comes out is arrays
ready for ``ShardStore.apply_push`` and a release that gives their buffers back once applied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc
import numpy as np

from pswire import errors, frames
from pswire.codec import ChunkAssembler, Part, array_bytes, on_wire, wire_dtype_from_proto
from pswire.v1 import ps_pb2
from psserver.buffers import BufferPool
from psserver.guard import IdleStreams, Undecodable
from psserver.inflight import InflightBudget, Transfer
from psserver.lanes import LaneServer
from psserver.store import ShardStore

__all__ = ["PushIntake", "Traffic", "time_left", "transport"]


def time_left(context: grpc.ServicerContext | None, margin: float = 0.0) -> float:
    """Seconds a handler may wait: the call's remaining deadline less ``margin`` (kept to answer
    in time), or 30 s for a call without a deadline."""
    remaining = context.time_remaining() if context is not None else None
    return 30.0 if remaining is None else max(0.0, remaining - margin)


def transport(context) -> str:
    """How a call's own bytes came or go: in gRPC messages, or in a call a bulk lane carried
    (``psserver.lanecalls.LaneContext``)."""
    return getattr(context, "transport", "grpc")


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


class PushIntake:
    """The gradients of a shard's pushes (and its initial values), from the bytes that carried them."""

    def __init__(self, store: ShardStore, *, max_request_bytes: int, budget: InflightBudget, idle: IdleStreams,
                 lanes: LaneServer | None, traffic: Traffic) -> None:
        self._store = store
        self._max_request_bytes = max_request_bytes
        self._budget = budget
        self._idle = idle
        self._lanes = lanes
        self._traffic = traffic
        self._buffers = BufferPool()  # one free buffer per part and push once in flight at once

    def stream(
        self, request_iterator: Iterator[ps_pb2.TensorMessage], *, initialize: bool,
        context: grpc.ServicerContext | None = None,
    ) -> tuple[ps_pb2.TensorHeader, list[Part], list, Callable[[], None]]:
        """A streamed push (or, with ``initialize``, initial values): ``(header, parts, arrays,
        release)``; for initial values this registration may not upload (another worker's won),
        the header checked and no parts, arrays or release. The sender's session is checked before
        any of its bytes are read. Raises ``pswire.errors`` errors naming the problem: a stream
        that does not start with a header, an undecodable message, parts or sizes the job does not
        have, a request above ``max_request_bytes``, no room in the in-flight budget."""
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
        timeout = time_left(context, margin=0.05)
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
        self._traffic.pushed(transport(context), sum(p.nbytes for p in sent))

        def release() -> None:
            self._buffers.give(*received)
            transfer.close()

        return (parts, *self._widen(parts, sent, received, release))

    def inline(
        self, header: ps_pb2.TensorHeader, data: Sequence[bytes], context: grpc.ServicerContext | None,
    ) -> tuple[list[Part], list[np.ndarray], Callable[[], None]]:
        """An inline push's gradients: read-only views of the request's own bytes (copies where
        a part's bytes are not aligned for its dtype), budgeted at once. A compressed push is
        assembled and widened as a streamed one is."""
        if header.wire_dtype:  # compressed: widened into pooled buffers
            chunks = (frames.Chunk(index, 0, blob) for index, blob in enumerate(data))
            return self._assemble(header, chunks, initialize=False, context=context)
        parts, _ = self._expect(header, initialize=False)
        grads, release = self._views(parts, list(data), context)
        return parts, grads, release

    def flat(self, parts: Sequence[Part], dense: memoryview, rows_bytes: int,
             context: grpc.ServicerContext | None) -> tuple[list[np.ndarray], Callable[[], None]]:
        """A ``Step`` push's gradients (``pswire.step``): every part of ``parts`` end to end in
        ``dense``, as :meth:`inline` takes them; ``rows_bytes``: the bytes of the rows it pushes,
        which count towards the shard's limit on a request too."""
        expected = sum(p.nbytes for p in parts)
        if len(dense) != expected:
            raise errors.InvalidArgumentError(
                f"a Step's dense gradient is {len(dense)} bytes, this shard's variables take {expected} "
                f"({', '.join(p.describe() for p in parts)})"
            )
        if expected + rows_bytes > self._max_request_bytes:
            raise errors.TooLargeError(f"request carries {expected + rows_bytes} bytes, above this shard's limit "
                                       f"of {self._max_request_bytes}")
        blobs, at = [], 0
        for part in parts:
            blobs.append(dense[at:at + part.nbytes])
            at += part.nbytes
        return self._views(parts, blobs, context)

    def _views(self, parts: Sequence[Part], blobs: list, context: grpc.ServicerContext | None,
               ) -> tuple[list[np.ndarray], Callable[[], None]]:
        """Gradients as views of ``blobs`` (one per part, its length checked), budgeted at once."""
        for part, blob in zip(parts, blobs):
            if len(blob) != part.nbytes:
                raise errors.InvalidArgumentError(
                    f"byte length of {part.key!r} is {len(blob)}, expected {part.nbytes} ({part.describe()})"
                )
        total = sum(map(len, blobs))
        transfer = self._budget.transfer()
        try:
            self._take_budget(transfer, total, time.monotonic() + time_left(context, margin=0.05))
        except BaseException:
            transfer.close()
            raise
        grads = []
        for part, blob in zip(parts, blobs):
            grad = np.frombuffer(blob, dtype=part.dtype.numpy).reshape(part.shape)
            grads.append(grad if grad.flags.aligned else grad.copy())
        self._traffic.pushed(transport(context), total)
        return grads, transfer.close

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

    def staged(
        self, header: ps_pb2.TensorHeader, bulk: ps_pb2.BulkRef, context: grpc.ServicerContext
    ) -> tuple[list[Part], list[np.ndarray], Callable[[], None], list[float | None]]:
        """A push whose bytes were staged on a bulk lane: the gradients are views of the staged
        buffer (no copy), which goes back to the lanes' pool on release; and per gradient, the
        bound its bytes were read for while they arrived (``ShardStore.apply_push``'s
        ``screened``): float32 gradients of a push of several pieces, sent uncompressed."""
        if self._lanes is None:
            raise errors.PreconditionError("this shard has no bulk lanes (--bulk-port off): send the bytes inline")
        self._store.check_session(header.worker_id, header.generation, header.session)
        parts, sent = self._expect(header, initialize=False)
        total = sum(p.nbytes for p in sent)
        if bulk.nbytes != total:
            raise errors.InvalidArgumentError(f"bulk push names {bulk.nbytes} bytes, but its parts hold {total}")
        buffer = self._lanes.claim(
            bulk.lane, bulk.token, total, time_left(context), owner=(header.worker_id, header.generation)
        )
        self._traffic.pushed("lane", total)
        views, copies, offset = [], [], 0
        words = []  # the float32 gradients sent as such, each starting on a word of the buffer
        for i, part in enumerate(sent):
            if part is parts[i] and part.dtype.numpy == np.float32 and offset % 4 == 0:
                words.append(i)
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

        screened: list[float | None] = [None] * len(parts)
        try:
            bound = self._lanes.screened(buffer) if words else None
        except BaseException:
            release()
            raise
        if bound is not None:
            for i in words:
                screened[i] = bound
        return (parts, *self._widen(parts, sent, views, release), screened)
