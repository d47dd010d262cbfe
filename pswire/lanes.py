"""Bulk lanes: plain TCP connections beside the gRPC channel that carry large tensor bytes.

gRPC Python moves a large payload at 0.4-0.5 x what one TCP stream reaches on the same machine
(it copies every message through its core and into Python ``bytes``). A lane moves the same bytes
straight between tensor memory and the socket: ``sendall`` of each tensor's byte view on one side,
``recv_into`` the destination tensor on the other. gRPC still carries every call, its deadline,
its status and the metadata; the lane only carries the bytes a call names (``BulkRef`` in
``ps.proto``, where the frames are specified). A lane serves one call at a time, and any error on
it (a short read, a timeout, an unexpected frame) ends it: it is closed, never resynchronised.

Small calls ride on a lane whole (``CALL`` and ``REPLY``): a unary call of the data path
(``LANE_METHODS``) costs gRPC Python about 0.9 ms of CPU (client and shard together, a hand-off
to the server's thread pool and back), where a frame on a lane the shard's lane thread answers
itself costs a tenth of that. The shard runs the same handler, with the same checks, metrics and
status codes, as for the gRPC call; the request must name the session that opened the lane.

A lane belongs to one worker session. On accepting it the shard sends a ``GREETING`` with a fresh
nonce; the worker answers ``AUTH`` with :func:`lane_proof`, an HMAC of the lane and the nonce under
its session secret (``RegisterResponse.session``), so the secret never crosses the lane and a proof
is good for that one lane only. The shard answers ``ACCEPT_TAG`` or closes the lane. Either side
may wrap the TCP connection in TLS first (``pswire.tlsbio.TLSStream``); the frames are the same.

This module holds the framing both sides share; ``psserver.lanes`` and ``psworker.lanes`` are the
two ends.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "ACCEPT_TAG", "AUTH", "AUTH_TAG", "CALL", "CALL_LIMIT", "CALL_TAG", "GREETING", "GREETING_TAG",
    "LANE_METHODS", "NONCE_BYTES", "PULL", "PULL_TAG", "PUSH", "PUSH_TAG", "REPLY", "REPLY_LIMIT", "REPLY_TAG",
    "RETRYABLE_FLAG", "LaneError", "Stream", "lane_proof", "recv_exactly", "recv_into", "send_views",
]

NONCE_BYTES = 16
GREETING = struct.Struct("<4sQ16s")
"""Shard to worker on accept: ``b"PSL2"``, the lane's id, a nonce of ``NONCE_BYTES``."""
GREETING_TAG = b"PSL2"
AUTH = struct.Struct("<4sQQ32s")
"""Worker to shard, answering the greeting: ``b"PSAU"``, worker id, generation, ``lane_proof``."""
AUTH_TAG = b"PSAU"
ACCEPT_TAG = b"PSOK"
"""Shard to worker: the lane is open for that session (a refusal closes it instead)."""
PUSH = struct.Struct("<4sQQ")
"""Worker to shard: ``b"PSPU"``, token, byte count; then the bytes."""
PUSH_TAG = b"PSPU"
PULL = struct.Struct("<4sQIQ")
"""Shard to worker: ``b"PSPL"``, token, header length, byte count; then the serialized
``PullHeader`` and the bytes."""
PULL_TAG = b"PSPL"
CALL = struct.Struct("<4sQII")
"""Worker to shard, a whole call: ``b"PSCA"``, token, method (its index in ``LANE_METHODS``),
body length; then the body: the call's timeout in milliseconds (u32) and the serialized request."""
CALL_TAG = b"PSCA"
REPLY = struct.Struct("<4sQII")
"""Shard to worker, answering a ``CALL``: ``b"PSRE"``, its token, the status (a gRPC status code,
with ``RETRYABLE_FLAG`` set for admission control's refusals), body length; then the body: the
serialized response when the status is OK (0), else the error's details in UTF-8."""
REPLY_TAG = b"PSRE"
RETRYABLE_FLAG = 1 << 8
LANE_METHODS = ("PushPull", "PushInline", "PullInline", "PullRows", "Data", "Step")
"""The unary calls a lane may carry whole, by index: the data path's small calls, a dynamic
data worker's exchange of data tasks (``psworker.elastic``), which comes every few steps, and
``Step``, an async step's push and reads in the fixed layout of ``pswire.step`` (no gRPC method:
lanes only)."""
CALL_LIMIT = 8 << 20
"""The largest ``CALL`` body a shard reads (larger calls go through gRPC); a lane announcing
more is closed."""
REPLY_LIMIT = 40 << 20
"""The largest ``REPLY`` body a worker reads (``PullRows`` answers with up to 32 MiB of rows)."""

_PROOF_CONTEXT = b"pswire-lane-v2"
_COALESCE = 64 << 10
"""Views shorter than this are joined into one send (a syscall each costs more than the copy)."""


class Stream(Protocol):
    """What a lane runs on: a ``socket.socket``, or a ``pswire.tlsbio.TLSStream`` around one."""

    def settimeout(self, timeout: float | None) -> None: ...
    def recv_into(self, buffer, nbytes: int = 0) -> int: ...
    def sendall(self, data) -> None: ...


class LaneError(ConnectionError):
    """A lane broke or spoke out of turn; the lane is closed and the call may be retried."""


def lane_proof(secret: bytes, lane_id: int, nonce: bytes) -> bytes:
    """The 32 bytes that prove a session's secret for one lane: HMAC-SHA256 keyed by ``secret``
    over ``b"pswire-lane-v2"``, the lane id (u64, little-endian) and the greeting's nonce."""
    return hmac.new(secret, _PROOF_CONTEXT + struct.pack("<Q", lane_id) + nonce, hashlib.sha256).digest()


def recv_into(sock: Stream, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; raises ``LaneError`` if the peer closes first and
    ``TimeoutError`` past the socket's timeout, or past ``deadline`` (``time.monotonic()``) for
    the whole view when one is given (then the socket's timeout is overwritten)."""
    got, size = 0, len(view)
    while got < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"lane stalled: {got} of {size} bytes arrived in time")
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise LaneError(f"lane closed by the peer after {got} of {size} bytes")
        got += n


def recv_exactly(sock: Stream, size: int, deadline: float | None = None) -> bytes:
    buffer = bytearray(size)
    recv_into(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def send_views(sock: Stream, prefix: bytes, views: Sequence[memoryview]) -> None:
    """Send ``prefix`` then every view in order, with no copy of the large ones."""
    pending = [prefix]
    for view in views:
        if len(view) < _COALESCE:
            pending.append(view)
            continue
        sock.sendall(b"".join(pending))
        pending = []
        sock.sendall(view)
    if pending:
        sock.sendall(b"".join(pending))
