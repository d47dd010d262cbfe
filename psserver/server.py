"""Server wiring: a gRPC server with the shard's servicer and the standard health service."""

from __future__ import annotations

import logging
import os
import tempfile
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pswire.v1 import ps_pb2_grpc
from psserver.config import ServerConfig
from psserver.servicer import ParameterServerServicer
from psserver.store import ShardStore

__all__ = ["Shard", "create_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = "pswire.v1.ParameterServer"

# Chunks are ~1 MiB; the limit leaves room for headers that list many variables.
_MESSAGE_LIMIT = 64 << 20


@dataclass
class Shard:
    """A running shard: its server, bound port, store and health servicer."""

    server: grpc.Server
    port: int
    store: ShardStore
    health: health.HealthServicer
    config: ServerConfig

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, then let in-flight RPCs finish for ``grace`` seconds."""
        self.health.enter_graceful_shutdown()
        self.server.stop(self.config.grace if grace is None else grace).wait(timeout=30)


def create_server(config: ServerConfig, *, store: ShardStore | None = None) -> Shard:
    """Build, bind and start a shard. Raises ``RuntimeError`` if the address cannot be bound."""
    store = store or ShardStore(
        init_timeout=config.init_timeout, max_waiting_pulls=max(1, config.threads - 2)
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="psserver"),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
            ("grpc.max_send_message_length", _MESSAGE_LIMIT),
            ("grpc.so_reuseport", 0),
        ],
    )
    target = f"{config.host}:{config.port}"
    try:
        port = server.add_insecure_port(target)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {target}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot bind {target}")
    address = f"{config.host}:{port}"
    servicer = ParameterServerServicer(
        store, address=address, chunk_bytes=config.chunk_bytes, max_request_bytes=config.max_request_bytes
    )
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file:
        _write_atomically(config.port_file, f"{port}\n")
    log.info("psserver listening on %s", address)
    return Shard(server, port, store, health_servicer, config)


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
