"""TLS for the bulk lanes, driven through memory BIOs over a non-blocking socket.

``ssl.SSLSocket`` lets OpenSSL use the socket itself: two ``recv`` calls per 16 KiB record
read (its header, then its body) and a ``send`` per record written, about 200 system calls per
MiB moved. A :class:`TLSStream` keeps the same TLS (``SSLContext.wrap_bio``: the same context,
certificates, verification and protocol) but moves the ciphertext itself, in large pieces: one
``recv_into`` of up to ``RECV_BYTES`` feeds the incoming BIO, out of which OpenSSL decrypts
record after record straight into the caller's buffer; a write encrypts up to ``WRITE_BYTES``
of the caller's bytes into the outgoing BIO in one call, sent in a few large ``send`` calls.
About 11 system calls per MiB remain. The handshake goes through the same loop.

A stream has the few socket methods the lanes use (``settimeout``, ``recv_into``, ``sendall``,
``fileno``, ``shutdown``, ``close``); a timeout bounds each whole call, as ``socket.sendall``'s
does. Like a socket it is used by one thread at a time, except ``shutdown``, which touches
only the socket (never the TLS state) and may come from any thread to wake the one using it.
An end of the connection, with or without TLS's ``close_notify``, reads as the peer closing (0
bytes), as ``SSLSocket`` reads it by default: the lanes' frames carry their byte counts, so a
cut stream is caught there. Every TLS failure (a bad record, a failed verification) raises
``ssl.SSLError``, an ``OSError``.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import time

__all__ = ["RECV_BYTES", "WRITE_BYTES", "TLSStream"]

RECV_BYTES = 256 << 10
"""The most ciphertext read from the socket at once, once a read asks for more than
``_SMALL_RECV_BYTES`` (a stream that only ever carries small frames keeps a small buffer)."""
WRITE_BYTES = 256 << 10
"""The most plaintext encrypted before its records are sent (so the ciphertext of a large
write never piles up in memory). A busy stream holds about three times 256 KiB: its receive
buffer and its two BIOs."""
_SMALL_RECV_BYTES = 17 << 10
"""The receive buffer until then: one whole TLS record (16 KiB and its overhead)."""


class TLSStream:
    """A TLS connection over ``sock`` (which it owns from now on) with ``context``: the server
    end when ``server_side``, else the client end checking the peer's certificate for
    ``server_hostname``. Call :meth:`handshake` before anything else. Raises ``ValueError``
    from ``context.wrap_bio`` (a client end without a host name on a context that checks it)."""

    def __init__(
        self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None,
    ) -> None:
        self._timeout = sock.gettimeout()
        sock.setblocking(False)  # waits are ours: poll() with what is left of the call's deadline
        self._sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        self._buffer = memoryview(bytearray(_SMALL_RECV_BYTES))
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)
        self._writable = select.poll()
        self._writable.register(sock.fileno(), select.POLLOUT)

    # -- the socket's side -------------------------------------------------------------------

    def fileno(self) -> int:
        return self._sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        """Bound each later call to ``timeout`` seconds (None: no bound)."""
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def shutdown(self, how: int) -> None:
        """The socket's shutdown: the thread using the stream wakes and fails. Any thread."""
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    # -- TLS ---------------------------------------------------------------------------------

    def handshake(self, timeout: float) -> None:
        """Complete the TLS handshake within ``timeout`` seconds. Raises ``TimeoutError``,
        ``ssl.SSLError`` (refused: a wrong certificate, not TLS at all) or ``ConnectionError``
        (the peer closed)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush(deadline)
                if not self._fill(deadline):
                    raise ConnectionError("the peer closed the connection during the TLS handshake") from None
        self._flush(deadline)  # the last flight (and a TLS 1.3 server's session tickets)

    def version(self) -> str | None:
        """The TLS version agreed (``"TLSv1.3"``), None before the handshake."""
        return self._tls.version()

    def cipher(self) -> tuple[str, str, int] | None:
        return self._tls.cipher()

    def pending(self) -> int:
        """Bytes held here that ``poll()`` on the socket cannot see: decrypted and not yet read,
        or received and not yet decrypted."""
        return self._tls.pending() + self._incoming.pending

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        """Decrypt into ``buffer`` (a writable byte buffer) up to ``nbytes`` bytes (0: all it
        holds); returns how many, at least 1 unless the peer closed (0). Only the first byte is
        waited for: after it, what the records already received hold."""
        view = memoryview(buffer)
        if view.format != "B":
            view = view.cast("B")
        want = min(nbytes, view.nbytes) if nbytes else view.nbytes
        if want == 0:
            return 0
        if want > _SMALL_RECV_BYTES and len(self._buffer) < RECV_BYTES:
            self._buffer = memoryview(bytearray(RECV_BYTES))
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        got = 0
        while got < want:
            try:
                got += self._tls.read(want - got, view[got:] if got else view)
            except ssl.SSLWantReadError:
                if self._outgoing.pending:  # an answer the peer's record asked for (TLS 1.3 key update)
                    self._flush(deadline)
                if got or not self._fill(deadline):
                    break
            except ssl.SSLZeroReturnError:  # the peer's close_notify
                break
        return got

    def sendall(self, data) -> None:
        """Encrypt and send all of ``data``, ``WRITE_BYTES`` at a time."""
        view = memoryview(data)
        if view.format != "B":
            view = view.cast("B")
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        for offset in range(0, view.nbytes, WRITE_BYTES):
            piece = view[offset : offset + WRITE_BYTES]
            while piece:
                try:
                    piece = piece[self._tls.write(piece):]
                except ssl.SSLWantReadError:  # a TLS 1.2 renegotiation under way needs the peer's answer
                    self._flush(deadline)
                    if not self._fill(deadline):
                        raise ConnectionError("the peer closed the connection") from None
            self._flush(deadline)

    # -- moving ciphertext -------------------------------------------------------------------

    def _fill(self, deadline: float | None) -> bool:
        """Move what the socket has (waiting for something) into the incoming BIO; False when
        the peer closed."""
        if self._incoming.pending >= RECV_BYTES:
            # OpenSSL drains the BIO before it asks for more, except in a state no lane reaches
            # (records it will not read yet): refuse to hold more rather than grow without end.
            raise ConnectionError(f"TLS stream: {self._incoming.pending} bytes received that TLS does not take")
        while True:
            try:
                n = self._sock.recv_into(self._buffer)
            except BlockingIOError:
                self._wait(self._readable, deadline, "receive")
                continue
            if n == 0:
                return False
            self._incoming.write(self._buffer[:n])
            return True

    def _flush(self, deadline: float | None) -> None:
        while self._outgoing.pending:
            view = memoryview(self._outgoing.read())
            while view:
                try:
                    view = view[self._sock.send(view):]
                except BlockingIOError:
                    self._wait(self._writable, deadline, "send")

    @staticmethod
    def _wait(poller: select.poll, deadline: float | None, what: str) -> None:
        if deadline is None:
            poller.poll()
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"TLS stream: could not {what} in time")
        poller.poll(math.ceil(left * 1000))
