"""Server wiring: a gRPC server with the shard's servicer and the standard health service."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psserver.checkpoint import CheckpointError
from psserver.buffers import trim_heap
from psserver.checkpointer import Checkpointer, parse_schedule
from psserver.config import ServerConfig
from psserver.inflight import InflightBudget
from psserver.lanes import LaneServer
from psserver.servicer import ParameterServerServicer, add_to_server
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
    reaper: "_Reaper | None" = None
    checkpointer: "Checkpointer | None" = None
    lanes: LaneServer | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, then let in-flight RPCs finish for ``grace`` seconds."""
        self.health.enter_graceful_shutdown()
        if self.reaper is not None:
            self.reaper.stop()
        if self.checkpointer is not None:
            self.checkpointer.stop()
        self.server.stop(self.config.grace if grace is None else grace).wait(timeout=30)
        if self.lanes is not None:
            self.lanes.stop()


class _Reaper:
    """Evicts workers whose lease expired, checking four times per lease."""

    def __init__(self, store: ShardStore, lease: float) -> None:
        self._store = store
        self._period = lease / 4
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psserver-reaper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(timeout=self._period):
            try:
                self._store.evict_expired()
            except Exception:  # the reaper must outlive any one bad pass
                log.exception("lease check failed")

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)


def create_server(config: ServerConfig, *, store: ShardStore | None = None, failpoint=None) -> Shard:
    """Build, bind and start a shard. Raises ``RuntimeError`` if the address cannot be bound or
    a requested restore fails (naming why)."""
    lease = config.lease_timeout or None
    store = store or ShardStore(
        init_timeout=config.init_timeout, max_waiting_pulls=max(1, config.threads - 2), lease_timeout=lease
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="psserver"),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
            ("grpc.max_send_message_length", _MESSAGE_LIMIT),
            ("grpc.so_reuseport", 0),
            # Workers ping idle connections to notice partitions (psworker.shard.KEEPALIVE_MS).
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    checkpointer = None
    if config.checkpoint_dir:
        checkpointer = Checkpointer(
            store, config.checkpoint_dir, keep=config.keep, schedule=parse_schedule(config.checkpoint_every),
            failpoint=failpoint,
        )
        if config.restore:
            try:
                restored = checkpointer.restore(config.shard_index, config.num_shards)
            except CheckpointError as exc:
                raise RuntimeError(f"cannot restore: {exc}") from exc
            log.info("restored checkpoint %d from %s", restored, config.checkpoint_dir)
            trim_heap()  # the checkpoint's file and decoded copies are gone; give their heap back
    target = f"{config.host}:{config.port}"
    try:
        port = server.add_insecure_port(target)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {target}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot bind {target}")
    address = f"{config.host}:{port}"
    budget = InflightBudget(config.max_inflight_bytes)
    lanes = None
    if config.bulk_port >= 0:
        lanes = LaneServer(config.host, config.bulk_port, max_bytes=config.max_request_bytes, budget=budget)
    servicer = ParameterServerServicer(
        store, address=address, chunk_bytes=config.chunk_bytes, max_request_bytes=config.max_request_bytes,
        checkpointer=checkpointer, lanes=lanes, budget=budget,
    )
    add_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if lanes is not None:
        lanes.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file:
        _write_atomically(config.port_file, f"{port}\n")
    log.info("psserver listening on %s%s", address, f", bulk lanes on port {lanes.port}" if lanes else "")
    reaper = _Reaper(store, lease) if lease else None
    if checkpointer is not None:
        checkpointer.start()
    return Shard(server, port, store, health_servicer, config, reaper, checkpointer, lanes)


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
