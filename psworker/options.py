"""How a client reaches a job's shards: their addresses (``parse_addresses``) and the
``ClientOptions`` every per-shard channel, ``PSClient`` and ``AdminClient`` is built with.

Torch-free, as ``psctl`` must start in an image without torch: a ``wire_dtype`` given as a torch
dtype is recognised by its name (``pswire.dtypes.dtype_of``), never by importing torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pswire import errors
from pswire.codec import DEFAULT_CHUNK_BYTES, WIRE_DTYPES
from pswire.dtypes import dtype_of
from pswire.placement import PACK_BELOW
from pswire.security import ClientSecurity

__all__ = ["ClientOptions", "parse_addresses"]


def parse_addresses(spec: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` (or a list) to a list of addresses; raises ``ValueError`` if malformed."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = [a.strip() for a in items if a.strip()]
    if not out:
        raise ValueError("no parameter-server address given (expected HOST:PORT[,HOST:PORT...])")
    for address in out:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad parameter-server address {address!r}: expected HOST:PORT")
    if len(set(out)) != len(out):
        raise ValueError(f"a parameter-server address is listed twice in {out}")
    return out


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    timeout: float = 30.0
    """Deadline of a small RPC in seconds; large transfers get ``bytes / min_bandwidth`` more."""
    min_bandwidth: float = 20e6
    """Bytes per second a transfer is assumed to reach at worst, to size its deadline."""
    connect_timeout: float = 60.0
    """Seconds to wait for every shard to accept a connection."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Size of the chunks a push or initialisation is cut into."""
    wait_timeout: float = 600.0
    """Seconds a pull may wait on the staleness bound (ssp/sync) before failing."""
    retry_timeout: float = 120.0
    """Seconds a push or pull keeps retrying an unreachable shard (e.g. one being restarted)."""
    wire_dtype: Any = None
    """Wire compression: send floating-point gradients and pull weights in this dtype
    (``torch.bfloat16`` or ``torch.float16``, or the ``pswire.dtypes`` of the same names, which
    it becomes; the shards keep and update full precision).
    Halves the bytes moved; the weights a worker computes with are rounded to it."""
    inline_bytes: int = 256 << 10
    """Pushes and pulls of at most this many bytes to one shard go in a single message
    (PushInline / PullInline) instead of a stream, which costs a round of thread hand-offs
    per call; 0 always streams."""
    bulk: bool = True
    """Send the bytes of larger pushes and pulls on the shard's bulk lanes (plain TCP beside the
    gRPC call, ``pswire.lanes``) when it offers them; False: every byte goes through gRPC."""
    lane_calls: bool = True
    """With ``bulk``: the small calls of the data path (inline pushes and pulls, their
    push-and-pull, row reads) travel whole on a bulk lane, answered by the lane's own thread on
    the shard, instead of as gRPC calls: a tenth of the CPU per call. False: they use gRPC."""
    step_calls: bool = True
    """With ``lane_calls``: an async step whose calls fit in ``inline_bytes`` goes to each shard as
    one ``Step`` (``pswire.step``: the push, the variables and the rows read after it in a fixed
    binary layout, no protobuf), which costs both sides less CPU than ``PushPull``. False: every
    step is made in ``PushPull`` calls."""
    pack_below: int = PACK_BELOW
    """A model of at most this many bytes lives whole on shard 0 (one call per step, not one per
    shard); 0 spreads every model. Part of the placement: every worker of a job must agree, and
    a job restored from a checkpoint that spread such a model (written before models were packed)
    needs 0."""
    security: ClientSecurity | None = None
    """TLS (the shards' CA; a client certificate for mutual TLS) and the bearer token every call
    carries; None: plaintext without a token."""
    on_retry: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    """Called with what is retried (``"push"``, ``"pull"``, ...) each time a call is retried
    after the shard was unreachable, too slow or overloaded (a hook for metrics; it must not
    raise). The channel's own transparent retries of reads are not seen here."""
    on_exchange: Callable[[float, float, float], None] | None = field(default=None, compare=False, repr=False)
    """Called after each ``PSClient`` push, pull and push-and-pull with its seconds split into
    ``(push, pull, wait)`` (see ``PSClient``; a hook for metrics; it must not raise)."""

    def __post_init__(self) -> None:
        if min(self.timeout, self.min_bandwidth, self.connect_timeout, self.wait_timeout, self.retry_timeout) <= 0:
            raise ValueError("timeouts and min_bandwidth must be > 0")
        if not 1024 <= self.chunk_bytes < (4 << 20):
            raise ValueError("chunk_bytes must be between 1 KiB and 4 MiB")
        if self.pack_below < 0:
            raise ValueError("pack_below must be >= 0")
        if not 0 <= self.inline_bytes <= (4 << 20):
            raise ValueError("inline_bytes must be between 0 and 4 MiB")
        if self.wire_dtype is not None:
            try:
                wire = dtype_of(self.wire_dtype)
            except errors.InvalidArgumentError:
                wire = None
            if wire not in WIRE_DTYPES.values():
                raise ValueError(f"wire_dtype must be None, torch.bfloat16 or torch.float16, got {self.wire_dtype}")
            object.__setattr__(self, "wire_dtype", wire)

    def deadline(self, nbytes: int) -> float:
        return self.timeout + nbytes / self.min_bandwidth
