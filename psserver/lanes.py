"""The shard's end of the bulk lanes (``pswire.lanes``): a listener on the bulk port, one reader
thread per lane that stages pushed bytes into pooled buffers, and the send of a pull's bytes
from the handler that serves it.

A staged push waits in a table keyed by ``(lane, token)`` until the ``PushInline`` naming it
claims it; a lane holds at most one staged push (its worker makes one call at a time), and its
staged bytes are dropped when it closes, so staged memory is bounded by the open lanes.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pswire import lanes as wire
from pswire.errors import DeadlineError, InvalidArgumentError, PSError, TooLargeError, UnavailableError
from psserver.buffers import BufferPool
from pswire.dtypes import UINT8
from psserver.inflight import InflightBudget

__all__ = ["LaneServer"]

log = logging.getLogger(__name__)

IDLE_SECONDS = 60.0
"""How long a lane may stall in the middle of a frame before it is closed (idle lanes stay)."""
_REFUSALS_KEPT = 64
"""Refused pushes of closed lanes remembered for the calls that name them."""
_FREE_PER_SIZE = 2
"""Receive buffers kept for reuse per byte count (see ``psserver.buffers``)."""


@dataclass
class _Lane:
    lane_id: int
    sock: socket.socket
    peer: str
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


@dataclass
class _Staged:
    buffer: np.ndarray | None
    error: PSError | None = None


class LaneServer:
    """Accepts lanes on ``host:port`` (0: any free port; the bound one is ``.port``)."""

    def __init__(
        self, host: str, port: int, *, max_bytes: int, budget: InflightBudget | None = None, max_lanes: int = 256
    ) -> None:
        try:
            self._listener = socket.create_server((host, port), backlog=64)
        except OSError as exc:
            raise RuntimeError(f"cannot bind the bulk port {host}:{port}: {exc}") from exc
        self.port: int = self._listener.getsockname()[1]
        self._max_bytes = max_bytes
        self._budget = budget or InflightBudget(0)
        self._max_lanes = max_lanes
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._lanes: dict[int, _Lane] = {}
        self._staged: dict[tuple[int, int], _Staged] = {}
        self._buffers = BufferPool(keep=_FREE_PER_SIZE)
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="psserver-lanes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            lanes = list(self._lanes.values())
        self._listener.close()
        for lane in lanes:
            self._close(lane)

    @property
    def open_lanes(self) -> int:
        with self._lock:
            return len(self._lanes)

    def give_back(self, buffer: np.ndarray) -> None:
        """Return a staged push's buffer for reuse (its bytes leave the in-flight budget)."""
        self._budget.release(buffer.size)
        self._buffers.give(buffer)

    # -- lanes -------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # stopped
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(IDLE_SECONDS)
            lane = _Lane(secrets.randbits(63) or 1, sock, f"{peer[0]}:{peer[1]}")
            with self._lock:
                refused = self._stopped or len(self._lanes) >= self._max_lanes
                if not refused:
                    self._lanes[lane.lane_id] = lane
            if refused:
                log.warning("bulk lane from %s refused: %d lanes open already", lane.peer, self._max_lanes)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(lane,), name="psserver-lane", daemon=True).start()

    def _serve(self, lane: _Lane) -> None:
        sock = lane.sock
        header = memoryview(bytearray(wire.PUSH.size))
        try:
            with lane.send_lock:
                sock.sendall(wire.GREETING.pack(wire.GREETING_TAG, lane.lane_id))
            while self._read_frame_header(sock, header):
                tag, token, nbytes = wire.PUSH.unpack(header)
                if tag != wire.PUSH_TAG:
                    raise wire.LaneError(f"expected a push frame, got {bytes(tag)!r}")
                if nbytes > self._max_bytes:
                    self._stage(lane, token, _Staged(None, TooLargeError(
                        f"bulk push of {nbytes} bytes is above this shard's limit of {self._max_bytes}")))
                    return
                # Wait for room before reading: meanwhile the bytes stay in the worker's socket.
                if not self._budget.acquire(nbytes, IDLE_SECONDS):
                    raise wire.LaneError(
                        f"no room for a push of {nbytes} bytes in {IDLE_SECONDS:.0f}s: "
                        f"{self._budget.held} bytes of pushes in flight (limit {self._budget.limit})"
                    )
                buffer = self._buffers.take((nbytes,), UINT8)
                try:
                    wire.recv_into(sock, memoryview(buffer))
                except BaseException:
                    self.give_back(buffer)
                    raise
                self._stage(lane, token, _Staged(buffer))
        except (OSError, wire.LaneError) as exc:
            if not lane.closed:
                log.info("bulk lane from %s closed: %s", lane.peer, exc)
        finally:
            self._close(lane)

    @staticmethod
    def _read_frame_header(sock: socket.socket, view: memoryview) -> bool:
        """Read one frame header; False when the peer closed the lane between frames. An idle
        lane waits indefinitely; one that stalls inside a frame is dropped."""
        got = 0
        while got < len(view):
            try:
                n = sock.recv_into(view[got:])
            except TimeoutError:
                if got == 0:
                    continue
                raise
            if n == 0:
                if got == 0:
                    return False
                raise wire.LaneError("lane closed inside a frame header")
            got += n
        return True

    def _stage(self, lane: _Lane, token: int, staged: _Staged) -> None:
        dropped = []
        with self._arrived:
            # One call at a time per lane: a push staged earlier on it was never claimed.
            for key in [k for k in self._staged if k[0] == lane.lane_id]:
                dropped.append(self._staged.pop(key))
            self._staged[(lane.lane_id, token)] = staged
            self._arrived.notify_all()
        for old in dropped:
            if old.buffer is not None:
                self.give_back(old.buffer)

    def _close(self, lane: _Lane) -> None:
        dropped = []
        with self._arrived:
            lane.closed = True
            self._lanes.pop(lane.lane_id, None)
            # Staged bytes go; a refusal stays for the call that will ask (a few, oldest dropped).
            for key in [k for k in self._staged if k[0] == lane.lane_id]:
                if self._staged[key].error is None:
                    dropped.append(self._staged.pop(key))
            refusals = [k for k, v in self._staged.items() if v.error is not None]
            for key in refusals[: max(0, len(refusals) - _REFUSALS_KEPT)]:
                del self._staged[key]
            self._arrived.notify_all()
        for old in dropped:
            if old.buffer is not None:
                self.give_back(old.buffer)
        try:
            lane.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        lane.sock.close()

    # -- calls -------------------------------------------------------------------------------

    def claim(self, lane_id: int, token: int, nbytes: int, timeout: float) -> np.ndarray:
        """The bytes staged as ``token`` on lane ``lane_id``, as a flat uint8 array of
        ``nbytes`` (``give_back`` it once applied), waiting up to ``timeout`` for them to arrive.
        Raises ``UnavailableError`` (the lane closed: retry on a new one), ``DeadlineError``,
        ``TooLargeError`` or ``InvalidArgumentError`` (the call names another byte count)."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while (lane_id, token) not in self._staged:
                if lane_id not in self._lanes:
                    raise UnavailableError(f"bulk lane {lane_id} is not open on this shard (it closed): retry")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineError(f"the bytes of push {token} on bulk lane {lane_id} did not arrive in time")
                self._arrived.wait(remaining)
            staged = self._staged.pop((lane_id, token))
        if staged.error is not None:
            raise staged.error
        assert staged.buffer is not None
        if staged.buffer.size != nbytes:
            self.give_back(staged.buffer)
            raise InvalidArgumentError(f"bulk push staged {staged.buffer.size} bytes, but its call names {nbytes}")
        return staged.buffer

    def deliver(self, lane_id: int, token: int, header: bytes, views: Sequence[memoryview], timeout: float) -> None:
        """Send a pull's header and bytes on lane ``lane_id`` within ``timeout`` seconds.
        Raises ``UnavailableError`` if the lane is not open or breaks (it is then closed)."""
        with self._lock:
            lane = self._lanes.get(lane_id)
        if lane is None:
            raise UnavailableError(f"bulk lane {lane_id} is not open on this shard (it closed): retry")
        nbytes = sum(len(v) for v in views)
        try:
            with lane.send_lock:
                writer = lane.sock.dup()  # its own timeout; the reader thread keeps the idle one
                try:
                    writer.settimeout(max(timeout, 0.001))
                    wire.send_views(writer, wire.PULL.pack(wire.PULL_TAG, token, len(header), nbytes) + header, views)
                finally:
                    writer.close()
        except OSError as exc:
            self._close(lane)
            raise UnavailableError(f"bulk lane {lane_id} broke while sending a pull: {exc}") from exc
