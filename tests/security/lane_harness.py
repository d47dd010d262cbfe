"""What the bulk port's tests share (``test_lanes_hardening_plaintext``, ``test_lanes_hardening_tls``,
``test_lane_calls`` and the service tier's ``test_lanes``): a ``LaneServer`` run in-process on a
port chosen at run time, loopback only; the sessions it knows (the ``sessions`` fixture, which
``tests/security/conftest.py`` offers); a good worker's ``psworker.lanes.LanePool`` for it; a
push and a pull checked byte for byte; and the raw-socket steps of a peer driven by hand: the
greeting, its answer, and waiting for the server to hang up or to log a refusal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from concurrent import futures

import pytest

from psserver import lanes as server_lanes
from psserver.lanes import LaneServer
from pswire import lanes as wire
from psworker.lanes import LanePool

WAIT = 5.0
A, B, C = (1, 1), (2, 1), (3, 7)
MiB = 1 << 20


@pytest.fixture
def sessions() -> dict[tuple[int, int], bytes]:
    """The live sessions the server knows (a test may end one by deleting it)."""
    return {A: os.urandom(32), B: os.urandom(32), C: os.urandom(32)}


def wait_for(condition, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        threading.Event().wait(0.005)


@contextlib.contextmanager
def lane_server(sessions, **options):
    options.setdefault("max_bytes", 64 * MiB)
    server = LaneServer("127.0.0.1", 0, session_secret=lambda w, g: sessions.get((w, g)), **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def pool_for(server: LaneServer, sessions, owner, **options) -> LanePool:
    pool = LanePool("127.0.0.1", credentials=lambda: (*owner, sessions[owner]), **options)
    pool.set_port(server.port)
    return pool


def push(server: LaneServer, lane, owner, data: bytes) -> None:
    token = lane.next_token()
    lane.stage(token, [memoryview(data)], WAIT)
    buffer = server.claim(lane.lane_id, token, len(data), WAIT, owner=owner)
    try:
        assert buffer.tobytes() == data
    finally:
        server.give_back(buffer)


def pull(server: LaneServer, lane, owner, data: bytes) -> None:
    token = lane.next_token()
    with futures.ThreadPoolExecutor(1) as handler:
        sent = handler.submit(server.deliver, lane.lane_id, token, b"header", [memoryview(data)], WAIT, owner=owner)
        header, nbytes = lane.receive_header(token, WAIT)
        received = bytearray(nbytes)
        lane.receive_into(memoryview(received))
        sent.result(timeout=WAIT)
    assert (header, bytes(received)) == (b"header", data)


def greeted(server: LaneServer) -> tuple[socket.socket, int, bytes]:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    tag, lane_id, nonce = wire.GREETING.unpack(wire.recv_exactly(sock, wire.GREETING.size))
    assert tag == wire.GREETING_TAG
    return sock, lane_id, nonce


def auth(sessions, owner, lane_id: int, nonce: bytes) -> bytes:
    return wire.AUTH.pack(wire.AUTH_TAG, *owner, wire.lane_proof(sessions[owner], lane_id, nonce))


def raw_lane(server: LaneServer, sessions, owner) -> tuple[socket.socket, int]:
    """An authenticated lane driven by hand."""
    sock, lane_id, nonce = greeted(server)
    sock.sendall(auth(sessions, owner, lane_id, nonce))
    assert wire.recv_exactly(sock, 4) == wire.ACCEPT_TAG
    return sock, lane_id


def hung_up(sock: socket.socket, timeout: float = WAIT) -> bool:
    """True once the server closed ``sock`` (whatever it sent first), False past ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset
        pass
    return True


def refusals(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == server_lanes.__name__ and r.levelno >= logging.WARNING]
