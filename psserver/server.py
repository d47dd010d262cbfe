"""Server wiring: a gRPC server with the shard's servicer and the standard health service,
behind the token and admission interceptors (``psserver.auth``), over TLS when configured."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pswire.files import write_atomically
from pswire.security import ServerTLS
from psserver.auth import Admission, TokenAuth, load_token_file
from psserver.lanecalls import lane_calls
from psserver.checkpoint import CheckpointError
from psserver.buffers import trim_heap
from psserver.checkpointer import Checkpointer, parse_schedule
from psserver.config import ServerConfig
from psserver.inflight import InflightBudget
from psserver.lanes import LaneServer
from psserver.servicer import ParameterServerServicer, add_to_server
from psserver.store import ShardStore

if TYPE_CHECKING:
    from psserver.metrics import ShardMetrics

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
    admission: Admission | None = None
    servicer: ParameterServerServicer | None = None
    metrics: "ShardMetrics | None" = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        """The bound port of the metrics endpoint; None without ``--metrics-port``."""
        return self.metrics.port if self.metrics is not None else None

    @property
    def metrics_url(self) -> str | None:
        """``http://HOST:PORT/metrics``; None without ``--metrics-port``."""
        address, port = self.config.metrics_address, self.metrics_port
        if address is None or port is None:
            return None
        from psserver.metrics import metrics_url  # loaded already: the shard serves metrics

        return metrics_url(address, port)

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
        if self.servicer is not None:
            self.servicer.stop()
        if self.metrics is not None:
            self.metrics.stop()


class _Reaper:
    """Evicts workers whose lease expired, checking four times per lease, and closes the bulk
    lanes of sessions that ended."""

    def __init__(self, store: ShardStore, lease: float, lanes: LaneServer | None = None) -> None:
        self._store = store
        self._lanes = lanes
        self._period = lease / 4
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psserver-reaper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(timeout=self._period):
            try:
                self._store.evict_expired()
                if self._lanes is not None:
                    self._lanes.close_ended()
            except Exception:  # the reaper must outlive any one bad pass
                log.exception("lease check failed")

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)


