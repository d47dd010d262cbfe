"""Prometheus file-based service discovery for a cluster's children (``pscluster
--metrics-sd-file``, docs/metrics.md): the file lists every shard's and worker's metrics
address, rewritten atomically when a restarted child reports a new one."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from pswire.files import write_atomically

__all__ = ["MetricsTargets", "sd_groups", "sd_target"]

log = logging.getLogger("pscluster")


def sd_target(address: str) -> str:
    """The scrape target of a metrics endpoint reported as ``HOST:PORT``: an endpoint on every
    interface is scraped on loopback."""
    host, _, port = address.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)
    return f"{host}:{port}"


def sd_groups(shards: Sequence[str], workers: Sequence[str]) -> list[dict]:
    """The target groups of a Prometheus file-based service discovery file (docs/metrics.md)."""
    return [{"targets": list(shards), "labels": {"job": "psserver"}},
            {"targets": list(workers), "labels": {"job": "psworker"}}]


class MetricsTargets:
    """The metrics address every child last reported, and the service discovery file kept from
    them (when asked for one)."""

    def __init__(self, sd_file: Path | None, shards: int, workers: int) -> None:
        """Writes ``sd_file``, listing no targets yet."""
        self.sd_file = sd_file
        self._lock = threading.Lock()  # guards _addresses and the file's writes, from the relay threads
        self._addresses: dict[tuple[str, int], str] = {}
        """(role, index) -> HOST:PORT."""
        self._counts = {"shard": shards, "worker": workers}
        self._closed = False
        if sd_file is not None:
            self._write()

    def reported(self, name: str, role: str, index: int, address: str) -> None:
        target = sd_target(address)
        with self._lock:
            if self._closed or self._addresses.get((role, index)) == target:
                return
            self._counts[role] = max(self._counts[role], index + 1)  # workers added while it runs
            self._addresses[role, index] = target
            log.info("%s metrics on http://%s/metrics", name, target)
            if self.sd_file is not None:
                self._write()

    def _write(self) -> None:
        # Caller holds _lock (or is the constructor).
        assert self.sd_file is not None
        lists = {role: [self._addresses[role, i] for i in range(n) if (role, i) in self._addresses]
                 for role, n in self._counts.items()}
        try:
            write_atomically(self.sd_file, json.dumps(sd_groups(lists["shard"], lists["worker"]), indent=2) + "\n")
        except OSError as exc:
            log.error("cannot write the service discovery file %s: %s", self.sd_file, exc)

    def clear(self) -> None:
        """List no targets any more: the cluster has stopped."""
        with self._lock:
            self._closed = True
            self._addresses.clear()
            if self.sd_file is not None:
                self._write()
                log.info("emptied the metrics service discovery file %s", self.sd_file)

