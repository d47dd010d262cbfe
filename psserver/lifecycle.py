"""A job's state leaving and entering a shard: the copies checkpoints are written from (every
N steps, or on demand), a restore from a checkpoint into an empty shard, and the job's end
(with its final checkpoint). A mixin of :class:`psserver.store.ShardStore`, split out to keep
the store readable; it has no state or lock of its own. The checkpoint content itself is
``psserver.snapshot``'s.

Locking: every attribute used here is the store's, guarded by ``ShardStore._lock`` (see its
``__init__`` and ``_reset_job``). The public methods take ``_lock`` themselves; ``_maybe_cut``
and ``_export`` are called with it held.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from threading import Condition, Lock

import numpy as np

from pswire.errors import NotReadyError, PreconditionError
from psserver import snapshot
from psserver.dataqueue import DataQueue
from psserver.job import MAX_COUNT, Registration
from psserver.groups import group_slots
from psserver.optimizers import UpdateRule
from psserver.state import Counters, EndedJob, EndedJobs, ShardState, Slot, SyncClock, Worker
from psserver.tables import RowTable

__all__ = ["RESTORE_ID_GAP", "Lifecycle"]

# The store's log lines keep the store's logger, whichever module writes them: operators and
# tests select them by that name.
log = logging.getLogger("psserver.store")

RESTORE_ID_GAP = 1 << 20
"""Worker ids a restored shard skips: more registrations than this between a checkpoint and the
crash it is restored after would be needed for a fenced worker's id to be given out again."""


