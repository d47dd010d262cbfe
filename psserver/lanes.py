"""The shard's end of the bulk lanes (``pswire.lanes``): a listener on the bulk port and one
thread per lane, which authenticates it, stages the pushes it carries into pooled buffers, and
sends the pulls handlers hand it.

Anyone who reaches the bulk port may connect, so a lane earns every resource it holds. Here, at
the door, before it has proven anything:

- it is refused at once beyond ``max_lanes`` open lanes, or ``max_handshakes_per_peer`` lanes of
  one address still authenticating; it must then prove a live worker session
  (``pswire.lanes.lane_proof``) within ``handshake_seconds``, and a session holds at most
  ``max_lanes_per_owner`` lanes. Only the session that opened a lane may claim or send on it.
- a lane's socket, TLS or not, is only ever used by its own thread, so TLS
  (``pswire.tlsbio.TLSStream``) is negotiated there too, never in the accept loop, within
  ``handshake_seconds``.

What an authenticated lane then carries, and what it may hold while it does, is
``psserver.laneframes`` (``LaneServer``'s base).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable

from pswire import lanes as wire
from pswire.tlsbio import TLSStream
from psserver.buffers import BufferPool
from psserver.inflight import InflightBudget, Transfer
from psserver.laneframes import LaneCalls, LaneFrames, _Lane, _Staged
from psserver.screen import ArrivalScreen

__all__ = ["LaneCalls", "LaneServer", "SessionSecret", "admission", "owner_admission"]

log = logging.getLogger(__name__)

SessionSecret = Callable[[int, int], "bytes | None"]
"""``(worker_id, generation) -> secret`` of that live session, or None when there is none."""

_REFUSALS_KEPT = 64
"""Refused pushes of closed lanes remembered for the calls that name them."""
_FREE_PER_SIZE = 2
"""Receive buffers kept for reuse per byte count (see ``psserver.buffers``)."""


def admission(open_lanes: int, max_lanes: int, handshaking: int, max_handshakes: int) -> str | None:
    """Why a new connection is refused (None: admitted), given the lanes open on the shard and
    those of its address still authenticating."""
    if open_lanes >= max_lanes:
        return f"{open_lanes} lanes open already (limit {max_lanes})"
    if handshaking >= max_handshakes:
        return f"{handshaking} lanes of this address still authenticating (limit {max_handshakes})"
    return None


def owner_admission(owned: int, max_owned: int) -> str | None:
    """Why an authenticated lane is refused (None: admitted), given the session's open lanes."""
    if owned >= max_owned:
        return f"its session holds {owned} lanes already (limit {max_owned})"
    return None


class _Refused(Exception):
    """A lane that failed its handshake (the reason is logged in one line)."""


