"""The shard's end of the bulk lanes (``pswire.lanes``): a listener on the bulk port and one
thread per lane, which authenticates it, stages the pushes it carries into pooled buffers, and
sends the pulls handlers hand it.

Anyone who reaches the bulk port may connect, so a lane earns every resource it holds:

- it is refused at once beyond ``max_lanes`` open lanes, or ``max_handshakes_per_peer`` lanes of
  one address still authenticating; it must then prove a live worker session
  (``pswire.lanes.lane_proof``) within ``handshake_seconds``, and a session holds at most
  ``max_lanes_per_owner`` lanes. Only the session that opened a lane may claim or send on it.
- a push takes the in-flight budget piece by piece as its bytes arrive (its buffer is allocated
  untouched), so a sender that announces 8 GiB and trickles holds about what it sent; and once a
  frame has begun, each piece must arrive within ``stall_seconds`` or the lane is closed and all
  it held is released. Idle lanes between frames stay (workers keep a few).
- a lane's socket, TLS or not, is only ever used by its own thread: ``deliver`` queues the pull
  and waits for that thread to send it. TLS (``pswire.tlsbio.TLSStream``) is negotiated there
  too, never in the accept loop, within ``handshake_seconds``.

- a whole call (``CALL``, the data path's small calls) is read within ``stall_seconds`` under the
  same budget, up to ``pswire.lanes.CALL_LIMIT`` bytes, and runs on the lane's own thread (the
  shard's handler, ``take_calls``), which then sends its ``REPLY``: a session's calls on lanes are
  bounded by its lanes, as its gRPC calls are by admission control.

A staged push waits in a table keyed by ``(lane, token)`` until the ``PushInline`` naming it
claims it; a lane holds at most one staged push (its worker makes one call at a time), and its
staged bytes are dropped when it closes, so staged memory is bounded by the open lanes.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pswire import lanes as wire
from pswire.dtypes import UINT8
from pswire.errors import (
    DeadlineError, InvalidArgumentError, OverloadedError, PSError, TooLargeError, UnavailableError,
)
from pswire.tlsbio import TLSStream
from psserver.buffers import BufferPool
from psserver.inflight import InflightBudget, Transfer

__all__ = ["LaneCalls", "LaneServer", "SessionSecret", "admission", "owner_admission"]

log = logging.getLogger(__name__)

SessionSecret = Callable[[int, int], "bytes | None"]
"""``(worker_id, generation) -> secret`` of that live session, or None when there is none."""

LaneCalls = Callable[[str, memoryview, "tuple[int, int]", int, float], "tuple[int, bytes]"]
"""``(method, serialized request, (worker_id, generation) of the lane, the lane's id, timeout)
-> (status, body)``: runs one call a lane carried (``pswire.lanes.CALL``) and gives its
``REPLY``; a pull the call sends on the lane goes first (``deliver``, from the lane's thread)."""
_TIMEOUT = struct.Struct("<I")
PIECE_BYTES = 4 << 20
"""A push's bytes are budgeted and deadlined in pieces of this size."""
ROOM_SECONDS = 60.0
"""How long a push may wait for room in the in-flight budget (its bytes wait in the socket)."""
_REFUSALS_KEPT = 64
"""Refused pushes of closed lanes remembered for the calls that name them."""
_FREE_PER_SIZE = 2
"""Receive buffers kept for reuse per byte count (see ``psserver.buffers``)."""
_ABORT_SECONDS = 2.0
"""How long a timed-out ``deliver`` waits for the lane's thread to drop its views once the lane
is shut down (a send on a shut-down socket fails at once)."""


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


@dataclass(eq=False)
class _Delivery:
    """A pull handed to a lane's thread. ``state`` (guarded by the lane's lock): queued, then
    sending, then done; or dropped while queued."""

    prefix: bytes
    views: Sequence[memoryview]
    deadline: float
    state: str = "queued"
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Lane:
    lane_id: int
    sock: socket.socket | TLSStream
    peer: str
    address: str
    owner: tuple[int, int] | None = None
    """``(worker_id, generation)`` once authenticated (guarded by ``LaneServer._lock``)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``sock`` (replaced by its TLS stream), ``closed``, ``outbox`` and the wake pair.
    Taken after ``LaneServer._lock``, never before it."""
    closed: bool = False
    thread: int = 0
    """The ident of the lane's own thread (``deliver`` from it sends at once: a call the lane carries)."""
    outbox: deque[_Delivery] = field(default_factory=deque)
    wake_r: socket.socket | None = None
    wake_w: socket.socket | None = None


@dataclass(eq=False)
class _Staged:
    buffer: np.ndarray | None
    owner: tuple[int, int]
    transfer: Transfer | None = None
    error: PSError | None = None
    """A refusal (then no buffer), raised to the call that claims it."""


class LaneServer:
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
        self._claimed: dict[int, Transfer | None] = {}  # id(buffer) -> its budget, until given back
        self._buffers = BufferPool(keep=_FREE_PER_SIZE)
        self._stopped = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="psserver-lanes", daemon=True)
        self._calls: LaneCalls | None = None

    def take_calls(self, calls: "LaneCalls") -> None:
        """Answer the ``CALL`` frames of every lane with ``calls`` (before ``start``; without
        it, a call closes its lane)."""
        self._calls = calls

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

    def give_back(self, buffer: np.ndarray) -> None:
        """Return a claimed push's buffer for reuse (its bytes leave the in-flight budget)."""
        with self._lock:
            transfer = self._claimed.pop(id(buffer), None)
        if transfer is not None:
            transfer.close()
        self._buffers.give(buffer)

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

    # -- an authenticated lane ---------------------------------------------------------------

    def _run(self, lane: _Lane) -> None:
        """Serve frames and deliveries until the lane closes: wait for whichever comes first,
        so that the socket is only ever used by this thread."""
        sock = lane.sock
        assert lane.wake_r is not None
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(lane.wake_r.fileno(), select.POLLIN)
        header = memoryview(bytearray(wire.PUSH.size))
        buffered = sock.pending if isinstance(sock, TLSStream) else None
        while True:
            self._send_queued(lane)
            if buffered is not None and buffered():
                readable = True  # bytes the TLS stream read ahead: poll() cannot see them
            else:
                readable = False
                for fd, _ in poller.poll():
                    if fd == sock.fileno():
                        readable = True
                    else:
                        _drain(lane.wake_r)
            if readable and not self._read_frame(lane, header):
                return

    def _read_frame(self, lane: _Lane, header: memoryview) -> bool:
        """Read one push; False when the lane is to close (the peer closed it between frames, or
        a refusal was staged). Raises ``LaneError`` when it breaks or stalls."""
        sock, owner = lane.sock, lane.owner
        assert owner is not None
        sock.settimeout(self._stall_seconds)
        try:
            got = sock.recv_into(header)
        except TimeoutError:
            return True  # a TLS record with no data for us: idle again
        if got == 0:
            return False
        try:
            wire.recv_into(sock, header[got:], time.monotonic() + self._stall_seconds)
            if header[:4] == wire.CALL_TAG:
                self._call(lane, header)
                return True
            tag, token, nbytes = wire.PUSH.unpack(header)
            if tag != wire.PUSH_TAG:
                raise wire.LaneError(f"expected a push or call frame, got {bytes(tag)!r}")
            if self._session_secret(*owner) is None:
                raise wire.LaneError(f"session {owner[0]}/{owner[1]} ended")
            if nbytes > self._max_bytes:
                self._stage(lane, token, _Staged(None, owner, error=TooLargeError(
                    f"bulk push of {nbytes} bytes is above this shard's limit of {self._max_bytes}")))
                return False
            staged = self._receive(lane, nbytes)
        except TimeoutError:
            raise wire.LaneError(f"stalled inside a frame for {self._stall_seconds:g}s") from None
        self._stage(lane, token, staged)
        return staged.error is None

    def _call(self, lane: _Lane, header: memoryview) -> None:
        """Read a whole call, run it on this thread and send its reply. Raises ``LaneError``
        (the lane closes) for a call this shard cannot take: no handler, an unknown method, a
        body above ``CALL_LIMIT`` or one that stalls; ``TimeoutError`` past the stall limit."""
        _, token, method, nbytes = wire.CALL.unpack(header)
        if self._calls is None:
            raise wire.LaneError("this shard takes no calls on its lanes")
        if method >= len(wire.LANE_METHODS):
            raise wire.LaneError(f"call of unknown method {method} on the lane")
        if not 4 <= nbytes <= wire.CALL_LIMIT:
            raise wire.LaneError(f"call of {nbytes} bytes on the lane (at most {wire.CALL_LIMIT})")
        assert lane.owner is not None
        # The body's bytes are budgeted while they arrive; the handler budgets what it keeps.
        transfer = self._budget.transfer()
        try:
            self._make_room(lane, transfer, nbytes)
            body = bytearray(nbytes)
            wire.recv_into(lane.sock, memoryview(body), time.monotonic() + self._stall_seconds)
        finally:
            transfer.close()
        (timeout_ms,) = _TIMEOUT.unpack_from(body)
        deadline = time.monotonic() + timeout_ms / 1000.0
        status, reply = self._calls(
            wire.LANE_METHODS[method], memoryview(body)[_TIMEOUT.size:], lane.owner, lane.lane_id, timeout_ms / 1000.0
        )
        del body
        # The reply (up to 32 MiB of rows) within what is left of the call, or the stall limit.
        lane.sock.settimeout(max(self._stall_seconds, deadline - time.monotonic()))
        wire.send_views(lane.sock, wire.REPLY.pack(wire.REPLY_TAG, token, status, len(reply)), [memoryview(reply)])

    def _receive(self, lane: _Lane, nbytes: int) -> _Staged:
        """A push's bytes, each piece budgeted just before it is read."""
        assert lane.owner is not None
        transfer = self._budget.transfer()
        try:
            try:
                buffer = self._buffers.take((nbytes,), UINT8)  # not filled ahead of its bytes
            except MemoryError:
                transfer.close()
                return _Staged(None, lane.owner, error=OverloadedError(
                    f"no memory for a bulk push of {nbytes} bytes: retry later"))
            view = memoryview(buffer)
            for offset in range(0, nbytes, PIECE_BYTES):
                piece = view[offset : offset + PIECE_BYTES]
                self._make_room(lane, transfer, len(piece))
                wire.recv_into(lane.sock, piece, time.monotonic() + self._stall_seconds)
        except BaseException:
            transfer.close()  # the partial buffer is dropped, not pooled
            raise
        return _Staged(buffer, lane.owner, transfer)

    def _make_room(self, lane: _Lane, transfer: Transfer, nbytes: int) -> None:
        deadline = time.monotonic() + ROOM_SECONDS
        while not transfer.acquire(nbytes, min(0.5, max(deadline - time.monotonic(), 0.0))):
            if lane.closed:
                raise wire.LaneError("closed")
            if time.monotonic() >= deadline:
                raise wire.LaneError(
                    f"no room for {nbytes} more bytes in {ROOM_SECONDS:.0f}s: {self._budget.held} bytes of "
                    f"pushes in flight (limit {self._budget.limit})"
                )

    def _send_queued(self, lane: _Lane) -> None:
        while True:
            with lane.lock:
                if not lane.outbox:
                    return
                job = lane.outbox.popleft()
                job.state = "sending"
            try:
                remaining = job.deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("its call's deadline passed before the lane was free")
                lane.sock.settimeout(remaining)
                wire.send_views(lane.sock, job.prefix, job.views)
            except BaseException as exc:
                job.error = exc
                raise
            finally:
                job.views = ()
                with lane.lock:
                    job.state = "done"
                job.done.set()

    def _stage(self, lane: _Lane, token: int, staged: _Staged) -> None:
        with self._arrived:
            # One call at a time per lane: a push staged earlier on it was never claimed.
            dropped = [self._staged.pop(k) for k in [k for k in self._staged if k[0] == lane.lane_id]]
            self._staged[(lane.lane_id, token)] = staged
            self._arrived.notify_all()
        for old in dropped:
            self._drop(old)

    @staticmethod
    def _drop(staged: _Staged) -> None:
        # Not pooled: only the byte counts of pushes a call claimed are worth keeping buffers
        # for (the pool keeps some per count, and a peer can stage any count it likes).
        if staged.transfer is not None:
            staged.transfer.close()

    def _kill(self, lane: _Lane) -> None:
        """Shut ``lane`` down from any thread: its own thread wakes, fails, and retires it."""
        with lane.lock:
            lane.closed = True
            try:
                # The socket's shutdown, also under TLS (``TLSStream.shutdown``): it touches no
                # TLS state (which belongs to the lane's thread), whose next read or write fails.
                lane.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            _wake(lane)

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

    # -- calls -------------------------------------------------------------------------------

    def _owned(self, lane_id: int, owner: tuple[int, int]) -> _Lane:
        # Caller holds _lock.
        lane = self._lanes.get(lane_id)
        if lane is None or lane.closed:
            raise UnavailableError(f"bulk lane {lane_id} is not open on this shard (it closed): retry")
        if lane.owner != owner:
            raise InvalidArgumentError(f"bulk lane {lane_id} does not belong to this session")
        return lane

    def claim(self, lane_id: int, token: int, nbytes: int, timeout: float, *, owner: tuple[int, int]) -> np.ndarray:
        """The bytes staged as ``token`` on lane ``lane_id`` by session ``owner``
        (``(worker_id, generation)``), as a flat uint8 array of ``nbytes`` (``give_back`` it once
        applied), waiting up to ``timeout`` for them to arrive. Raises ``UnavailableError`` (the
        lane closed: retry on a new one), ``DeadlineError``, ``TooLargeError``,
        ``OverloadedError`` or ``InvalidArgumentError`` (another session's lane, or the call
        names another byte count)."""
        deadline = time.monotonic() + timeout
        key = (lane_id, token)
        with self._arrived:
            while (staged := self._staged.get(key)) is None:
                if self._owned(lane_id, owner).thread == threading.get_ident():
                    # A call this lane carries: whatever it staged came before the call.
                    raise InvalidArgumentError(f"no push staged as {token} on bulk lane {lane_id} before its call")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineError(f"the bytes of push {token} on bulk lane {lane_id} did not arrive in time")
                self._arrived.wait(remaining)
            if staged.owner != owner:
                raise InvalidArgumentError(f"bulk lane {lane_id} does not belong to this session")
            del self._staged[key]
            if staged.error is None and staged.buffer is not None and staged.buffer.size == nbytes:
                self._claimed[id(staged.buffer)] = staged.transfer
                return staged.buffer
        if staged.error is not None:
            raise staged.error
        self._drop(staged)
        raise InvalidArgumentError(f"bulk push staged {staged.buffer.size} bytes, but its call names {nbytes}")

    def deliver(
        self, lane_id: int, token: int, header: bytes, views: Sequence[memoryview], timeout: float,
        *, owner: tuple[int, int],
    ) -> None:
        """Send a pull's header and bytes on lane ``lane_id`` of session ``owner`` within
        ``timeout`` seconds (the lane's thread sends them; this waits). Raises
        ``InvalidArgumentError`` for another session's lane, ``UnavailableError`` if the lane is
        not open, breaks or does not send in time (it is then closed)."""
        with self._lock:
            lane = self._owned(lane_id, owner)
        nbytes = sum(len(v) for v in views)
        prefix = wire.PULL.pack(wire.PULL_TAG, token, len(header), nbytes) + header
        if lane.thread == threading.get_ident():
            # A call this lane carries whole (``_call``): its own thread sends the pull, before the reply.
            try:
                lane.sock.settimeout(max(timeout, 0.001))
                wire.send_views(lane.sock, prefix, views)
            except OSError as exc:
                self._kill(lane)  # cut mid-frame: the reply must not follow
                raise UnavailableError(f"bulk lane {lane_id} broke while sending a pull: {exc}") from exc
            return
        job = _Delivery(prefix, views, time.monotonic() + timeout)
        with lane.lock:
            if lane.closed:
                raise UnavailableError(f"bulk lane {lane_id} is not open on this shard (it closed): retry")
            lane.outbox.append(job)
            _wake(lane)
        if not job.done.wait(max(timeout, 0.0)):
            with lane.lock:
                state = job.state
                if state == "queued":
                    lane.outbox.remove(job)
                    job.state = "dropped"
            if state != "done":
                self._kill(lane)
                if state == "sending":
                    job.done.wait(_ABORT_SECONDS)  # the handler's views stay untouched once this returns
                raise UnavailableError(
                    f"bulk lane {lane_id} did not send a pull of {nbytes} bytes within {timeout:.1f}s: closed"
                )
            job.done.wait(_ABORT_SECONDS)  # sent just now: its thread is setting the event
        if isinstance(job.error, TimeoutError):
            raise UnavailableError(
                f"bulk lane {lane_id} did not send a pull of {nbytes} bytes within {timeout:.1f}s: closed"
            ) from job.error
        if job.error is not None:
            raise UnavailableError(f"bulk lane {lane_id} broke while sending a pull: {job.error}") from job.error


def _wake(lane: _Lane) -> None:
    # Caller holds lane.lock (the wake pair closes under it).
    if lane.wake_w is not None:
        try:
            lane.wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