class Lifecycle:
    """Checkpoint cuts, export, restore and the job's end, for :class:`~psserver.store.ShardStore`.

    Besides the attributes below (the store's, under its ``_lock``), it calls the store's
    ``_current_clock`` and ``_reset_job``, with ``_lock`` held.
    """

    _lock: Lock
    _changed: Condition
    _now: Callable[[], float]
    _next_worker_id: int
    _ended: EndedJobs | None
    _cut_every: int
    _state: ShardState
    _job: Registration | None
    _rule: UpdateRule | None
    _slots: dict[str, Slot]
    _tables: dict[str, RowTable]
    _workers: dict[str, Worker]
    _by_id: dict[int, Worker]
    _version: int
    _clock_floor: int
    _open_clock: int
    _sync: SyncClock
    _counters: Counters
    _last_cut: int
    _cuts: deque[tuple[int, tuple[int, dict[str, np.ndarray], dict]]]
    _data: DataQueue | None

    # -- checkpoint cuts ---------------------------------------------------------------------

    def _maybe_cut(self) -> None:
        # Caller holds _lock.
        if not self._cut_every or self._state is not ShardState.READY:
            return
        clock = self._current_clock()
        due = clock - clock % self._cut_every
        if due > self._last_cut:
            self._last_cut = due
            if len(self._cuts) == 2:
                dropped, _ = self._cuts.popleft()
                log.warning("checkpoint %d dropped unwritten: the writer is %d steps behind", dropped, clock - dropped)
            self._cuts.append((due, self._export()))

    def checkpoint_every(self, steps: int) -> None:
        """Copy the state for a checkpoint each time the clock reaches a multiple of ``steps``
        (0: never); :meth:`next_cut` hands the copies to the writer."""
        with self._lock:
            self._cut_every = steps
            clock = self._current_clock()
            self._last_cut = max(self._last_cut, clock - clock % steps if steps else 0)

    def next_cut(self, timeout: float) -> tuple[int, tuple[int, dict[str, np.ndarray], dict]] | None:
        """The oldest state copied for a checkpoint, as ``(checkpoint id, export())``, waiting up
        to ``timeout`` seconds for one; None if there is none."""
        with self._changed:
            if not self._cuts:
                self._changed.wait(timeout)
            return self._cuts.popleft() if self._cuts else None

    # -- the job's end -----------------------------------------------------------------------

    def end_job(
        self, final: Callable[[tuple[int, dict[str, np.ndarray], dict]], object] | None = None,
        *, job_fingerprint: str = "",
    ) -> EndedJob | None:
        """End the job this shard holds: every registration of it is void for good (its calls,
        and its sessions registering again, get ``PreconditionError`` saying the job ended,
        never "register again"), and the shard is empty, ready for a new job. Returns None
        when it holds no job.

        ``final`` (a checkpoint writer) is called with :meth:`export` of the final state, if
        the shard is initialised, while the job's calls wait (``NotReadyError``, retryable);
        if it raises, the job goes on unchanged and the error propagates. A non-empty
        ``job_fingerprint`` must be the job's (``PreconditionError`` otherwise)."""
        with self._lock:
            job = self._job
            if job is None:
                return None
            if job_fingerprint and job_fingerprint != job.job_fingerprint:
                raise PreconditionError(
                    f"this shard holds job {job.job_fingerprint!r}, not {job_fingerprint!r}: nothing ended"
                )
            if self._state is ShardState.ENDING:
                raise NotReadyError("this shard's job is already being ended; retry")
            before, self._state = self._state, ShardState.ENDING
            exported = self._export() if final is not None and before is ShardState.READY else None
        try:
            written = final(exported) if exported is not None else None
        except BaseException:
            with self._changed:
                self._state = before
                self._changed.notify_all()
            raise
        with self._changed:
            ended = EndedJob(job.job_fingerprint, self._version, sum(w.live for w in self._workers.values()), written)
            self._ended = EndedJobs(job.job_fingerprint, self._next_worker_id,
                                 frozenset(w.secret for w in self._workers.values() if w.secret), time.time())
            for worker in self._workers.values():  # pulls waiting on the bound see it and return
                worker.live, worker.fenced = False, "its job ended"
            self._reset_job()
            self._changed.notify_all()
        log.info("job %r ended at version %d with %d live worker(s)%s: this shard is empty, ready for a new job",
                 ended.job_fingerprint, ended.version, ended.workers_live,
                 "" if written is None else " after its final checkpoint")
        return ended

    # -- checkpoints -------------------------------------------------------------------------

    def export(self) -> tuple[int, dict[str, np.ndarray], dict]:
        """A consistent copy of the whole shard state for a checkpoint: ``(version, tensors,
        metadata)``. Raises ``NotReadyError`` before initialisation."""
        with self._lock:
            if self._state is not ShardState.READY or self._job is None:
                raise NotReadyError("nothing to checkpoint: the shard is not initialised")
            return self._export()

    def _export(self) -> tuple[int, dict[str, np.ndarray], dict]:
        # Caller holds _lock; the shard is ready (or was, until end_job began).
        assert self._job is not None
        position = snapshot.Position(self._version, self._current_clock(), self._clock_floor, self._open_clock,
                                     self._next_worker_id)
        tensors, metadata = snapshot.encode(self._job, self._slots, self._sync, self._workers, self._counters, position,
                                            self._tables)
        if self._data is not None:
            metadata["data"] = self._data.encode()
        return self._version, tensors, metadata

    def restore(self, tensors: dict[str, np.ndarray], metadata: dict, *, source: str) -> None:
        """Replace this (empty) shard's state with a checkpoint's, after verifying all of it.

        Workers stay known (ids, generations, dedupe marks, progress) but are fenced: their next
        call tells them to re-register, pull the restored weights and carry on. Raises
        ``PreconditionError`` if the shard already holds a job, ``ValueError`` naming what is
        wrong with the checkpoint (and then nothing has changed)."""
        decoded = snapshot.decode(tensors, metadata, now=self._now(), source=source)
        queue = DataQueue.decode(metadata["data"]) if "data" in metadata else None
        position = decoded.position
        with self._lock:
            if self._job is not None:
                raise PreconditionError("this shard already serves a job; restore only into a fresh shard")
            self._job, self._rule = decoded.job, decoded.rule
            self._slots = decoded.slots
            group_slots(self._slots)
            self._tables = decoded.tables
            self._sync = decoded.sync
            self._version = position.version
            self._clock_floor = position.clock  # the clock the shard had reached when it was cut
            self._open_clock = position.open_clock
            self._workers = decoded.workers
            self._by_id = {w.worker_id: w for w in decoded.workers.values()}
            # Ids given out between the checkpoint and the crash are not in it: skip past them, so
            # that no new registration takes the id (and generation) a fenced worker still uses.
            self._next_worker_id = min(position.next_worker_id + RESTORE_ID_GAP, MAX_COUNT)
            self._counters.restore(decoded.counters)
            self._data = queue
            self._state = ShardState.READY
            every = self._cut_every
            self._last_cut = max(self._last_cut, self._clock_floor - self._clock_floor % every if every else 0)
            self._changed.notify_all()
        log.info("restored from %s: version %d, clock %d, %d workers fenced until they re-register",
                 source, self._version, self._clock_floor, len(decoded.workers))
