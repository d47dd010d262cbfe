"""``AdminClient``: every shard of a job at once, for the calls that move no tensors (status,
checkpoint, end-job, the health check), through one ``psworker.channel.ShardChannel`` per shard.

It needs neither torch nor a registration, so that ``psctl`` runs where psserver does (an image
without torch); ``psworker.client.PSClient`` extends it with a worker's registration and tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import TypeVar

from pswire.v1 import ps_pb2
from psworker.channel import ShardChannel, ShardHealth
from psworker.options import ClientOptions, parse_addresses

__all__ = ["AdminClient"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")
_Self = TypeVar("_Self", bound="AdminClient")

_HANG_GUARD = 3600.0
"""Seconds past ``connect_timeout`` a fan-out waits for its calls before it gives up on them:
each call carries its own gRPC deadline, so this only guards against a hang."""


class AdminClient:
    """An operator's connection to every shard of a job.

    Calls fan out to all shards concurrently and return when every shard has answered, in
    shard order; an error from any shard is raised (the first one, as a ``pswire.errors``
    error). Raises ``ValueError`` for malformed addresses."""

    _shard_type: type[ShardChannel] = ShardChannel
    """What each shard is reached through (``PSClient``: a ``ShardClient``, which moves tensors)."""

    def __init__(self, addresses: str | Sequence[str], options: ClientOptions | None = None) -> None:
        self.addresses = parse_addresses(addresses)
        self.options = options or ClientOptions()
        self._clients = [self._shard_type(a, self.options) for a in self.addresses]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(self._clients), thread_name_prefix="psclient")

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    def _fan_out(self, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        first, *rest = items
        # The first call runs on this thread: a hand-off to the pool costs about as much as a
        # small call, and with one shard there is nothing to overlap.
        futs = [self._pool.submit(fn, item) for item in rest]
        try:
            results = [fn(first)]
        finally:
            # Every call ends before an error is raised, so none is left running (a retry, say)
            # under the caller's next step.
            if futs:
                futures.wait(futs, timeout=self.options.connect_timeout + _HANG_GUARD)
        return results + [f.result(timeout=0) for f in futs]

    @classmethod
    def connected(cls: type[_Self], addresses: str | Sequence[str], options: ClientOptions | None = None) -> _Self:
        """A client whose every shard answered within ``options.connect_timeout`` (closed again
        if one did not: ``wait_connected`` raises)."""
        client = cls(addresses, options)
        try:
            client.wait_connected()
        except BaseException:
            client.close()
            raise
        return client

    def wait_connected(self) -> None:
        """Wait up to ``options.connect_timeout`` for every shard to accept a connection, saying
        at once what it waits for. Raises ``UnavailableError`` naming a shard that did not, and why."""
        timeout = self.options.connect_timeout
        if len(self._clients) == 1:
            log.info("connecting to shard %s (waiting up to %.0fs for it to answer)", self.addresses[0], timeout)
        else:
            log.info("connecting to %d shards, %s (waiting up to %.0fs for each to answer)", len(self._clients),
                     ", ".join(self.addresses), timeout)
        self._fan_out(lambda c: c.wait_connected(timeout), self._clients)

    def health(self, timeout: float) -> list[ShardHealth]:
        """Each shard's answer to one standard health check within ``timeout`` seconds, checked
        side by side; never retried, no token needed. Raises nothing for a shard that cannot be
        reached: its report says why."""
        return self._fan_out(lambda c: c.health(timeout), self._clients)

    def status(self) -> list[ps_pb2.StatusResponse]:
        return self._fan_out(lambda c: c.status(), self._clients)

    def checkpoint(self, checkpoint_id: int) -> list[ps_pb2.CheckpointResponse]:
        """Ask every shard to write its part of checkpoint ``checkpoint_id`` (admin)."""
        return self._fan_out(
            lambda c: c.checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=checkpoint_id)),
            self._clients,
        )

    def end_job(self, checkpoint_id: int = 0, job_fingerprint: str = "") -> list[ps_pb2.EndJobResponse]:
        """End the job on every shard (``psctl end-job``), each after writing its part of
        checkpoint ``checkpoint_id`` when non-zero; replies in shard order."""
        request = ps_pb2.EndJobRequest(checkpoint_id=checkpoint_id, job_fingerprint=job_fingerprint)
        return self._fan_out(lambda c: c.end_job(request), self._clients)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._clients:
            c.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
