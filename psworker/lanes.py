"""The worker's end of the bulk lanes (``pswire.lanes``): a small pool of connections to one
shard's bulk port, each used by one call at a time.

Lanes are an optimisation, never a requirement: when a shard offers none, or its bulk port cannot
be reached (a firewall, a port mapping that only publishes the gRPC port), the pool says so once,
and the calls go through gRPC alone until it tries again a little later.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence

from pswire import lanes as wire

__all__ = ["Lane", "LanePool"]

log = logging.getLogger(__name__)

CONNECT_SECONDS = 2.0
"""How long a lane may take to connect before the pool falls back to gRPC."""
RETRY_SECONDS = 30.0
"""How long the pool sends everything through gRPC after a lane failed to connect."""


class Lane:
    """One connection to a shard's bulk port. Every method raises ``pswire.lanes.LaneError`` or
    ``OSError`` (``TimeoutError`` past ``timeout``) when the lane breaks; the caller then closes it."""

    def __init__(self, sock: socket.socket, lane_id: int, port: int) -> None:
        self.sock = sock
        self.lane_id = lane_id
        self.port = port
        self._token = 0
        self._header = memoryview(bytearray(wire.PULL.size))

    def next_token(self) -> int:
        self._token += 1
        return self._token

    def stage(self, token: int, views: Sequence[memoryview], timeout: float) -> int:
        """Send a push's bytes ahead of its call; returns the byte count."""
        nbytes = sum(len(v) for v in views)
        self.sock.settimeout(max(timeout, 0.001))
        wire.send_views(self.sock, wire.PUSH.pack(wire.PUSH_TAG, token, nbytes), views)
        return nbytes

    def receive_header(self, token: int, timeout: float) -> tuple[bytes, int]:
        """Wait for the pull sent as ``token``: its serialized ``PullHeader`` and byte count."""
        self.sock.settimeout(max(timeout, 0.001))
        wire.recv_into(self.sock, self._header)
        tag, got, header_len, nbytes = wire.PULL.unpack(self._header)
        if tag != wire.PULL_TAG or got != token:
            raise wire.LaneError(f"expected pull {token} on the lane, got frame {bytes(tag)!r} for {got}")
        return wire.recv_exactly(self.sock, header_len), nbytes

    def receive_into(self, view: memoryview) -> None:
        wire.recv_into(self.sock, view)

    def abort(self) -> None:
        """Wake a thread blocked on this lane (its call failed); the lane is then closed."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.abort()
        self.sock.close()


class LanePool:
    """Lanes to ``host:port`` (the port is learnt at registration; 0: the shard has none)."""

    def __init__(self, host: str, *, enabled: bool = True) -> None:
        self.host = host
        self.port = 0
        self._enabled = enabled
        self._lock = threading.Lock()
        self._idle: list[Lane] = []
        self._retry_at = 0.0
        self._closed = False

    def set_port(self, port: int) -> None:
        """The shard's bulk port, from its RegisterResponse. Idle lanes are dropped: a worker
        registers again after the shard restarted, and its old lanes are dead then."""
        with self._lock:
            self.port, stale, self._idle = port, self._idle, []
            self._retry_at = 0.0
        for lane in stale:
            lane.close()

    def take(self) -> Lane | None:
        """An idle lane or a new one; None when lanes are off or unreachable (use gRPC)."""
        with self._lock:
            if not self._enabled or self._closed or not self.port or time.monotonic() < self._retry_at:
                return None
            if self._idle:
                return self._idle.pop()
            port = self.port
        try:
            sock = socket.create_connection((self.host, port), timeout=CONNECT_SECONDS)
        except OSError as exc:
            return self._unreachable(port, exc)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tag, lane_id = wire.GREETING.unpack(wire.recv_exactly(sock, wire.GREETING.size))
            if tag != wire.GREETING_TAG:
                raise wire.LaneError(f"not a bulk port: it greeted with {tag!r}")
        except (OSError, wire.LaneError) as exc:
            sock.close()
            return self._unreachable(port, exc)
        return Lane(sock, lane_id, port)

    def _unreachable(self, port: int, exc: Exception) -> None:
        with self._lock:
            self._retry_at = time.monotonic() + RETRY_SECONDS
        log.warning(
            "bulk lane to %s:%d unavailable (%s); large transfers go through gRPC for %.0fs",
            self.host, port, exc, RETRY_SECONDS,
        )
        return None

    def give(self, lane: Lane) -> None:
        """Return a lane after a call that succeeded (after a failure: ``lane.close()``)."""
        with self._lock:
            if not self._closed and lane.port == self.port:
                self._idle.append(lane)
                return
        lane.close()

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for lane in idle:
            lane.close()
