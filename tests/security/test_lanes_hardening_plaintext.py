"""Security tier: the bulk port (``psserver.lanes``), in plaintext, against peers that are not
well-behaved workers. A ``LaneServer`` runs in-process on a port chosen at run time, loopback
only; the good worker is a ``psworker.lanes.LanePool``, the others are raw sockets (see
``lane_harness``).

What anyone who reaches the port may do: connect (within limits), fail to authenticate, send
nonsense. What a session may do: use its own lanes only, and hold the in-flight budget only for
bytes it actually sent, for no longer than ``stall_seconds`` per piece. The same port over TLS
is tested in ``test_lanes_hardening_tls``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import struct
import threading
import time

import pytest

from psserver import laneframes
from psserver import lanes as server_lanes
from psserver.inflight import InflightBudget
from psserver.lanes import LaneServer
from pswire import errors
from pswire import lanes as wire
from tests.security.lane_harness import (
    WAIT,
    A,
    B,
    C,
    MiB,
    auth,
    greeted,
    hung_up,
    lane_server,
    pool_for,
    pull,
    push,
    raw_lane,
    refusals,
    wait_for,
)

pytestmark = pytest.mark.timeout(30)


def test_admission_says_why_a_lane_is_refused():
    assert server_lanes.admission(255, 256, 15, 16) is None
    assert "256 lanes open already" in server_lanes.admission(256, 256, 0, 16)
    assert "still authenticating" in server_lanes.admission(10, 256, 16, 16)
    assert server_lanes.owner_admission(7, 8) is None
    assert "holds 8 lanes already" in server_lanes.owner_admission(8, 8)


def test_an_authenticated_lane_pushes_and_pulls_exactly(sessions):
    with lane_server(sessions) as server:
        pool = pool_for(server, sessions, A)
        lane = pool.take()
        assert lane is not None
        data = os.urandom(3 * MiB + 5)
        push(server, lane, A, data)
        pull(server, lane, A, data)
        pool.give(lane)
        assert pool.take() is lane  # kept and reused
        push(server, lane, A, b"")
        assert server.open_lanes == 1
        pool.give(lane)
        pool.close()
        wait_for(lambda: server.open_lanes == 0, "the lane to close")


@pytest.mark.parametrize("answer", ["wrong-proof", "unknown-session", "ended-session", "wrong-tag", "no-answer"])
def test_a_failed_handshake_is_refused_with_one_line_and_the_lane_closed(sessions, caplog, answer):
    caplog.set_level(logging.INFO, logger=server_lanes.__name__)
    with lane_server(sessions, handshake_seconds=0.3) as server:
        sock, lane_id, nonce = greeted(server)
        with sock:
            started = time.monotonic()
            if answer == "wrong-proof":
                sock.sendall(wire.AUTH.pack(wire.AUTH_TAG, *A, wire.lane_proof(sessions[B], lane_id, nonce)))
            elif answer == "unknown-session":
                sock.sendall(wire.AUTH.pack(wire.AUTH_TAG, 9, 9, wire.lane_proof(b"guess", lane_id, nonce)))
            elif answer == "ended-session":
                proof = auth(sessions, A, lane_id, nonce)
                del sessions[A]
                sock.sendall(proof)
            elif answer == "wrong-tag":
                sock.sendall(b"PSPU" + auth(sessions, A, lane_id, nonce)[4:])
            assert hung_up(sock)
            assert time.monotonic() - started < 2.0
        wait_for(lambda: server.open_lanes == 0, "the refused lane to be forgotten")
        wait_for(lambda: refusals(caplog), "the refusal to be logged")
        (record,) = refusals(caplog)
        assert record.levelno == logging.WARNING and record.exc_info is None
        assert "refused" in record.getMessage() and "\n" not in record.getMessage()
        # A proof is good for its own lane only: replayed on another, it fails.
        if answer == "no-answer":
            first_proof = auth(sessions, A, lane_id, nonce)
            other, _, _ = greeted(server)
            with other:
                other.sendall(first_proof)
                assert hung_up(other)


def test_a_lane_serves_only_the_session_that_opened_it(sessions):
    with lane_server(sessions, max_bytes=1 * MiB) as server:
        pool = pool_for(server, sessions, A)
        lane = pool.take()
        assert lane is not None
        with pytest.raises(errors.InvalidArgumentError, match="does not belong to this session"):
            server.claim(lane.lane_id, 1, 10, WAIT, owner=B)
        with pytest.raises(errors.InvalidArgumentError, match="does not belong to this session"):
            server.deliver(lane.lane_id, 1, b"", [memoryview(b"x")], WAIT, owner=B)
        # Bytes A staged are A's: B cannot take them, and A still can.
        token = lane.next_token()
        lane.stage(token, [memoryview(b"abc")], WAIT)
        with pytest.raises(errors.InvalidArgumentError, match="does not belong to this session"):
            server.claim(lane.lane_id, token, 3, WAIT, owner=B)
        buffer = server.claim(lane.lane_id, token, 3, WAIT, owner=A)
        assert buffer.tobytes() == b"abc"
        server.give_back(buffer)
        # Same worker, another registration: another session.
        with pytest.raises(errors.InvalidArgumentError, match="does not belong to this session"):
            server.claim(lane.lane_id, token, 3, WAIT, owner=(A[0], A[1] + 1))
        # A refusal is remembered for the call that claims it, after its lane closed, and for its
        # session only.
        token = lane.next_token()
        lane.sock.sendall(wire.PUSH.pack(wire.PUSH_TAG, token, 2 * MiB))
        wait_for(lambda: server.open_lanes == 0, "the lane to close")
        with pytest.raises(errors.InvalidArgumentError, match="does not belong to this session"):
            server.claim(lane.lane_id, token, 2 * MiB, WAIT, owner=B)
        with pytest.raises(errors.TooLargeError, match="limit"):
            server.claim(lane.lane_id, token, 2 * MiB, WAIT, owner=A)
        with pytest.raises(errors.UnavailableError, match="not open"):
            server.claim(lane.lane_id, token + 1, 3, WAIT, owner=A)
        with pytest.raises(errors.UnavailableError, match="not open"):
            server.deliver(lane.lane_id, token + 1, b"", [], WAIT, owner=A)
        lane.close()
        pool.close()


def test_a_lane_whose_session_ended_is_closed_at_its_next_frame(sessions):
    with lane_server(sessions) as server:
        pool = pool_for(server, sessions, A)
        lane = pool.take()
        assert lane is not None
        del sessions[A]
        token = lane.next_token()
        lane.stage(token, [memoryview(b"abc")], WAIT)
        with pytest.raises(errors.UnavailableError):
            server.claim(lane.lane_id, token, 3, WAIT, owner=A)
        lane.close()


def test_a_trickled_8_gib_push_holds_only_the_bytes_that_arrived(sessions):
    budget = InflightBudget(32 * MiB)
    with lane_server(sessions, max_bytes=16 << 30, budget=budget) as server:
        attacker, _ = raw_lane(server, sessions, C)
        with attacker:
            attacker.sendall(struct.pack("<4sQQ", b"PSPU", 1, 8 << 30) + b"x")
            wait_for(lambda: budget.held > 0, "the attacker's first piece")
            assert budget.held <= laneframes.PIECE_BYTES
            pool = pool_for(server, sessions, A)
            lane = pool.take()
            assert lane is not None
            for _ in range(3):
                push(server, lane, A, os.urandom(6 * MiB))
            assert server.open_lanes == 2  # the attacker's lane is still open
            assert budget.held <= laneframes.PIECE_BYTES
            assert budget.peak <= laneframes.PIECE_BYTES + 8 * MiB  # its piece, and the push in pieces
            pool.give(lane)
            pool.close()
        wait_for(lambda: server.open_lanes == 0 and budget.held == 0, "the attacker's lane to free its piece")


def test_a_stalled_frame_is_cut_within_stall_seconds_but_an_idle_lane_stays(sessions):
    stall = 0.3
    budget = InflightBudget(0)
    with lane_server(sessions, stall_seconds=stall, budget=budget) as server:
        pool = pool_for(server, sessions, A)
        idle = pool.take()
        assert idle is not None
        idle_since = time.monotonic()
        for frame in [wire.PUSH.pack(wire.PUSH_TAG, 1, MiB) + b"x", wire.PUSH.pack(wire.PUSH_TAG, 1, MiB)[:9]]:
            sock, _ = raw_lane(server, sessions, B)
            stop = threading.Event()

            def trickle(sock=sock, stop=stop) -> None:
                # One byte every stall / 6: each recv is quick, the piece is not.
                with contextlib.suppress(OSError):
                    while not stop.wait(stall / 6):
                        sock.send(b"x")

            trickler = threading.Thread(target=trickle, daemon=True)
            with sock:
                sock.sendall(frame)
                started = time.monotonic()
                trickler.start()
                assert hung_up(sock)
                elapsed = time.monotonic() - started
                stop.set()
            trickler.join(timeout=WAIT)
            assert stall * 0.8 <= elapsed < stall + 2.0, elapsed
            wait_for(lambda: server.open_lanes == 1 and budget.held == 0, "the stalled lane to free what it held")
        # The idle lane outlived several stall periods, and still works.
        assert time.monotonic() - idle_since > 2 * stall
        push(server, idle, A, b"still here")
        pool.close()


def test_lanes_are_bounded_per_session_per_address_and_in_all(sessions, caplog):
    caplog.set_level(logging.INFO, logger=server_lanes.__name__)
    with lane_server(sessions, max_lanes=6, max_lanes_per_owner=2, max_handshakes_per_peer=2) as server:
        pool_a = pool_for(server, sessions, A)
        held = [pool_a.take(), pool_a.take()]
        assert None not in held
        assert pool_a.take() is None  # refused: the pool falls back to gRPC
        pool_b = pool_for(server, sessions, B)
        lane_b = pool_b.take()
        assert lane_b is not None  # another session is not held back
        held[0].close()
        wait_for(lambda: server.open_lanes == 2, "A's lane to close")
        again = pool_for(server, sessions, A).take()
        assert again is not None
        assert server.open_lanes == 3

        # Two lanes of this address still authenticating: the third is closed without a greeting.
        caplog.clear()
        waiting = [greeted(server), greeted(server)]
        late = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        with late:
            assert late.recv(64) == b""
        assert any("authenticating" in r.getMessage() for r in refusals(caplog))
        # One authenticates: room for one more, which makes six lanes, all there may be.
        sock, lane_id, nonce = waiting.pop()
        sock.sendall(auth(sessions, C, lane_id, nonce))
        assert wire.recv_exactly(sock, 4) == wire.ACCEPT_TAG
        waiting.append(greeted(server))
        assert server.open_lanes == 6
        full = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        with full:
            assert full.recv(64) == b""
        assert any("lanes open already" in r.getMessage() for r in refusals(caplog))
        for s, _, _ in waiting:
            s.close()
        sock.close()
        for lane in [held[1], lane_b, again]:
            lane.close()
        wait_for(lambda: server.open_lanes == 0, "every lane to close")


def _garbage(rng: random.Random, sessions, server: LaneServer) -> None:
    """One connection that says something wrong at some byte, then hangs up its side."""
    kind = rng.randrange(5)
    if kind == 0:  # anything at all
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        payload = rng.randbytes(rng.randrange(0, 120))
    else:
        sock, lane_id, nonce = greeted(server)
        good = auth(sessions, A, lane_id, nonce)
        if kind == 1:  # a truncated or corrupted authentication
            cut = rng.randrange(len(good))
            payload = good[:cut] + rng.randbytes(rng.randrange(0, 2 * (len(good) - cut)))
        elif kind == 2:  # authenticated, then noise
            payload = good + rng.randbytes(rng.randrange(0, 64))
        elif kind == 3:  # authenticated, then a push cut short
            nbytes = rng.randrange(1, 256 << 10)
            payload = good + wire.PUSH.pack(wire.PUSH_TAG, rng.getrandbits(64), nbytes) + bytes(rng.randrange(nbytes))
        else:  # authenticated, then a frame header cut short, or an absurd byte count
            header = wire.PUSH.pack(wire.PUSH_TAG, 1, rng.choice([rng.getrandbits(64), 2**64 - 1, 0]))
            payload = good + header[: rng.randrange(1, len(header) + 1)]
    with sock:
        with contextlib.suppress(OSError):  # the server may hang up first
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        assert hung_up(sock)


def test_garbage_on_the_bulk_port_leaves_it_serving(sessions, caplog):
    caplog.set_level(logging.ERROR, logger=server_lanes.__name__)  # thousands of refusals
    budget = InflightBudget(64 * MiB)
    with lane_server(sessions, max_bytes=1 << 40, budget=budget) as server:
        threads_before = threading.active_count()
        rng = random.Random(20240601)
        for _ in range(2048):
            _garbage(rng, sessions, server)
        wait_for(lambda: server.open_lanes == 0 and budget.held == 0, "every lane to close and free its bytes")
        wait_for(lambda: threading.active_count() <= threads_before + 2, "the lanes' threads to end")
        assert not refusals(caplog)  # nothing unexpected: no error, no traceback
        pool = pool_for(server, sessions, A)
        lane = pool.take()
        assert lane is not None
        data = os.urandom(2 * MiB)
        push(server, lane, A, data)
        pull(server, lane, A, data)
        pool.close()


def test_a_peer_that_hangs_up_at_any_byte_leaves_nothing_behind(sessions):
    budget = InflightBudget(0)
    with lane_server(sessions, budget=budget) as server:
        threads_before = threading.active_count()
        frame = wire.PUSH.pack(wire.PUSH_TAG, 1, 64) + bytes(64)
        for cut in range(wire.AUTH.size + len(frame)):
            sock, lane_id, nonce = greeted(server)
            with sock:
                sock.sendall((auth(sessions, A, lane_id, nonce) + frame)[:cut])
                sock.shutdown(socket.SHUT_WR)
                assert hung_up(sock)
        wait_for(lambda: server.open_lanes == 0 and budget.held == 0, "every lane to close and free its bytes")
        wait_for(lambda: threading.active_count() <= threads_before, "the lanes' threads to end")


def test_a_pull_nobody_reads_times_out_and_closes_the_lane(sessions):
    with lane_server(sessions) as server:
        pool = pool_for(server, sessions, A)
        lane = pool.take()
        assert lane is not None
        started = time.monotonic()
        with pytest.raises(errors.UnavailableError, match="within"):
            server.deliver(lane.lane_id, 1, b"", [memoryview(bytes(48 * MiB))], 0.3, owner=A)
        assert time.monotonic() - started < 0.3 + 2.5
        wait_for(lambda: server.open_lanes == 0, "the lane to close")
        lane.close()
        lane = pool.take()
        assert lane is not None
        pull(server, lane, A, b"fine again")
        pool.close()
