"""The calls a bulk lane carries whole (``pswire.lanes.CALL``/``REPLY``): the data path's small
calls, and a large transfer's call with its bytes, answered by the lane's own thread.

Each runs the servicer's own handler for its gRPC method, behind the same guard and call timer,
with a ``LaneContext`` in place of gRPC's: so a lane call is checked, refused, counted and timed
exactly as the same call through gRPC. The lane adds two rules: the request names the session
that opened the lane (the lane's handshake proved that session, in place of a call's token), and
a bulk transfer it names is on that same lane (staged on it before the call; a pull it asks for
is sent on it before the reply).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import grpc

from pswire import step
from pswire.lanes import LANE_METHODS, RETRYABLE_FLAG
from pswire.v1 import ps_pb2
from psserver.guard import Undecodable, tolerant
from psserver.laneframes import LaneCalls
from psserver.servicer import RETRYABLE

__all__ = ["LaneContext", "lane_calls"]

class _Aborted(Exception):
    """``LaneContext.abort``: the handler ended the call with a status."""


class LaneContext:
    """The part of ``grpc.ServicerContext`` the handlers use, for a call a bulk lane carried
    whole: its deadline, and the status it ends with."""

    transport = "lane"
    """Where the call's own bytes travel (``psserver.intake.Traffic``)."""

    def __init__(self, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout
        self._code: grpc.StatusCode | None = None
        self.details = ""
        self.retryable = False

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self.details = code, details
        raise _Aborted(details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def is_active(self) -> bool:
        return True

    def set_trailing_metadata(self, metadata) -> None:
        self.retryable = RETRYABLE in tuple(tuple(item) for item in metadata)

    def invocation_metadata(self) -> tuple:
        return ()


class StepCall(NamedTuple):
    """A ``Step`` request as a lane carried it (``pswire.step``): its body, decoded by the handler,
    and the registration its head names."""

    body: memoryview
    worker_id: int
    generation: int

    @classmethod
    def of(cls, body: memoryview) -> "StepCall":
        return cls(body, *step.owner_of(body))


def _owners(method: str, request) -> list[tuple[int, int, int | None]]:
    """``(worker_id, generation, the lane of the bulk transfer it names, or None)`` of each part
    of a lane call's request."""
    if method == "Step":
        return [(request.worker_id, request.generation, None)]
    if method == "PushPull":
        return [*_owners("PushInline", request.push),
                *(_owners("PullInline", request.pull) if request.HasField("pull") else ()),
                *(_owners("PullRows", request.rows) if request.HasField("rows") else ())]
    if method == "PushInline":
        return [(request.header.worker_id, request.header.generation,
                 request.bulk.lane if request.HasField("bulk") else None)]
    bulk = request.bulk.lane if method == "PullInline" and request.HasField("bulk") else None
    return [(request.worker_id, request.generation, bulk)]


def lane_calls(servicer, timer=None) -> LaneCalls:
    """The handler of the calls bulk lanes carry whole (``LaneServer.take_calls``) for
    ``servicer`` (a ``ParameterServerServicer``), each method timed by ``timer``
    (``psserver.metrics.RpcTimer``) when the shard has metrics."""
    handlers = {}
    methods = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name
    for name in LANE_METHODS:
        handler = servicer.guard.unary(name, getattr(servicer, name))
        if timer is not None:
            handler = timer.timed_unary(name, handler)
        # A Step's body is decoded by its handler, as views of the lane's buffer (no copy).
        decode = StepCall.of if name == "Step" else _copied(getattr(ps_pb2, methods[name].input_type.name).FromString)
        handlers[name] = (tolerant(decode), handler)

    def call(method: str, body: memoryview, owner: tuple[int, int], lane_id: int, timeout: float,
             ) -> tuple[int, bytes | list]:
        decode, handler = handlers[method]
        context = LaneContext(timeout)
        request = decode(body)
        try:
            if not isinstance(request, Undecodable):
                for worker_id, generation, bulk in _owners(method, request):
                    if (worker_id, generation) != owner:
                        context.abort(grpc.StatusCode.PERMISSION_DENIED, (
                            f"{method} on bulk lane of session {owner[0]}/{owner[1]} names session "
                            f"{worker_id}/{generation}: a lane carries only its own session's calls"))
                    if bulk is not None and bulk != lane_id:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                            f"{method} carried on bulk lane {lane_id} names a transfer on lane {bulk}: "
                            "a call a lane carries moves its bytes on that lane"))
            reply = handler(request, context)
        except _Aborted:
            code = context.code()
            assert code is not None
            return code.value[0] | (RETRYABLE_FLAG if context.retryable else 0), context.details.encode("utf-8", "replace")
        return 0, reply if isinstance(reply, list) else reply.SerializeToString()

    return call


def _copied(decode):
    """``decode`` of a copy of the body (protobuf parses ``bytes``)."""
    return lambda body: decode(bytes(body))
