"""The worker's end of the bulk lanes (``pswire.lanes``): a small pool of connections to one
shard's bulk port, each opened for the worker's session there and used by one call at a time.

Lanes are an optimisation, never a requirement: when a shard offers none, or its bulk port cannot
be reached (a firewall, a port mapping that only publishes the gRPC port) or refuses the lane,
the pool says so once, and the calls go through gRPC alone until it tries again a little later.
Before the worker has a session there (``credentials`` gives None) the calls simply use gRPC.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence

from pswire import lanes as wire
from pswire.tlsbio import TLSStream

__all__ = ["Credentials", "Lane", "LanePool", "ReplyFirst"]

log = logging.getLogger(__name__)

Credentials = Callable[[], "tuple[int, int, bytes] | None"]
"""``() -> (worker_id, generation, session secret)`` of the worker's session on the shard, or
None while it has none."""

CONNECT_SECONDS = 2.0
"""How long a lane may take to connect and authenticate before the pool falls back to gRPC."""
_TIMEOUT = struct.Struct("<I")
_TIMEOUT_MAX = (1 << 32) - 1
RETRY_SECONDS = 30.0
"""How long the pool sends everything through gRPC after a lane failed to open."""


class ReplyFirst(Exception):
    """A call sent whole on a lane answered before the pull it asked for: it failed (``status``,
    with the error's details in ``body``)."""

    def __init__(self, token: int, status: int, body: bytes) -> None:
        super().__init__(f"call {token} answered with status {status}")
        self.token, self.status, self.body = token, status, body


class Lane:
    """One authenticated connection to a shard's bulk port. Every method raises
    ``pswire.lanes.LaneError`` or ``OSError`` (``TimeoutError`` past ``timeout``) when the lane
    breaks; the caller then closes it. Only one thread uses it at a time, but ``abort`` may come
    from any thread."""

    def __init__(self, sock: socket.socket | TLSStream, lane_id: int, port: int, epoch: int = 0) -> None:
        self.sock = sock
        self.lane_id = lane_id
        self.port = port
        self.epoch = epoch
        self._token = 0
        self._header = memoryview(bytearray(wire.PULL.size))  # a PULL's header, or a REPLY's (shorter)

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
        """Wait for the pull sent as ``token``: its serialized ``PullHeader`` and byte count.
        Raises ``ReplyFirst`` when a call sent whole on the lane answers instead (it failed)."""
        self.sock.settimeout(max(timeout, 0.001))
        wire.recv_into(self.sock, self._header[: wire.REPLY.size])
        if self._header[:4] == wire.REPLY_TAG:
            _, got, status, nbytes = wire.REPLY.unpack(self._header[: wire.REPLY.size])
            if nbytes > wire.REPLY_LIMIT:
                raise wire.LaneError(f"the shard announced a reply of {nbytes} bytes (at most {wire.REPLY_LIMIT})")
            raise ReplyFirst(got, status, wire.recv_exactly(self.sock, nbytes))
        wire.recv_into(self.sock, self._header[wire.REPLY.size:])
        tag, got, header_len, nbytes = wire.PULL.unpack(self._header)
        if tag != wire.PULL_TAG or got != token:
            raise wire.LaneError(f"expected pull {token} on the lane, got frame {bytes(tag)!r} for {got}")
        return wire.recv_exactly(self.sock, header_len), nbytes

    def call(self, method: int, request: bytes, timeout: float) -> tuple[int, bytes]:
        """Send a whole call (``pswire.lanes.CALL``) and wait for its reply: ``(status, body)``.
        Raises ``TimeoutError`` past ``timeout`` and ``LaneError`` for a reply out of turn."""
        deadline = time.monotonic() + max(timeout, 0.001)
        return self.receive_reply(self.send_call(method, request, timeout), deadline)

    def send_call(self, method: int, request: bytes | Sequence[memoryview | bytes], timeout: float) -> int:
        """Send a whole call without waiting for its reply (:meth:`receive_reply`); its token.
        ``request``: the serialized request, or its pieces (byte views) end to end."""
        token = self.next_token()
        self.sock.settimeout(max(timeout, 0.001))
        pieces = [request] if isinstance(request, bytes) else request
        nbytes = _TIMEOUT.size + sum(map(len, pieces))
        self.sock.sendall(b"".join([wire.CALL.pack(wire.CALL_TAG, token, method, nbytes),
                                    _TIMEOUT.pack(min(int(timeout * 1000), _TIMEOUT_MAX)), *pieces]))
        return token

    def receive_reply(self, token: int, deadline: float) -> tuple[int, bytes]:
        """The reply to the call sent as ``token``, by ``deadline`` (``time.monotonic()``)."""
        header = self._header[: wire.REPLY.size]
        wire.recv_into(self.sock, header, deadline)
        tag, got, status, nbytes = wire.REPLY.unpack(header)
        if tag != wire.REPLY_TAG or got != token:
            raise wire.LaneError(f"expected the reply to call {token} on the lane, got frame {bytes(tag)!r} for {got}")
        if nbytes > wire.REPLY_LIMIT:
            raise wire.LaneError(f"the shard announced a reply of {nbytes} bytes (at most {wire.REPLY_LIMIT})")
        return status, wire.recv_exactly(self.sock, nbytes, deadline)

    def receive_into(self, view: memoryview) -> None:
        wire.recv_into(self.sock, view)

    def abort(self) -> None:
        """Wake a thread blocked on this lane (its call failed); the lane is then closed."""
        try:
            # The socket's shutdown, also under TLS (``TLSStream.shutdown``): it leaves the TLS
            # state to the thread using the lane, whose next read or write fails.
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.abort()
        self.sock.close()


class LanePool:
    """Lanes to ``host:port`` (the port is learnt at registration; 0: the shard has none).

    ``ssl_context`` (client side) wraps each lane in TLS, checking the shard's certificate for
    ``server_hostname`` (default: ``host``); ``credentials`` names the session a lane is opened
    for (without it, no lane is opened)."""

    def __init__(
        self,
        host: str,
        *,
        enabled: bool = True,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.host = host
        self.port = 0
        self._enabled = enabled
        self._ssl_context = ssl_context
        self._server_hostname = server_hostname or host
        self._credentials = credentials
        self._lock = threading.Lock()  # guards port, _epoch, _idle, _retry_at, _closed
        self._epoch = 0
        """Bumped by ``set_port``: lanes of an earlier registration are never pooled again."""
        self._idle: list[Lane] = []
        self._retry_at = 0.0
        self._closed = False

    def set_port(self, port: int) -> None:
        """The shard's bulk port, from its RegisterResponse. Idle lanes are dropped: a worker
        registers again after the shard restarted or its session ended, and its old lanes belong
        to the old session."""
        with self._lock:
            self.port, stale, self._idle = port, self._idle, []
            self._epoch += 1
            self._retry_at = 0.0
        for lane in stale:
            lane.close()

    def take(self) -> Lane | None:
        """An idle lane or a new one; None when lanes are off, unreachable or refused, or the
        worker has no session yet (use gRPC)."""
        with self._lock:
            if not self._enabled or self._closed or not self.port or time.monotonic() < self._retry_at:
                return None
            if self._idle:
                return self._idle.pop()
            port, epoch = self.port, self._epoch
        credentials = self._credentials() if self._credentials is not None else None
        if credentials is None:
            return None
        try:
            sock = socket.create_connection((self.host, port), timeout=CONNECT_SECONDS)
        except OSError as exc:
            return self._unreachable(port, exc)
        try:
            sock = self._open(sock)
            lane_id = self._authenticate(sock, credentials)
        except (OSError, wire.LaneError) as exc:
            sock.close()
            return self._unreachable(port, exc)
        return Lane(sock, lane_id, port, epoch)

    def _open(self, sock: socket.socket) -> socket.socket | TLSStream:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl_context is None:
            return sock
        try:
            stream = TLSStream(sock, self._ssl_context, server_side=False, server_hostname=self._server_hostname)
            stream.handshake(CONNECT_SECONDS)
        except BaseException:
            sock.close()
            raise
        return stream

    @staticmethod
    def _authenticate(sock: socket.socket | TLSStream, credentials: tuple[int, int, bytes]) -> int:
        """Answer the shard's greeting with the session's proof; the lane's id once accepted."""
        deadline = time.monotonic() + CONNECT_SECONDS
        tag, lane_id, nonce = wire.GREETING.unpack(wire.recv_exactly(sock, wire.GREETING.size, deadline))
        if tag != wire.GREETING_TAG:
            raise wire.LaneError(f"not a bulk port of this version: it greeted with {tag!r}")
        worker_id, generation, secret = credentials
        proof = wire.lane_proof(secret, lane_id, nonce)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(wire.AUTH.pack(wire.AUTH_TAG, worker_id, generation, proof))
        try:
            answer = wire.recv_exactly(sock, len(wire.ACCEPT_TAG), deadline)
        except wire.LaneError:
            raise wire.LaneError(f"the shard refused a lane for session {worker_id}/{generation}") from None
        if answer != wire.ACCEPT_TAG:
            raise wire.LaneError(f"the shard answered the lane's authentication with {answer!r}")
        return lane_id

    def _unreachable(self, port: int, exc: Exception) -> None:
        with self._lock:
            self._retry_at = time.monotonic() + RETRY_SECONDS
        log.warning(
            "bulk lane to %s:%d unavailable (%s); every call and its bytes go through gRPC for %.0fs",
            self.host, port, exc, RETRY_SECONDS,
        )
        return None

    def give(self, lane: Lane) -> None:
        """Return a lane after a call that succeeded (after a failure: ``lane.close()``)."""
        with self._lock:
            if not self._closed and lane.port == self.port and lane.epoch == self._epoch:
                self._idle.append(lane)
                return
        lane.close()

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for lane in idle:
            lane.close()
