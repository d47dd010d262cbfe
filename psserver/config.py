"""Shard configuration: one frozen dataclass, built once in ``main()`` from flags, then
``PSSERVER_*`` environment variables, then defaults (flags win). Only this module reads
``argv`` and the environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pswire.codec import DEFAULT_CHUNK_BYTES
from pswire.flags import add_fields, add_version, parse

if TYPE_CHECKING:
    from psserver.auth import AdmissionCaps

__all__ = ["RESTORE_MODES", "ServerConfig", "parse_args"]

RESTORE_MODES = ("never", "always", "auto")
"""Values of ``ServerConfig.restore`` (``--restore``)."""


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": 'Interface to bind. Loopback by default; containers bind 0.0.0.0 on an internal network.'})
    port: int = field(default=0, metadata={"help": 'TCP port; 0 picks a free one (it is logged and written to --port-file).'})
    bulk_port: int = field(default=0, metadata={"help": 'TCP port of the bulk lanes, which carry the bytes of large pushes and pulls beside gRPC (on --host; workers learn it when they register); 0 picks a free one, -1 turns lanes off (every byte goes through gRPC).'})
    port_file: str | None = field(default=None, metadata={"help": 'If set, the bound port is written here (atomically) once the shard serves.'})
    threads: int = field(default=32, metadata={"help": 'gRPC handler threads; also the most RPCs served at once (see --max-data-calls for how they are shared).'})
    max_concurrent_rpcs: int = field(default=256, metadata={"help": 'RPCs accepted at once, running or queued for a thread; more get RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded", which workers retry).'})
    max_data_calls: int = field(default=0, metadata={"help": 'Data calls (Initialize, Push, PushInline, PushPull, Pull, PullInline, PullRows, Checkpoint) served at once; beyond, a call is refused at once as RESOURCE_EXHAUSTED "overloaded: ..." and workers retry it after a backoff. 0: --threads minus 8, at least 2, so that stalled streams and waiting pulls always leave threads for heartbeats, registrations and health checks (Register, Heartbeat, Leave and health Check are never capped; Status and health Watch have caps of their own).'})
    max_status_calls: int = field(default=2, metadata={"help": 'Status calls served at once; beyond, refused as overloaded like data calls. (Health Watch streams, open to all, are capped at 2.)'})
    stream_idle_timeout: float = field(default=10.0, metadata={"help": 'Seconds a client stream (Push, Initialize) may go without sending before the shard cuts it and frees its thread; 0: never.'})
    max_model_bytes: int = field(default=64 << 30, metadata={"help": 'Largest total of variable bytes a job may register on this shard.'})
    max_lanes: int = field(default=256, metadata={"help": 'Bulk lanes open at once on this shard (each is a thread; every worker keeps one or two per shard, and a worker refused one sends its calls and bytes through gRPC for 30 s). Raise it for more than about 200 workers per shard.'})
    max_workers: int = field(default=4096, metadata={"help": 'Worker names this shard remembers (live, departed and evicted); a new name beyond is refused.'})
    tls_cert: str | None = field(default=None, metadata={"help": 'PEM certificate chain of this shard: serve gRPC and the bulk lanes over TLS (needs --tls-key). Clients verify it against their --tls-ca, and its subject alternative names must include the host they connect to.'})
    tls_key: str | None = field(default=None, metadata={"help": 'PEM private key of --tls-cert.'})
    tls_client_ca: str | None = field(default=None, metadata={"help": 'PEM bundle of the CA(s) whose client certificates this shard requires (mutual TLS; needs --tls-cert): a client without one is refused in the handshake.'})
    auth_token_file: str | None = field(default=None, metadata={"help": 'Require a bearer token on every call but health checks (metadata "authorization: Bearer TOKEN"; clients use --token-file or PSGRPC_TOKEN). The file holds one "ROLE TOKEN" per line, blank lines and lines starting with # ignored; ROLE is reader (Status, Pull, PullInline, PullRows: read the model), worker (a reader that may also Register, Initialize, Push, PushInline, PushPull, Heartbeat, Leave) or admin (everything, Checkpoint and every administrative call included); tokens are at least 16 printable ASCII characters, e.g. python -c "import secrets; print(secrets.token_urlsafe(32))". Keep it mode 600. No token: UNAUTHENTICATED; a role too low: PERMISSION_DENIED. Unset: no call is checked.'})
    max_request_bytes: int = field(default=8 << 30, metadata={"help": 'Largest push or initialisation accepted, in bytes.'})
    max_inflight_bytes: int = field(default=1 << 30, metadata={"help": "Bytes of pushes this shard holds received but not yet applied, across all workers; beyond, pushes wait with their bytes still in the network (one push alone is always admitted); 0: no bound."})
    chunk_bytes: int = field(default=DEFAULT_CHUNK_BYTES, metadata={"help": 'Chunk size of pull streams.'})
    init_timeout: float = field(default=60.0, metadata={"help": 'Seconds a registered initialiser has to upload the variables before another worker may.'})
    lease_timeout: float = field(default=30.0, metadata={"help": "Seconds without a heartbeat (or any call) after which a worker is evicted; 0 disables eviction."})
    checkpoint_dir: str | None = field(default=None, metadata={"help": "Directory (may be shared storage) for checkpoints, created by the first checkpoint if missing; enables psctl checkpoint."})
    checkpoint_every: str = field(default="", metadata={"help": "Periodic checkpoints: 30s (seconds) or 500 (steps every worker completed); empty: only on demand."})
    keep: int = field(default=3, metadata={"help": "Complete checkpoints kept; older ones are deleted."})
    restore: str = field(default="never", metadata={"choices": RESTORE_MODES, "const": "always", "help": "Start from this shard's part of the newest complete checkpoint in --checkpoint-dir (needs --shard-index and --num-shards). always (a bare --restore): there must be one, else the shard exits 1 naming why. auto (for containers that restart): restore when there is one; start empty when there is none (the directory is missing or empty, its checkpoints are unfinished, or they belong to a job ended by psctl end-job), and still exit 1 when complete checkpoints exist but none is usable (damaged, or made for another --num-shards), rather than drop a trained model. never: start empty. PSSERVER_RESTORE also takes 1/true/yes/on (always) and 0/false/no/off (never)."})
    shard_index: int = field(default=-1, metadata={"help": "This shard's index in the job (needed by --restore)."})
    num_shards: int = field(default=0, metadata={"help": "Shards in the job (needed by --restore)."})
    grace: float = field(default=5.0, metadata={"help": 'Seconds in-flight RPCs get to finish on shutdown.'})
    metrics_port: int | None = field(default=None, metadata={"help": 'Serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (psserver_* and process_*; docs/metrics.md); 0 picks a free port, which is logged ("metrics on http://HOST:PORT/metrics"). Unset: no endpoint (and prometheus_client is not loaded). The endpoint has no TLS or tokens: keep it on a network only Prometheus reaches.'})
    metrics_host: str | None = field(default=None, metadata={"help": 'Interface of the metrics endpoint (needs --metrics-port); unset: --host.'})
    log_level: str = field(default="INFO", metadata={"help": "Logging level: DEBUG, INFO, WARNING, ERROR."})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not -1 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk_port must be in 0..65535, or -1 for no bulk lanes, got {self.bulk_port}")
        if self.threads < 1 or self.max_concurrent_rpcs < self.threads:
            raise ValueError("threads must be >= 1 and max_concurrent_rpcs >= threads")
        if self.chunk_bytes < 1024 or self.chunk_bytes > (4 << 20) - 4096:
            raise ValueError("chunk_bytes must be between 1 KiB and just under 4 MiB")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        if isinstance(self.restore, bool):  # restore=True from callers that predate the modes
            object.__setattr__(self, "restore", "always" if self.restore else "never")
        if self.restore not in RESTORE_MODES:
            raise ValueError(f"--restore must be one of {', '.join(RESTORE_MODES)} (a bare --restore: always), "
                             f"got {self.restore!r}")
        restores = self.restore != "never"
        if (self.checkpoint_every or restores) and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every and --restore need --checkpoint-dir")
        if restores and not 0 <= self.shard_index < self.num_shards:
            raise ValueError("--restore needs --shard-index I and --num-shards N with 0 <= I < N")
        from psserver.checkpointer import parse_schedule

        parse_schedule(self.checkpoint_every)
        if self.lease_timeout < 0:
            raise ValueError(f"lease_timeout must be >= 0, got {self.lease_timeout}")
        if self.max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {self.max_inflight_bytes}")
        if self.max_request_bytes < 1 or self.init_timeout <= 0 or self.grace < 0:
            raise ValueError("max_request_bytes and init_timeout must be > 0, grace >= 0")
        if not 0 <= self.max_data_calls <= self.threads:
            raise ValueError(f"max_data_calls must be in 0..threads ({self.threads}), got {self.max_data_calls}")
        if not 1 <= self.max_status_calls <= self.threads:
            raise ValueError(f"max_status_calls must be in 1..threads ({self.threads}), got {self.max_status_calls}")
        if self.stream_idle_timeout < 0:
            raise ValueError(f"stream_idle_timeout must be >= 0, got {self.stream_idle_timeout}")
        if self.max_model_bytes < 1 or self.max_workers < 1 or self.max_lanes < 1:
            raise ValueError("max_model_bytes, max_workers and max_lanes must be >= 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS with client certificates")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            if getattr(self, name) == "":
                raise ValueError(f"--{name.replace('_', '-')} is empty: give a file")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (0: any free port), got {self.metrics_port}")
        if self.metrics_host is not None:
            if self.metrics_port is None:
                raise ValueError("--metrics-host needs --metrics-port")
            if not self.metrics_host.strip():
                raise ValueError("--metrics-host is empty: give an interface, e.g. 127.0.0.1")

    @property
    def metrics_address(self) -> str | None:
        """The interface the metrics endpoint binds (``metrics_host``, else ``host``); None
        without ``metrics_port``."""
        if self.metrics_port is None:
            return None
        return self.metrics_host if self.metrics_host is not None else self.host

    def admission_caps(self) -> "AdmissionCaps":
        """The calls of each class this shard serves at once (``psserver.auth``)."""
        from psserver.auth import AdmissionCaps

        return AdmissionCaps.for_threads(self.threads, max_data_calls=self.max_data_calls,
                                         max_status_calls=self.max_status_calls)


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags, then ``PSSERVER_<FIELD>`` variables, then defaults. Raises ``SystemExit`` (via
    argparse) on bad flags, with the ``ValueError`` message of an invalid value."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="psserver", description="Run one parameter-server shard.",
        epilog="Every flag can also be set as PSSERVER_<FLAG> (e.g. PSSERVER_PORT=7000); flags win.",
    )
    add_fields(parser, ServerConfig)
    add_version(parser)
    return parse(ServerConfig, parser, argv, env, "PSSERVER")
