"""What a bulk lane carries once ``psserver.lanes.LaneServer`` has admitted and authenticated it
(``LaneFrames``, that class's base): the frames its own thread reads, the pulls the shard's
handlers hand it, and the table where a staged push waits for the call that claims it.

Kept apart from the door (``psserver.lanes``: listening, admission, the handshake) because the two
are judged differently: a peer passes the door once, before it has proven anything; what follows
is paid for frame by frame by a session that has, and a lane still earns every resource it holds:

- a push takes the in-flight budget piece by piece as its bytes arrive (its buffer is allocated
  untouched), so a sender that announces 8 GiB and trickles holds about what it sent; and once a
  frame has begun, each piece must arrive within ``stall_seconds`` or the lane is closed and all
  it held is released. Idle lanes between frames stay (workers keep a few).
- a lane's socket, TLS or not, is only ever used by its own thread: ``deliver`` queues the pull
  and waits for that thread to send it.
- a whole call (``CALL``, the data path's small calls) is read within ``stall_seconds`` under the
  same budget, up to ``pswire.lanes.CALL_LIMIT`` bytes, and runs on the lane's own thread (the
  shard's handler, ``take_calls``), which then sends its ``REPLY``: a session's calls on lanes are
  bounded by its lanes, as its gRPC calls are by admission control.

A staged push waits in a table keyed by ``(lane, token)`` until the ``PushInline`` naming it
claims it; a lane holds at most one staged push (its worker makes one call at a time), and its
staged bytes are dropped when it closes, so staged memory is bounded by the open lanes.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pswire import lanes as wire
from pswire.dtypes import UINT8
from pswire.errors import (
    DeadlineError, InvalidArgumentError, OverloadedError, PSError, TooLargeError, UnavailableError,
)
from pswire.tlsbio import TLSStream
from psserver.buffers import BufferPool
from psserver.inflight import InflightBudget, Transfer
from psserver.screen import ArrivalScreen

if TYPE_CHECKING:
    from psserver.lanes import SessionSecret

__all__ = ["LaneCalls", "LaneFrames"]

LaneCalls = Callable[[str, memoryview, "tuple[int, int]", int, float], "tuple[int, bytes | list[memoryview]]"]
"""``(method, serialized request, (worker_id, generation) of the lane, the lane's id, timeout)
-> (status, body)``: runs one call a lane carried (``pswire.lanes.CALL``) and gives its
``REPLY`` (the body whole, or in byte views sent end to end); a pull the call sends on the lane
goes first (``deliver``, from the lane's thread)."""
_TIMEOUT = struct.Struct("<I")
PIECE_BYTES = 4 << 20
"""A push's bytes are budgeted and deadlined in pieces of this size."""
ROOM_SECONDS = 60.0
"""How long a push may wait for room in the in-flight budget (its bytes wait in the socket)."""
_ABORT_SECONDS = 2.0
"""How long a timed-out ``deliver`` waits for the lane's thread to drop its views once the lane
is shut down (a send on a shut-down socket fails at once)."""


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
    screen: ArrivalScreen | None = None
    """The bytes read as float32 while they arrived, for a push of more than one piece."""


class LaneFrames:
    """The authenticated lanes of a ``psserver.lanes.LaneServer`` and the handlers' calls that
    name one (``claim``, ``give_back``, ``deliver``). Never made alone: it works on the state
    ``LaneServer.__init__`` sets up (declared below), under the locks described there.
    """

    _max_bytes: int
    _session_secret: SessionSecret
    _budget: InflightBudget
    _stall_seconds: float
    _lock: threading.Lock
    _arrived: threading.Condition
    _lanes: dict[int, _Lane]
    _staged: dict[tuple[int, int], _Staged]
    _claimed: dict[int, tuple[Transfer | None, ArrivalScreen | None]]
    _buffers: BufferPool
    _calls: LaneCalls | None

    def take_calls(self, calls: "LaneCalls") -> None:
        """Answer the ``CALL`` frames of every lane with ``calls`` (before ``start``; without
        it, a call closes its lane)."""
        self._calls = calls

    def screened(self, buffer: np.ndarray) -> float | None:
        """The largest magnitude of a claimed push's bytes read as float32 words, read while they
        arrived (waits for the last piece's read); None when not read so (a push of one piece) or
        when a word is not finite."""
        with self._lock:
            _, screen = self._claimed.get(id(buffer), (None, None))
        return None if screen is None else screen.bound()

    def give_back(self, buffer: np.ndarray) -> None:
        """Return a claimed push's buffer for reuse (its bytes leave the in-flight budget)."""
        with self._lock:
            transfer, _ = self._claimed.pop(id(buffer), (None, None))
        if transfer is not None:
            transfer.close()
        self._buffers.give(buffer)

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
        # The body's bytes are budgeted while they arrive; the handler budgets what it keeps. The
        # push staged on this lane (at most one) is freed only once this call claims it, so the
        # body shares its place in line: else two staged pushes' calls could each wait on the other.
        with self._lock:
            staged = next((s.transfer for (lane_id, _), s in self._staged.items() if lane_id == lane.lane_id), None)
        transfer = self._budget.transfer(completes=staged)
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
        views = reply if isinstance(reply, list) else [memoryview(reply)]  # a Step answers in pieces
        # The reply (up to 32 MiB of rows) within what is left of the call, or the stall limit.
        lane.sock.settimeout(max(self._stall_seconds, deadline - time.monotonic()))
        wire.send_views(lane.sock, wire.REPLY.pack(wire.REPLY_TAG, token, status, sum(map(len, views))), views)

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
            # Each piece is read for NaN while the next arrives; one piece is read after its call.
            screen = ArrivalScreen(buffer) if nbytes > PIECE_BYTES else None
            for offset in range(0, nbytes, PIECE_BYTES):
                piece = view[offset : offset + PIECE_BYTES]
                self._make_room(lane, transfer, len(piece))
                wire.recv_into(lane.sock, piece, time.monotonic() + self._stall_seconds)
                if screen is not None:
                    screen.add(offset, offset + len(piece))
        except BaseException:
            transfer.close()  # the partial buffer is dropped, not pooled
            raise
        return _Staged(buffer, lane.owner, transfer, screen=screen)

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
                self._claimed[id(staged.buffer)] = (staged.transfer, staged.screen)
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
