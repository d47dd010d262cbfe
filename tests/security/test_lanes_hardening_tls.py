"""Security tier: the bulk port (``psserver.lanes``) over TLS, against peers that are not
well-behaved workers. A ``LaneServer`` with a throwaway CA's certificate runs in-process on a
port chosen at run time, loopback only; the good worker is a ``psworker.lanes.LanePool`` with
TLS, the others are raw sockets, TLS driven by hand through memory BIOs, or a relay that
garbles or cuts the stream (see ``lane_harness`` for what the tests share).

TLS lanes carry pushes and pulls exactly; plaintext and TLS never mix; a frame, a record or a
handshake that stalls is cut within its deadline; and a stream garbled or cut in flight closes
the lane at once and frees what it held. The plaintext port is tested in
``test_lanes_hardening_plaintext``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
from concurrent import futures
from datetime import datetime, timedelta, timezone

import pytest

from psserver import lanes as server_lanes
from psserver.inflight import InflightBudget
from psserver.lanes import LaneServer
from pswire import errors
from pswire import lanes as wire
from pswire.tlsbio import TLSStream
from psworker import lanes as worker_lanes
from psworker.lanes import LanePool
from tests.security.lane_harness import (
    WAIT,
    A,
    B,
    MiB,
    auth,
    hung_up,
    lane_server,
    pool_for,
    pull,
    push,
    refusals,
    wait_for,
)

pytestmark = pytest.mark.timeout(30)


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