def create_server(config: ServerConfig, *, store: ShardStore | None = None, failpoint=None) -> Shard:
    """Build, bind and start a shard, with its metrics endpoint when ``config.metrics_port`` is
    set. Raises ``RuntimeError`` if the address (or the metrics port) cannot be bound or a
    requested restore fails (naming why: ``--restore always`` with nothing to restore, or
    checkpoints that exist but none usable), ``ValueError`` if a TLS or token file cannot be read
    or parsed (naming its flag and path)."""
    tls = ServerTLS(cert_file=config.tls_cert, key_file=config.tls_key, client_ca_file=config.tls_client_ca) \
        if config.tls_cert else None
    # Before anything starts (a restore can take a while): a port another process holds is named
    # in one line, where gRPC would log a C-core error and "set GRPC_VERBOSITY=debug".
    check_ports(config)
    tokens = load_token_file(config.auth_token_file) if config.auth_token_file else None
    caps = config.admission_caps()
    lease = config.lease_timeout or None
    store = store or ShardStore(
        init_timeout=config.init_timeout, max_waiting_pulls=caps.waiting_pulls(), lease_timeout=lease,
        max_model_bytes=config.max_model_bytes, max_workers=config.max_workers,
    )
    admission = Admission(caps)
    store.data_slots_scarce = admission.data_slots_scarce
    metrics = None
    if config.metrics_port is not None:
        # Imported only here: prometheus_client costs a shard 3.3 MiB that a shard without
        # metrics keeps (psbench's memory check has little more to spare).
        from psserver.metrics import ShardMetrics

        metrics = ShardMetrics()
    # The call timer goes first, so that it also times the calls the others refuse.
    interceptors = ([metrics.rpc] if metrics is not None else []) \
        + ([TokenAuth(tokens)] if tokens is not None else []) + [admission]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="psserver"),
        interceptors=interceptors,
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
            failpoint=failpoint, on_written=metrics.checkpoint_written if metrics is not None else None,
        )
        if config.restore != "never":
            try:
                restored = checkpointer.restore(config.shard_index, config.num_shards,
                                                required=config.restore == "always")
            except CheckpointError as exc:
                raise RuntimeError(f"cannot restore (--restore {config.restore}): {exc}") from exc
            log.log(restored.level, "%s", restored.reason)
            if restored.checkpoint_id is not None:
                trim_heap()  # the checkpoint's file and decoded copies are gone; give their heap back
    target = f"{config.host}:{config.port}"
    try:
        if tls is not None:
            port = server.add_secure_port(target, tls.server_credentials())
        else:
            port = server.add_insecure_port(target)
    except RuntimeError as exc:
        port, failure = 0, exc
    else:
        failure = None
    if port == 0:  # taken since check_ports looked, say: explain it as check_ports would
        bind_check(config.host, config.port, "--port")
        raise RuntimeError(f"cannot bind {target}" + (f": {failure}" if failure else "")) from failure
    address = f"{config.host}:{port}"
    budget = InflightBudget(config.max_inflight_bytes)
    lanes = None
    if config.bulk_port >= 0:
        try:
            lanes = LaneServer(config.host, config.bulk_port, max_bytes=config.max_request_bytes, budget=budget,
                               session_secret=store.session_secret, max_lanes=config.max_lanes,
                               ssl_context=tls.ssl_context() if tls is not None else None)
        except RuntimeError as exc:
            _explain_bind(exc, config.host, config.bulk_port, "--bulk-port")
            raise
    servicer = ParameterServerServicer(
        store, address=address, chunk_bytes=config.chunk_bytes, max_request_bytes=config.max_request_bytes,
        checkpointer=checkpointer, lanes=lanes, budget=budget, stream_idle_timeout=config.stream_idle_timeout,
    )
    add_to_server(servicer, server)
    if lanes is not None:
        lanes.take_calls(lane_calls(servicer, metrics.rpc if metrics is not None else None))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if metrics is not None:
        from psserver.metrics import ShardCollector, metrics_url

        metrics.watch(ShardCollector(store, traffic=servicer.traffic, budget=budget, checkpointer=checkpointer,
                                     shard_index=config.shard_index, num_shards=config.num_shards))
        try:
            metrics.serve(config.metrics_address, config.metrics_port)
        except RuntimeError as exc:
            if lanes is not None:
                lanes.stop()
            _explain_bind(exc, config.metrics_address, config.metrics_port, "--metrics-port")
            raise
        log.info("metrics on %s", metrics_url(config.metrics_address, metrics.port))
        if not is_loopback(config.metrics_address):
            log.warning("metrics on %s are served without TLS or tokens: anyone who reaches that port reads the "
                        "worker names, counters and sizes (no tensors, tokens or secrets)",
                        metrics_url(config.metrics_address, metrics.port))
    if lanes is not None:
        lanes.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file:
        write_atomically(config.port_file, f"{port}\n")
    log.info("psserver listening on %s%s (%s; %s; at once: %d data calls, %d status calls, %d threads)", address,
             f", bulk lanes on port {lanes.port}" if lanes else "",
             ("mutual TLS" if tls.mutual else "TLS") if tls is not None else "plaintext",
             f"{len(tokens)} token(s) checked" if tokens is not None else "no tokens checked",
             caps.data, caps.status, config.threads)
    for warning in exposure_warnings(config.host, port, lanes.port if lanes else None,
                                     tls=tls is not None, mutual=tls is not None and tls.mutual,
                                     tokens=tokens is not None):
        log.warning("%s", warning)
    reaper = _Reaper(store, lease, lanes) if lease else None
    if checkpointer is not None:
        checkpointer.start()
    return Shard(server, port, store, health_servicer, config, reaper, checkpointer, lanes, admission, servicer,
                 metrics)


