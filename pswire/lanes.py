"""Bulk lanes: plain TCP connections beside the gRPC channel that carry large tensor bytes.

gRPC Python moves a large payload at 0.4-0.5 x what one TCP stream reaches on the same machine
(it copies every message through its core and into Python ``bytes``). A lane moves the same bytes
straight between tensor memory and the socket: ``sendall`` of each tensor's byte view on one side,
``recv_into`` the destination tensor on the other. gRPC still carries every call, its deadline,
its status and the metadata; the lane only carries the bytes a call names (``BulkRef`` in
``ps.proto``, where the frames are specified). A lane serves one call at a time, and any error on
it (a short read, a timeout, an unexpected frame) ends it: it is closed, never resynchronised.

This module holds the framing both sides share; ``psserver.lanes`` and ``psworker.lanes`` are the
two ends.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

__all__ = [
    "GREETING", "GREETING_TAG", "PULL", "PULL_TAG", "PUSH", "PUSH_TAG", "LaneError", "recv_exactly", "recv_into",
    "send_views",
]

GREETING = struct.Struct("<4sQ")
"""Shard to worker on accept: ``b"PSL1"``, the lane's id."""
GREETING_TAG = b"PSL1"
PUSH = struct.Struct("<4sQQ")
"""Worker to shard: ``b"PSPU"``, token, byte count; then the bytes."""
PUSH_TAG = b"PSPU"
PULL = struct.Struct("<4sQIQ")
"""Shard to worker: ``b"PSPL"``, token, header length, byte count; then the serialized
``PullHeader`` and the bytes."""
PULL_TAG = b"PSPL"

_COALESCE = 64 << 10
"""Views shorter than this are joined into one send (a syscall each costs more than the copy)."""


class LaneError(ConnectionError):
    """A lane broke or spoke out of turn; the lane is closed and the call may be retried."""


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raises ``LaneError`` if the peer closes first and
    ``TimeoutError`` (``socket.timeout``) past the socket's timeout."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise LaneError(f"lane closed by the peer after {got} of {size} bytes")
        got += n


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    recv_into(sock, memoryview(buffer))
    return bytes(buffer)


def send_views(sock: socket.socket, prefix: bytes, views: Sequence[memoryview]) -> None:
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
