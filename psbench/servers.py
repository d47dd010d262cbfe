"""The baselines' servers, run as a child process like a shard (``python -m psbench.servers``):

* ``tcp``: a plain socket sink. Each transfer is an 8-byte little-endian length, then that
  many bytes, received with ``recv_into`` into one preallocated buffer; the sink answers one
  byte when all have arrived. A length of 0 ends the connection.
* ``grpc``: a service with no work in its handlers, over raw ``bytes`` messages (no protobuf):
  ``Sink`` (client stream, discarded), ``Source`` (server stream of preallocated chunks) and
  ``Echo`` (unary). Same message limits and the same kind of thread pool as a shard.

Both bind loopback port 0 and write the port to ``--port-file`` once serving.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures

from pswire.files import write_atomically

__all__ = ["ECHO", "GRPC_SERVICE", "SINK", "SOURCE", "TCP_ACK", "TCP_HEADER", "main"]

GRPC_SERVICE = "psbench.Bare"
SINK = f"/{GRPC_SERVICE}/Sink"
SOURCE = f"/{GRPC_SERVICE}/Source"
ECHO = f"/{GRPC_SERVICE}/Echo"

TCP_HEADER = struct.Struct("<Q")
TCP_ACK = b"\x01"

_MESSAGE_LIMIT = 64 << 20  # as a shard's
_TCP_BUFFER = 4 << 20


def _recv_exactly_into(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False if the peer closed first."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _serve_tcp_connection(conn: socket.socket) -> None:
    buffer = memoryview(bytearray(_TCP_BUFFER))
    header = memoryview(bytearray(TCP_HEADER.size))
    with conn:
        while _recv_exactly_into(conn, header):
            (remaining,) = TCP_HEADER.unpack(header)
            if remaining == 0:
                return
            while remaining:
                n = conn.recv_into(buffer[: min(remaining, len(buffer))])
                if n == 0:
                    return
                remaining -= n
            conn.sendall(TCP_ACK)


def serve_tcp(host: str, port: int, ready) -> None:
    listener = socket.create_server((host, port))
    ready(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_tcp_connection, args=(conn,), daemon=True).start()


def _sink(request_iterator: Iterator[bytes], context) -> bytes:
    for _ in request_iterator:
        pass
    return b""


def _source_handler(chunk: bytes):
    def source(request: bytes, context) -> Iterator[bytes]:
        # The request is the total byte count; the same chunk object is sent over and over, so
        # the figure is gRPC's own cost per message with no copy on the Python side.
        (total,) = TCP_HEADER.unpack(request)
        whole, rest = divmod(total, len(chunk))
        for _ in range(whole):
            yield chunk
        if rest:
            yield chunk[:rest]

    return source


def _echo(request: bytes, context) -> bytes:
    return request


def serve_grpc(host: str, port: int, ready, chunk_bytes: int) -> None:
    import grpc  # imported here so that the tcp server runs without it

    handlers = {
        "Sink": grpc.stream_unary_rpc_method_handler(_sink),
        "Source": grpc.unary_stream_rpc_method_handler(_source_handler(bytes(chunk_bytes))),
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="psbench-grpc"),
        options=[("grpc.max_receive_message_length", _MESSAGE_LIMIT),
                 ("grpc.max_send_message_length", _MESSAGE_LIMIT),
                 ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    server.start()
    ready(bound)
    server.wait_for_termination()


def _port_writer(path: str):
    def ready(port: int) -> None:
        write_atomically(path, f"{port}\n")

    return ready


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m psbench.servers", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("tcp", "grpc"))
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="port (default: 0, any free one)")
    parser.add_argument("--port-file", required=True, help="file the bound port is written to")
    # psbench passes pswire.codec.DEFAULT_CHUNK_BYTES; importing pswire here would pull in torch.
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20,
                        help="size of the Source stream's messages (default: 1 MiB)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # nothing to flush: a sink holds no state
    ready = _port_writer(args.port_file)
    if args.kind == "tcp":
        serve_tcp(args.host, args.port, ready)
    else:
        serve_grpc(args.host, args.port, ready, args.chunk_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
