"""Security tier: the bulk port (``psserver.lanes``) against peers that are not well-behaved
workers. A ``LaneServer`` runs in-process on a port chosen at run time, loopback only; the good
worker is a ``psworker.lanes.LanePool``, the others are raw sockets.

What anyone who reaches the port may do: connect (within limits), fail to authenticate, send
nonsense. What a session may do: use its own lanes only, and hold the in-flight budget only for
bytes it actually sent, for no longer than ``stall_seconds`` per piece.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import random
import socket
import ssl
import struct
import threading
import time
from concurrent import futures
from datetime import datetime, timedelta, timezone

import pytest

from psserver import laneframes
from psserver import lanes as server_lanes
from psserver.inflight import InflightBudget
from psserver.lanes import LaneServer
from pswire import errors
from pswire import lanes as wire
from pswire.tlsbio import TLSStream
from psworker import lanes as worker_lanes
from psworker.lanes import LanePool

pytestmark = pytest.mark.timeout(30)

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


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A throwaway CA and a server certificate for 127.0.0.1: (server context, client context)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lanes test CA")])

    def certificate(subject, public_key):
        return (
            x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )

    ca = (
        certificate(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
        ), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf = (
        certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), key.public_key())
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    return server, client


def test_tls_lanes_carry_pushes_and_pulls(sessions, tls):
    server_context, client_context = tls
    with lane_server(sessions, ssl_context=server_context) as server:
        pool = pool_for(server, sessions, A, ssl_context=client_context)
        lane = pool.take()
        assert lane is not None and isinstance(lane.sock, TLSStream) and lane.sock.version() == "TLSv1.3"
        data = os.urandom(5 * MiB + 3)
        push(server, lane, A, data)
        pull(server, lane, A, data)
        pool.give(lane)
        lane = pool.take()
        push(server, lane, A, data[:1000])  # a small one after a large one: nothing left pending
        pull(server, lane, A, data[:1000])
        with pytest.raises(errors.InvalidArgumentError, match="does not belong"):
            server.claim(lane.lane_id, 1, 1, WAIT, owner=B)
        pool.give(lane)
        pool.close()
        wait_for(lambda: server.open_lanes == 0, "the lane to close")


def test_plaintext_and_tls_do_not_mix_and_the_server_keeps_serving(sessions, tls, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=server_lanes.__name__)
    monkeypatch.setattr(worker_lanes, "CONNECT_SECONDS", 0.5)
    server_context, client_context = tls
    with lane_server(sessions, ssl_context=server_context) as server:
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        with raw:
            raw.sendall(wire.AUTH.pack(wire.AUTH_TAG, *A, bytes(32)) + b"\r\n" * 200)
            assert hung_up(raw)
        wait_for(lambda: any("TLS" in r.getMessage() for r in refusals(caplog)), "the refusal to be logged")
        assert all(r.exc_info is None for r in refusals(caplog))
        assert pool_for(server, sessions, A).take() is None  # a plaintext worker falls back to gRPC
        pool = pool_for(server, sessions, A, ssl_context=client_context)
        lane = pool.take()
        assert lane is not None
        push(server, lane, A, b"after the noise")
        pool.close()
    with lane_server(sessions) as plain:
        assert pool_for(plain, sessions, A, ssl_context=client_context).take() is None
        wait_for(lambda: plain.open_lanes == 0, "the failed lane to close")


def test_a_40_mib_push_and_pull_over_tls_are_byte_exact(sessions, tls):
    server_context, client_context = tls
    with lane_server(sessions, ssl_context=server_context) as server:
        pool = pool_for(server, sessions, A, ssl_context=client_context)
        lane = pool.take()
        assert lane is not None
        data = os.urandom(40 * MiB + 7)  # not a whole number of TLS records or read buffers
        push(server, lane, A, data)
        pull(server, lane, A, data)
        push(server, lane, A, data[:5])
        assert lane.sock.version() == "TLSv1.3" and lane.sock.pending() == 0
        pool.give(lane)
        pool.close()
        wait_for(lambda: server.open_lanes == 0, "the lane to close")


@pytest.mark.parametrize("first_frame", [16 << 10, 20 << 10], ids=["next-record-undecrypted", "same-record-decrypted"])
def test_a_frame_the_tls_stream_read_ahead_is_served_without_more_bytes_arriving(sessions, tls, first_frame):
    """Two frames in one send: the server reads both off the socket at once, so the second waits
    in the TLS stream (a record not yet decrypted, or the decrypted rest of the first frame's
    last record), where poll() cannot see it."""
    server_context, client_context = tls
    with lane_server(sessions, ssl_context=server_context) as server:
        pool = pool_for(server, sessions, A, ssl_context=client_context)
        lane = pool.take()
        assert lane is not None
        first, second = lane.next_token(), lane.next_token()
        size = first_frame - wire.PUSH.size  # a frame of 16 KiB fills one TLS record exactly
        lane.sock.sendall(
            wire.PUSH.pack(wire.PUSH_TAG, first, size) + bytes(size) + wire.PUSH.pack(wire.PUSH_TAG, second, 3) + b"two"
        )
        buffer = server.claim(lane.lane_id, second, 3, WAIT, owner=A)
        assert buffer.tobytes() == b"two"
        server.give_back(buffer)
        lane.close()
        pool.close()
        wait_for(lambda: server.open_lanes == 0, "the lane to close")


def _client_hello(client_context: ssl.SSLContext) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = client_context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


class _TLSByHand:
    """An authenticated TLS lane whose ciphertext the test sends itself (memory BIOs)."""

    def __init__(self, server: LaneServer, sessions, owner, client_context: ssl.SSLContext) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = client_context.wrap_bio(self._incoming, self._outgoing, server_hostname="127.0.0.1")
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self._outgoing.read())
                self._incoming.write(self.sock.recv(64 << 10))
        self.sock.sendall(self._outgoing.read())
        tag, lane_id, nonce = wire.GREETING.unpack(self._read(wire.GREETING.size))
        assert tag == wire.GREETING_TAG
        self.sock.sendall(self.encrypt(auth(sessions, owner, lane_id, nonce)))
        assert self._read(len(wire.ACCEPT_TAG)) == wire.ACCEPT_TAG

    def encrypt(self, data: bytes) -> bytes:
        self._tls.write(data)
        return self._outgoing.read()

    def _read(self, size: int) -> bytes:
        out = b""
        while len(out) < size:
            try:
                out += self._tls.read(size - len(out))
            except ssl.SSLWantReadError:
                self._incoming.write(self.sock.recv(64 << 10))
        return out


def test_a_tls_frame_trickled_inside_a_record_is_cut_within_stall_seconds(sessions, tls, caplog):
    """Each byte of ciphertext arrives quickly, the record it belongs to does not: the piece's
    deadline holds inside the TLS stream too."""
    caplog.set_level(logging.INFO, logger=server_lanes.__name__)
    stall = 0.3
    server_context, client_context = tls
    budget = InflightBudget(0)
    with lane_server(sessions, ssl_context=server_context, stall_seconds=stall, budget=budget) as server:
        peer = _TLSByHand(server, sessions, A, client_context)
        header = peer.encrypt(wire.PUSH.pack(wire.PUSH_TAG, 1, MiB))
        record = peer.encrypt(bytes(8 << 10))  # the first bytes of the push, in one record
        stop = threading.Event()

        def trickle() -> None:
            with contextlib.suppress(OSError):
                for i in range(len(record)):
                    if stop.wait(stall / 6):
                        return
                    peer.sock.send(record[i : i + 1])

        trickler = threading.Thread(target=trickle, daemon=True)
        with peer.sock:
            peer.sock.sendall(header)
            started = time.monotonic()
            trickler.start()
            assert hung_up(peer.sock)
            elapsed = time.monotonic() - started
            stop.set()
        trickler.join(timeout=WAIT)
        assert stall * 0.8 <= elapsed < stall + 2.0, elapsed
        wait_for(lambda: server.open_lanes == 0 and budget.held == 0, "the stalled lane to free what it held")
        assert any("stalled inside a frame" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("peer", ["silent", "trickling"])
def test_a_tls_handshake_that_never_finishes_is_cut_at_handshake_seconds(sessions, tls, caplog, peer):
    caplog.set_level(logging.INFO, logger=server_lanes.__name__)
    server_context, client_context = tls
    hello = _client_hello(client_context)
    with lane_server(sessions, ssl_context=server_context, handshake_seconds=0.5) as server:
        threads_before = threading.active_count()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        stop = threading.Event()

        def trickle() -> None:
            # One byte of a real ClientHello every 20 ms: each read is quick, the handshake is not.
            with contextlib.suppress(OSError):
                for i in range(len(hello)):
                    if stop.wait(0.02):
                        return
                    sock.send(hello[i : i + 1])

        trickler = threading.Thread(target=trickle, daemon=True)
        with sock:
            started = time.monotonic()
            if peer == "trickling":
                trickler.start()
            assert hung_up(sock)
            elapsed = time.monotonic() - started
            stop.set()
        if peer == "trickling":
            trickler.join(timeout=WAIT)
        assert 0.4 <= elapsed < 0.5 + 2.0, elapsed
        wait_for(lambda: server.open_lanes == 0, "the lane to be forgotten")
        wait_for(lambda: any("no TLS handshake within" in r.getMessage() for r in refusals(caplog)),
                 "the refusal to be logged")
        wait_for(lambda: threading.active_count() <= threads_before, "the lane's thread to end")


class _Relay:
    """A TCP relay between a worker and the bulk port that can damage the bytes of one
    direction ("up": worker to shard, "down": shard to worker) at a given offset: flip one
    byte there, or cut both connections there."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()  # guards seen, damage and _sockets
        self.seen = {"up": 0, "down": 0}
        self.damage: dict[str, tuple[int, str]] = {}
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def arm(self, direction: str, after: int, how: str) -> None:
        with self._lock:
            self.damage[direction] = (self.seen[direction] + after, how)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            worker, _ = self._listener.accept()
            shard = socket.create_connection(("127.0.0.1", self._upstream_port), timeout=WAIT)
            with self._lock:
                self._sockets += [worker, shard]
            for args in [(worker, shard, "up"), (shard, worker, "down")]:
                thread = threading.Thread(target=self._pump, args=args, daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        try:
            while data := source.recv(64 << 10):
                with self._lock:
                    start = self.seen[direction]
                    self.seen[direction] += len(data)
                    offset, how = self.damage.get(direction, (-1, ""))
                if start <= offset < start + len(data):
                    if how == "cut":
                        sink.sendall(data[: offset - start])
                        break
                    data = bytearray(data)
                    data[offset - start] ^= 0x5A
                sink.sendall(data)
        except OSError:
            pass
        self.close()  # one end hung up (or the cut): so do both, as one TCP connection would

    def close(self) -> None:
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def join(self) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=WAIT)