def check_ports(config: ServerConfig) -> None:
    """Raise ``RuntimeError`` naming the flag and the port when a port the shard is configured
    to bind (``--port``, ``--bulk-port``, ``--metrics-port``; 0 is any free one) is taken, or
    given twice."""
    wanted = [(config.host, config.port, "--port")]
    if config.bulk_port > 0:
        wanted.append((config.host, config.bulk_port, "--bulk-port"))
    if config.metrics_port:
        wanted.append((config.metrics_address, config.metrics_port, "--metrics-port"))
    seen: dict[tuple[str, int], str] = {}
    for host, port, flag in wanted:
        if port == 0:
            continue
        if (host, port) in seen:
            raise RuntimeError(f"{seen[host, port]} and {flag} are both {port}: give each its own port "
                               "(0 picks a free one)")
        seen[host, port] = flag
        bind_check(host, port, flag)


_PORT_NAMES = {"--port": "", "--bulk-port": "the bulk port ", "--metrics-port": "the metrics port "}


def bind_check(host: str, port: int, flag: str) -> None:
    """Raise ``RuntimeError`` naming the port and ``flag`` when ``host:port`` cannot be bound
    now ("cannot bind 127.0.0.1:7000: port 7000 is already in use ..."). The probe binds as the
    shard's servers do, with SO_REUSEADDR and without SO_REUSEPORT: a port another process
    listens on fails, one that a shard stopped a moment ago left in TIME_WAIT does not. Binding
    one of the addresses ``host`` resolves to suffices, as it does for gRPC."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RuntimeError(f"cannot bind {_PORT_NAMES.get(flag, '')}{host}:{port}: {exc.strerror}") from exc
    failure: OSError | None = None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                failure = failure or exc
            else:
                return
    if failure is not None:
        _explain_bind(failure, host, port, flag)
        raise RuntimeError(f"cannot bind {_PORT_NAMES.get(flag, '')}{host}:{port}: {failure.strerror or failure}") \
            from failure


def _explain_bind(exc: BaseException, host: str, port: int, flag: str) -> None:
    """Raise a ``RuntimeError`` that says in words why ``host:port`` could not be bound, when
    ``exc`` (or its cause) is an ``OSError`` of a common reason; else return."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    code = cause.errno if isinstance(cause, OSError) else None
    if code == errno.EADDRINUSE:
        reason = (f"port {port} is already in use (another psserver?): stop what holds it, or give another "
                  f"{flag} (0 picks a free one)")
    elif code == errno.EACCES:
        reason = f"port {port} needs privileges this process lacks: give a {flag} above 1023"
    elif code == errno.EADDRNOTAVAIL:
        reason = f"{host} is not an address of this machine"
    else:
        return
    raise RuntimeError(f"cannot bind {_PORT_NAMES.get(flag, '')}{host}:{port}: {reason}") from cause


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warnings(host: str, port: int, bulk_port: int | None, *, tls: bool, mutual: bool,
                      tokens: bool) -> list[str]:
    """What a shard bound to ``host`` leaves unprotected, and the flags that fix it (nothing
    on loopback)."""
    if is_loopback(host):
        return []
    ports = f"port {port}" + (f" and bulk port {bulk_port}" if bulk_port else "")
    out = []
    if not tls:
        out.append(f"{host} is not loopback and TLS is off: every call, tensor and token on {ports} travels "
                   "in clear text, and clients cannot tell this shard from an impostor (give --tls-cert and "
                   "--tls-key; --tls-client-ca to require client certificates)")
    if not tokens:
        out.append(f"{host} is not loopback and no tokens are checked: anyone who reaches {ports}"
                   f"{' with a client certificate' if mutual else ''} may register, push, pull, read the model "
                   "and write checkpoints (give --auth-token-file)")
    return out