class LaneServer(LaneFrames):
    """Accepts lanes on ``host:port`` (0: any free port; the bound one is ``.port``).

    ``session_secret(worker_id, generation)`` gives a live session's secret (None: no such
    session); ``ssl_context`` (server side) wraps every lane in TLS. Raises ``ValueError`` for
    a limit below 1 and ``RuntimeError`` if the port cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_bytes: int,
        session_secret: SessionSecret,
        budget: InflightBudget | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_lanes: int = 256,
        max_lanes_per_owner: int = 8,
        max_handshakes_per_peer: int = 16,
        handshake_seconds: float = 5.0,
        stall_seconds: float = 10.0,
    ) -> None:
        for name, value in [
            ("max_lanes", max_lanes), ("max_lanes_per_owner", max_lanes_per_owner),
            ("max_handshakes_per_peer", max_handshakes_per_peer),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not (handshake_seconds > 0 and stall_seconds > 0):
            raise ValueError(
                f"handshake_seconds and stall_seconds must be > 0, got {handshake_seconds} and {stall_seconds}"
            )
        try:
            self._listener = socket.create_server((host, port), backlog=64)
        except OSError as exc:
            raise RuntimeError(f"cannot bind the bulk port {host}:{port}: {exc}") from exc
        self.port: int = self._listener.getsockname()[1]
        self._max_bytes = max_bytes
        self._session_secret = session_secret
        self._budget = budget or InflightBudget(0)
        self._ssl_context = ssl_context
        self._max_lanes = max_lanes
        self._max_per_owner = max_lanes_per_owner
        self._max_handshakes = max_handshakes_per_peer
        self._handshake_seconds = handshake_seconds
        self._stall_seconds = stall_seconds
        # Guards _lanes, _handshaking, _staged, _claimed, _stopped and every lane's owner.
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._lanes: dict[int, _Lane] = {}
        self._handshaking: dict[str, int] = {}  # address -> its lanes not yet authenticated
        self._staged: dict[tuple[int, int], _Staged] = {}
        # id(buffer) -> its budget and its read while arriving, until given back
        self._claimed: dict[int, tuple[Transfer | None, ArrivalScreen | None]] = {}
        self._buffers = BufferPool(keep=_FREE_PER_SIZE)
        self._stopped = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="psserver-lanes", daemon=True)
        self._calls: LaneCalls | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            lanes = list(self._lanes.values())
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() (close alone does not)
        except OSError:
            pass
        self._listener.close()
        for lane in lanes:
            self._kill(lane)
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    @property
    def open_lanes(self) -> int:
        """Lanes open, authenticated or still authenticating."""
        with self._lock:
            return len(self._lanes)

    def close_ended(self) -> int:
        """Close every lane whose session has ended (evicted, fenced, re-registered or left), so
        that what it staged leaves the in-flight budget now: a frozen worker's lane would hold
        its push until the TCP connection died, the live workers' pushes waiting behind it. The
        shard's lease reaper calls it on every pass. Returns how many lanes it closed."""
        with self._lock:
            owned = [(lane, lane.owner) for lane in self._lanes.values() if lane.owner is not None and not lane.closed]
        ended = [(lane, owner) for lane, owner in owned if self._session_secret(*owner) is None]
        for lane, (worker_id, generation) in ended:
            log.info("bulk lane from %s closed: session %d/%d ended", lane.peer, worker_id, generation)
            self._kill(lane)
        return len(ended)

    # -- accepting and authenticating --------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                log.warning("bulk port: accept failed: %s", exc)  # out of descriptors, say
                self._stopping.wait(0.1)
                continue
            with self._lock:
                while True:
                    lane_id = secrets.randbits(63)
                    if lane_id and lane_id not in self._lanes:
                        break
                lane = _Lane(lane_id, sock, f"{addr[0]}:{addr[1]}", addr[0])
                reason = "the shard is stopping" if self._stopped else admission(
                    len(self._lanes), self._max_lanes, self._handshaking.get(lane.address, 0), self._max_handshakes
                )
                if reason is None:
                    self._lanes[lane_id] = lane
                    self._handshaking[lane.address] = self._handshaking.get(lane.address, 0) + 1
            if reason is not None:
                log.warning("bulk lane from %s refused: %s", lane.peer, reason)
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(lane,), name="psserver-lane", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had
                log.warning("bulk lane from %s refused: %s", lane.peer, exc)
                self._retire(lane)

    def _serve(self, lane: _Lane) -> None:
        lane.thread = threading.get_ident()
        try:
            try:
                self._handshake(lane)
            except (OSError, wire.LaneError, _Refused) as exc:
                log.warning("bulk lane from %s refused: %s", lane.peer, exc)
                return
            self._run(lane)
        except (OSError, wire.LaneError) as exc:
            if not lane.closed:
                log.info("bulk lane from %s closed: %s", lane.peer, exc)
        except Exception:
            log.exception("bulk lane from %s failed", lane.peer)
        finally:
            self._retire(lane)

    def _handshake(self, lane: _Lane) -> None:
        """TLS (if any), greeting, proof of a live session and its lane limit, all within
        ``handshake_seconds``. Raises ``_Refused``, ``OSError`` or ``LaneError``."""
        deadline = time.monotonic() + self._handshake_seconds

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Refused(f"no authentication within {self._handshake_seconds:g}s")
            return left

        sock = lane.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._ssl_context is not None:
            with lane.lock:
                if lane.closed:
                    raise wire.LaneError("closed")
                lane.sock = sock = TLSStream(sock, self._ssl_context, server_side=True)
            try:
                sock.handshake(remaining())
            except TimeoutError:
                raise _Refused(f"no TLS handshake within {self._handshake_seconds:g}s") from None
            except OSError as exc:
                raise _Refused(f"TLS handshake failed: {exc}") from None
        nonce = secrets.token_bytes(wire.NONCE_BYTES)
        sock.settimeout(remaining())
        sock.sendall(wire.GREETING.pack(wire.GREETING_TAG, lane.lane_id, nonce))
        try:
            raw = wire.recv_exactly(sock, wire.AUTH.size, deadline)
        except TimeoutError:
            raise _Refused(f"no authentication within {self._handshake_seconds:g}s") from None
        except wire.LaneError:
            raise _Refused("closed before authenticating") from None
        tag, worker_id, generation, proof = wire.AUTH.unpack(raw)
        if tag != wire.AUTH_TAG:
            raise _Refused(f"expected an authentication, got {tag!r}")
        secret = self._session_secret(worker_id, generation)
        if secret is None:
            raise _Refused(f"no live session {worker_id}/{generation}")
        if not hmac.compare_digest(proof, wire.lane_proof(secret, lane.lane_id, nonce)):
            raise _Refused(f"wrong proof for session {worker_id}/{generation}")
        owner = (worker_id, generation)
        with self._lock:
            reason = owner_admission(sum(1 for x in self._lanes.values() if x.owner == owner), self._max_per_owner)
            if reason is None:
                lane.owner = owner
                self._left_handshake(lane.address)
        if reason is not None:
            raise _Refused(f"session {worker_id}/{generation}: {reason}")
        with lane.lock:
            if lane.closed:
                raise wire.LaneError("closed")
            lane.wake_r, lane.wake_w = socket.socketpair()
            lane.wake_r.setblocking(False)
            lane.wake_w.setblocking(False)
        sock.settimeout(remaining())
        sock.sendall(wire.ACCEPT_TAG)

    def _left_handshake(self, address: str) -> None:
        # Caller holds _lock.
        count = self._handshaking.pop(address, 0) - 1
        if count > 0:
            self._handshaking[address] = count

    # -- retiring ----------------------------------------------------------------------------

    def _retire(self, lane: _Lane) -> None:
        """Forget a lane and free all it held (its own thread, at the end)."""
        with self._arrived:
            self._lanes.pop(lane.lane_id, None)
            if lane.owner is None:
                self._left_handshake(lane.address)
            # Staged bytes go; a refusal stays for the call that will ask (a few, oldest dropped).
            dropped = [
                self._staged.pop(k) for k, v in list(self._staged.items())
                if k[0] == lane.lane_id and v.error is None
            ]
            refusals = [k for k, v in self._staged.items() if v.error is not None]
            for key in refusals[: max(0, len(refusals) - _REFUSALS_KEPT)]:
                del self._staged[key]
            self._arrived.notify_all()
        with lane.lock:
            lane.closed = True
            queued, lane.outbox = list(lane.outbox), deque()
            for job in queued:
                job.state = "dropped"
            try:
                lane.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lane.sock.close()
            for end in (lane.wake_r, lane.wake_w):
                if end is not None:
                    end.close()
        for job in queued:
            job.error = wire.LaneError("the lane closed")
            job.done.set()
        for old in dropped:
            self._drop(old)