@pytest.mark.parametrize("how", ["flip", "cut"])
@pytest.mark.parametrize("transfer", ["push", "pull"])
def test_a_garbled_or_truncated_tls_stream_closes_the_lane_and_frees_what_it_held(sessions, tls, caplog, transfer, how):
    """A byte changed in flight fails TLS's authentication of its record; a stream cut inside a
    record reads as a closed lane. Either way the side reading fails at once (no wait for a
    timeout), the shard closes the lane, and nothing it held stays behind."""
    caplog.set_level(logging.INFO, logger=server_lanes.__name__)
    server_context, client_context = tls
    budget = InflightBudget(0)
    with lane_server(sessions, ssl_context=server_context, budget=budget) as server:
        threads_before = threading.active_count()
        relay = _Relay(server.port)
        pool = LanePool("127.0.0.1", ssl_context=client_context, credentials=lambda: (*A, sessions[A]))
        pool.set_port(relay.port)
        lane = pool.take()
        assert lane is not None
        data = os.urandom(5 * MiB)
        token = lane.next_token()
        relay.arm("up" if transfer == "push" else "down", 200_000, how)  # inside a record of the transfer
        started = time.monotonic()
        if transfer == "push":
            with contextlib.suppress(OSError):  # the relay or the shard may hang up first
                lane.stage(token, [memoryview(data)], WAIT)
            with pytest.raises(errors.UnavailableError, match="not open"):
                server.claim(lane.lane_id, token, len(data), WAIT, owner=A)
        else:
            with futures.ThreadPoolExecutor(1) as handler:
                sent = handler.submit(server.deliver, lane.lane_id, token, b"header", [memoryview(data)], WAIT,
                                      owner=A)
                with pytest.raises(ssl.SSLError if how == "flip" else OSError):  # cut: LaneError, or a reset
                    _, nbytes = lane.receive_header(token, WAIT)
                    lane.receive_into(memoryview(bytearray(nbytes)))
                lane.close()
                with contextlib.suppress(errors.UnavailableError):
                    sent.result(timeout=WAIT)
        assert time.monotonic() - started < WAIT / 2
        lane.close()
        relay.close()
        relay.join()
        pool.close()
        wait_for(lambda: server.open_lanes == 0 and budget.held == 0, "the lane to close and free its bytes")
        wait_for(lambda: threading.active_count() <= threads_before, "the lane's thread to end")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        if transfer == "push":
            why = "bad record mac" if how == "flip" else "closed by the peer"
            assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
