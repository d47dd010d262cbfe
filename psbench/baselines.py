"""Baselines measured in the same run as the parameter server, against servers in a child
process (``psbench.servers``) over loopback:

* raw TCP goodput: one stream, preallocated buffers, ``sendall`` / ``recv_into``; the most the
  kernel and one Python thread per side move, and the yardstick for every PS goodput figure;
* bare gRPC streaming goodput, up (client stream, discarded) and down (server stream), in
  messages of the PS chunk size: what gRPC Python costs before any PS logic runs;
* bare gRPC unary echo latency with a small payload: the floor of any small PS call.

:class:`TcpClient` and :class:`EchoClient` also serve as *paired* references: the PS sections
run one reference transfer or call next to each of theirs, so that on a shared machine both
sides of a ratio see the same load.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from psbench.servers import ECHO, SINK, SOURCE, TCP_ACK, TCP_HEADER
from psbench.stats import LatencySummary, median, repetitions

__all__ = ["CpuClock", "Echo", "EchoClient", "Goodput", "TcpClient", "grpc_echo_latency", "grpc_stream_goodput",
           "tcp_goodput"]

MIB = 1 << 20
_MESSAGE_LIMIT = 64 << 20
_TCP_PAYLOAD = 64 << 20  # larger transfers send this one buffer again and again

CpuClock = Callable[[], float]
"""CPU seconds used so far by the server process (``psbench.procs.Child.cpu_seconds``)."""


@dataclass(frozen=True)
class Goodput:
    """Bytes per second of one kind of transfer: the median of ``reps`` timed repetitions."""

    bytes_per_transfer: int
    reps: int
    seconds: list[float]
    """Each timed repetition, in order (warm-up excluded)."""
    cpu_seconds: float
    """CPU time of client and server together per transfer."""

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_per_transfer / median(self.seconds)

    @property
    def cpu_seconds_per_mib(self) -> float:
        return self.cpu_seconds / (self.bytes_per_transfer / MIB)

    def to_dict(self) -> dict:
        return {"bytes_per_transfer": self.bytes_per_transfer, "reps": self.reps,
                "bytes_per_second": self.bytes_per_second, "cpu_seconds_per_mib": self.cpu_seconds_per_mib,
                "seconds": repetitions(self.seconds)}


def _timed(run: Callable[[], None], reps: int, warmup: int, server_cpu: CpuClock) -> tuple[list[float], float]:
    """Per-repetition seconds, and client plus server CPU seconds per repetition."""
    for _ in range(warmup):
        run()
    seconds = []
    cpu_before = time.process_time() + server_cpu()
    for _ in range(reps):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return seconds, (time.process_time() + server_cpu() - cpu_before) / reps


class TcpClient:
    """One connection to the TCP sink. Raises ``OSError`` on socket errors (``TimeoutError``
    when one send or receive waits past ``timeout``)."""

    def __init__(self, port: int, *, timeout: float = 120.0) -> None:
        self._conn = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._payload = memoryview(bytearray(_TCP_PAYLOAD))
        self._ack = bytearray(1)

    def transfer(self, nbytes: int) -> float:
        """Send ``nbytes``; returns the seconds from the first byte sent to the sink's
        acknowledgement of the last."""
        started = time.perf_counter()
        self._conn.sendall(TCP_HEADER.pack(nbytes))
        remaining = nbytes
        while remaining:
            piece = self._payload[: min(remaining, len(self._payload))]
            self._conn.sendall(piece)
            remaining -= len(piece)
        if self._conn.recv_into(self._ack) != 1 or bytes(self._ack) != TCP_ACK:
            raise ConnectionError("the TCP sink closed the connection before acknowledging")
        return time.perf_counter() - started

    def close(self) -> None:
        try:
            self._conn.sendall(TCP_HEADER.pack(0))
        except OSError:
            pass  # the sink is gone already: nothing to end
        self._conn.close()

    def __enter__(self) -> "TcpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tcp_goodput(
    port: int, nbytes: int, *, reps: int, server_cpu: CpuClock, warmup: int = 1, timeout: float = 120.0
) -> Goodput:
    """Send ``nbytes`` to the TCP sink ``reps`` times on one connection. Raises ``OSError``."""
    with TcpClient(port, timeout=timeout) as client:
        seconds, cpu = _timed(lambda: client.transfer(nbytes), reps, warmup, server_cpu)
    return Goodput(nbytes, reps, seconds, cpu)


def _channel(port: int, timeout: float) -> grpc.Channel:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
        ("grpc.max_send_message_length", _MESSAGE_LIMIT),
    ])
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise TimeoutError(f"the bare gRPC server did not accept a connection within {timeout:.0f}s") from None
    return channel


def grpc_stream_goodput(
    port: int, nbytes: int, chunk_bytes: int, *, reps: int, server_cpu: CpuClock, warmup: int = 1,
    timeout: float = 120.0,
) -> tuple[Goodput, Goodput]:
    """Upload and download goodput of ``nbytes`` in ``chunk_bytes`` messages against the bare
    gRPC server. Returns ``(upload, download)``. Raises ``grpc.RpcError`` on call failures."""
    chunk = bytes(chunk_bytes)
    whole, rest = divmod(nbytes, chunk_bytes)

    def messages() -> Iterator[bytes]:
        for _ in range(whole):
            yield chunk
        if rest:
            yield chunk[:rest]

    with _channel(port, timeout) as channel:
        sink = channel.stream_unary(SINK)
        source = channel.unary_stream(SOURCE)

        def upload() -> None:
            sink(messages(), timeout=timeout)

        def download() -> None:
            received = 0
            for message in source(TCP_HEADER.pack(nbytes), timeout=timeout):
                received += len(message)
            if received != nbytes:
                raise ConnectionError(f"the bare gRPC source sent {received} bytes, expected {nbytes}")

        up = Goodput(nbytes, reps, *_timed(upload, reps, warmup, server_cpu))
        down = Goodput(nbytes, reps, *_timed(download, reps, warmup, server_cpu))
    return up, down


class EchoClient:
    """Unary echo calls of a fixed payload to the bare gRPC server. Raises ``TimeoutError`` if
    it does not connect within ``timeout``; calls raise ``grpc.RpcError``."""

    def __init__(self, port: int, payload_bytes: int, *, timeout: float = 10.0) -> None:
        self._channel = _channel(port, timeout)
        self._echo = self._channel.unary_unary(ECHO)
        self._payload = bytes(payload_bytes)
        self._timeout = timeout

    def call(self) -> float:
        """One echo; returns its seconds."""
        started = time.perf_counter()
        reply = self._echo(self._payload, timeout=self._timeout)
        seconds = time.perf_counter() - started
        if len(reply) != len(self._payload):
            raise ConnectionError("the echo reply differs in length from the request")
        return seconds

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "EchoClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Echo:
    latency: LatencySummary
    client_cpu_seconds: float
    """CPU time of this (client) process per call."""
    server_cpu_seconds: float
    """CPU time of the server per call."""

    def to_dict(self) -> dict:
        return {**vars(self.latency), "client_cpu_seconds_per_call": self.client_cpu_seconds,
                "server_cpu_seconds_per_call": self.server_cpu_seconds}


def grpc_echo_latency(
    port: int, payload_bytes: int, *, calls: int, server_cpu: CpuClock, warmup: int = 100, timeout: float = 10.0
) -> Echo:
    """Latency of ``calls`` sequential unary echo calls of ``payload_bytes``, with the CPU time
    each side spends per call. Raises ``grpc.RpcError`` on call failures."""
    with EchoClient(port, payload_bytes, timeout=timeout) as client:
        for _ in range(warmup):
            client.call()
        client_before, server_before = time.process_time(), server_cpu()
        seconds = [client.call() for _ in range(calls)]
        client_cpu, server = time.process_time() - client_before, server_cpu() - server_before
    return Echo(LatencySummary.of(seconds), client_cpu / calls, server / calls)
