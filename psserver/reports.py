"""Plain-data views of a shard, each read at once under the store's lock: ``status`` for
``psctl status`` and ``reading`` for metrics. A mixin of :class:`psserver.store.ShardStore`,
split out to keep the store readable; it has no state or lock of its own.

Locking: both methods take ``ShardStore._lock`` themselves; every attribute they read is the
store's, guarded by it (see its ``__init__`` and ``_reset_job``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from threading import Lock

from psserver.dataqueue import DataQueue
from psserver.job import Registration
from psserver.state import Counters, Reading, ShardState, Slot, Worker
from psserver.tables import RowTable

__all__ = ["Reports"]


class Reports:
    """``status`` and ``reading`` for :class:`~psserver.store.ShardStore`.

    Besides the attributes below (the store's, under its ``_lock``), it calls the store's
    ``_current_clock`` with ``_lock`` held.
    """

    _lock: Lock
    _now: Callable[[], float]
    _started: float
    _lease_timeout: float | None
    _state: ShardState
    _job: Registration | None
    _slots: dict[str, Slot]
    _tables: dict[str, RowTable]
    _workers: dict[str, Worker]
    _version: int
    _counters: Counters
    _waiting_pulls: int
    _data: DataQueue | None

    def status(self) -> dict:
        """Plain-data view of the shard for ``psctl status``."""
        with self._lock:
            job = self._job
            now, wall = self._now(), time.time()
            return {
                "state": self._state.value,
                "shard_index": job.shard_index if job else -1,
                "num_shards": job.num_shards if job else 0,
                "placement_digest": job.placement_digest if job else "",
                "job_fingerprint": job.job_fingerprint if job else "",
                "optimizer": job.optimizer if job else None,
                "consistency": job.consistency if job else None,
                "parts": list(job.parts) if job else [],
                "version": self._version,
                "clock": self._current_clock(),
                "bytes_held": sum(p.nbytes for p in job.parts) if job else 0,
                "optimizer_state_bytes": sum(
                    t.nbytes for s in self._slots.values() for t in s.state.values()
                ),
                "workers": [
                    {"worker_id": w.worker_id, "worker_name": w.name, "generation": w.generation,
                     "pushes": w.pushes, "last_seen_unix": wall - (now - w.heard_at), "clock": w.clock, "live": w.live,
                     "evicted": w.evicted}
                    for w in self._workers.values()
                ],
                "pushes_received": self._counters.pushes_received,
                "pushes_applied": self._counters.pushes_applied,
                "pushes_rejected": self._counters.pushes_rejected,
                "pushes_dropped": self._counters.pushes_dropped,
                "pushes_scaled": self._counters.pushes_scaled,
                "pulls_served": self._counters.pulls_served,
                "pulls_waiting": self._waiting_pulls,
                "pull_wait_seconds": self._counters.pull_wait_seconds,
                "workers_evicted": self._counters.workers_evicted,
                "updates_nonfinite": self._counters.updates_nonfinite,
                "lease_seconds": self._lease_timeout or 0.0,
                "max_staleness": self._counters.max_staleness,
                "staleness_histogram": list(self._counters.staleness_counts),
                "uptime_seconds": now - self._started,
                "data": self._data.status() if self._data is not None else None,
                "tables": [
                    {"spec": t.spec, "rows_held": t.rows, "rows_written": t.rows_written, "rows_pushed": t.rows_pushed,
                     "rows_pulled": t.rows_pulled, "step": t.step, "bytes_resident": t.resident_bytes}
                    for t in self._tables.values()
                ],
            }

    def reading(self) -> Reading:
        """Counters and gauges for metrics, read at once. Pushes by outcome count each push
        once: ``applied`` at the full learning rate (in sync: each clock's one update, the mean
        of its gradients), ``scaled`` (applied at learning rate / staleness), ``dropped``,
        ``duplicate``, ``fenced``, ``nonfinite`` and ``rejected`` (every other refusal)."""
        with self._lock:
            job = self._job
            c = self._counters
            states = dict.fromkeys(("live", "evicted", "left", "fenced"), 0)
            for w in self._workers.values():
                states["fenced" if w.fenced else "evicted" if w.evicted else "live" if w.live else "left"] += 1
            return Reading(
                shard_index=job.shard_index if job else None,
                num_shards=job.num_shards if job else None,
                mode=job.consistency.mode.value if job else "",
                version=self._version,
                clock=self._current_clock(),
                variable_bytes=sum(p.nbytes for p in job.parts) if job else 0,
                optimizer_state_bytes=sum(t.nbytes for s in self._slots.values() for t in s.state.values()),
                learning_rate=job.optimizer.lr * job.optimizer.lr_factor(self._version + 1) if job else 0.0,
                workers=states,
                evictions=c.workers_evicted,
                pushes={
                    "applied": c.pushes_applied - c.pushes_scaled, "scaled": c.pushes_scaled,
                    "dropped": c.pushes_dropped, "duplicate": c.pushes_duplicate, "fenced": c.pushes_fenced,
                    "nonfinite": c.pushes_nonfinite,
                    "rejected": c.pushes_rejected - c.pushes_fenced - c.pushes_nonfinite,
                },
                staleness_counts=tuple(c.staleness_counts),
                staleness_sum=c.staleness_sum,
                staleness_beyond=c.staleness_beyond,
                pull_wait_seconds=c.pull_wait_seconds,
                # Every known worker from the start (0 until a pull waits for it), so that a rate
                # sees the first wait.
                pull_waits={**dict.fromkeys(self._workers, 0), **c.pull_waits},
                data=self._data.status() if self._data is not None else None,
                table_rows={
                    "held": sum(t.rows for t in self._tables.values()),
                    "written": sum(t.rows_written for t in self._tables.values()),
                    "pushed": sum(t.rows_pushed for t in self._tables.values()),
                    "pulled": sum(t.rows_pulled for t in self._tables.values()),
                },
            )
