"""When and how a shard writes and restores its part of a checkpoint.

The format and the all-or-nothing rules live in ``psserver.checkpoint``; this module takes the
store's consistent export, picks checkpoint ids that every shard agrees on without talking to
the others, and runs the periodic schedule on its own thread.

Ids: ``psctl checkpoint`` sends one id to every shard. The schedule ``--checkpoint-every 30s``
uses the wall-clock second rounded down to a multiple of 30; ``--checkpoint-every 500`` uses the
shard clock (steps every live worker completed; in sync the applied clock): the store copies its
state the moment its clock reaches a multiple of 500 (in sync an exact cut), and this thread
writes the copy as checkpoint 500, 1000, ... Shards of one job therefore write parts of the same
checkpoints, however far their clocks run ahead of their writers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pswire.errors import InvalidArgumentError, NotReadyError, PreconditionError
from psserver.checkpoint import CheckpointError, CheckpointStore, JobEndedError, ShardPart
from psserver.store import ShardStore

__all__ = ["MAX_ID_AHEAD", "Checkpointer", "Restored", "Schedule", "check_id", "parse_schedule"]

MAX_ID_AHEAD = 300
"""How far an on-demand checkpoint id may run ahead of the shard's wall clock in seconds (ids are
seconds since the epoch by default): LATEST never moves back, and periodic checkpoints skip ids
at or below the last one, so an id far in the future would pin LATEST and stop the schedule."""


def check_id(checkpoint_id: int, last_id: int, now: float) -> None:
    """Raises unless an on-demand ``checkpoint_id`` is above ``last_id`` (ids only increase) and
    at most ``MAX_ID_AHEAD`` beyond ``max(last_id, now)``: ``InvalidArgumentError`` for an id
    out of range, ``PreconditionError`` for one not above the last."""
    limit = max(last_id, int(now)) + MAX_ID_AHEAD
    if not 1 <= checkpoint_id <= limit:
        raise InvalidArgumentError(
            f"checkpoint id {checkpoint_id} is out of range: ids are 1..{limit} on this shard now (at most "
            f"{MAX_ID_AHEAD}s ahead of its clock in seconds since the epoch, or of its last checkpoint)"
        )
    if checkpoint_id <= last_id:
        raise PreconditionError(
            f"checkpoint id {checkpoint_id} is not above this shard's last checkpoint {last_id}: ids only increase"
        )

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What a start-up restore did (``Checkpointer.restore``)."""

    checkpoint_id: int | None
    """The checkpoint loaded; None: the shard starts empty."""
    reason: str
    """One line for the log: "restored checkpoint N from DIR", "no checkpoint in DIR: starting empty", ..."""
    level: int = logging.INFO
    """Its logging level: WARNING where state may have been lost (only unfinished checkpoints)."""


@dataclass(frozen=True)
class Schedule:
    every: int
    unit: str  # "seconds" or "steps"

    def due_id(self, now: float) -> int:
        """The id a seconds schedule is due to write at wall-clock ``now`` (steps schedules are
        cut by the store, see ``ShardStore.checkpoint_every``)."""
        return int(now) - int(now) % self.every


def parse_schedule(text: str) -> Schedule | None:
    """``""`` -> None, ``"30s"`` -> every 30 seconds, ``"500"`` or ``"500steps"`` -> every 500
    steps. Raises ``ValueError`` for anything else."""
    text = text.strip().lower()
    if not text:
        return None
    unit = "seconds" if text.endswith("s") and not text.endswith("steps") else "steps"
    number = text.removesuffix("steps").removesuffix("s")
    if not number.isdigit() or int(number) < 1:
        raise ValueError(f"--checkpoint-every must look like 30s (seconds) or 500 (steps), got {text!r}")
    return Schedule(int(number), unit)


class Checkpointer:
    """Writes this shard's checkpoint parts; restores the newest complete one at start-up.

    ``_lock`` serialises writes (the periodic thread and on-demand requests); only writers
    change ``last_id``, ``last_path``, ``failures`` and ``last_success_unix``, which metrics
    read without it (a scrape must not wait for a write). ``on_written`` (metrics) is called
    with the seconds each successful write took.
    """

    def __init__(
        self,
        store: ShardStore,
        directory: str,
        *,
        keep: int = 3,
        schedule: Schedule | None = None,
        now: Callable[[], float] = time.time,
        failpoint: Callable[[str], None] | None = None,
        on_written: Callable[[float], None] | None = None,
    ) -> None:
        self._store = store
        self._files = CheckpointStore(directory, keep=keep, failpoint=failpoint)
        self.directory = directory
        self._schedule = schedule
        self._now = now
        self._lock = threading.Lock()
        self.last_id = 0
        self.last_path = ""
        self.failures = 0
        """Writes that failed (the directory unwritable, a part that could not be saved)."""
        self.last_success_unix = 0.0
        """Wall-clock time the last write succeeded; 0 before any."""
        self._on_written = on_written
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def checkpoint(self, checkpoint_id: int) -> tuple[str, int, bool]:
        """Write this shard's part of checkpoint ``checkpoint_id``; returns ``(path, version,
        complete)``. Raises ``NotReadyError`` before initialisation, ``InvalidArgumentError`` or
        ``PreconditionError`` for an id :func:`check_id` refuses, ``CheckpointError``, and
        ``OSError`` when the directory cannot be written."""
        with self._lock:
            check_id(checkpoint_id, self.last_id, self._now())
            return self._write(checkpoint_id, self._store.export())

    def write(self, checkpoint_id: int, exported: tuple[int, dict, dict]) -> tuple[str, int, bool]:
        """:meth:`checkpoint` of a state already exported (``ShardStore.export``), e.g. a job's
        final state while ``end_job`` holds its calls."""
        with self._lock:
            check_id(checkpoint_id, self.last_id, self._now())
            return self._write(checkpoint_id, exported)

    def _write(self, checkpoint_id: int, exported: tuple[int, dict, dict]) -> tuple[str, int, bool]:
        # Caller holds _lock.
        version, tensors, metadata = exported
        job = metadata["job"]
        started = time.monotonic()
        try:
            path = self._files.write(
                checkpoint_id, job["shard_index"], job["num_shards"], ShardPart(tensors, metadata)
            )
        except Exception:
            self.failures += 1
            raise
        seconds = time.monotonic() - started
        self.last_id, self.last_path, self.last_success_unix = checkpoint_id, str(path), self._now()
        if self._on_written is not None:
            self._on_written(seconds)
        complete = self._files.is_complete(checkpoint_id, job["num_shards"])
        log.info("checkpoint %d written to %s in %.2fs (version %d%s)", checkpoint_id, path,
                 seconds, version, ", complete" if complete else "")
        return str(path), version, complete

    def mark_ended(self, job: str) -> int:
        """After ``end_job``: no restore from this directory brings the ended job back
        (``CheckpointStore.mark_ended``). Returns the newest checkpoint id it covers."""
        with self._lock:
            after = self._files.mark_ended(job)
        if self._schedule is not None and self._schedule.unit == "steps":
            log.warning("checkpoints every %d steps are numbered by the job's clock: the next job's stay below "
                        "checkpoint %d of the ended one and never become LATEST here; give the next job a new "
                        "--checkpoint-dir, or checkpoint on a seconds schedule", self._schedule.every, after)
        return after

    @property
    def schedule_seconds(self) -> float:
        """The period of a seconds schedule (``--checkpoint-every 30s``); 0 for none or steps."""
        schedule = self._schedule
        return float(schedule.every) if schedule is not None and schedule.unit == "seconds" else 0.0

    def restore(self, shard_index: int, num_shards: int, *, required: bool = True) -> Restored:
        """Load this shard's part of the newest complete checkpoint into the (fresh) store; with
        ``required`` False (``--restore auto``), leave the store empty when there is nothing to
        restore: no directory, no checkpoint, only unfinished ones, or only an ended job's.
        Returns what was done and why. Raises ``CheckpointError`` naming the problem when
        checkpoints exist but none is usable (damaged, made for another shard count, or the
        directory unreadable), whatever ``required``; and when ``required`` and there is nothing
        to restore."""
        where = self.directory
        try:
            found = self._files.load(shard_index, num_shards)
            ended = self._files.ended() if found is None else None
            unfinished = self._files.unfinished(num_shards) if found is None else []
        except JobEndedError as exc:
            if required:
                raise
            self._warn_steps_after_end(exc.after)
            return Restored(None, f"the checkpoints in {where} (up to {exc.after}) belong to job {exc.job!r}, ended "
                                  "by psctl end-job: starting empty for a new job")
        except OSError as exc:
            raise CheckpointError(f"cannot read the checkpoints in {where}: {exc}") from exc
        if found is not None:
            checkpoint_id, part = found
            try:
                self._store.restore(part.tensors, part.metadata, source=f"checkpoint {checkpoint_id}")
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {checkpoint_id} in {where}: {exc}") from exc
            self.last_id = checkpoint_id
            return Restored(checkpoint_id, f"restored checkpoint {checkpoint_id} from {where}")
        level = logging.INFO
        if not os.path.isdir(where):
            why = f"no checkpoint in {where}: it does not exist (yet)"
        elif unfinished:
            why, level = (f"no complete checkpoint in {where}: skipped unfinished checkpoint(s) "
                          f"{', '.join(map(str, unfinished))} (their writers stopped before every part was written)",
                          logging.WARNING)
        else:
            why = f"no checkpoint in {where}"
        if ended is not None:
            why += f" (the older ones belong to job {ended['job']!r}, ended by psctl end-job)"
        if required:
            raise CheckpointError(f"{why}: nothing to restore (--restore auto would start empty)")
        if ended is not None:
            self._warn_steps_after_end(ended["after"])
        return Restored(None, f"{why}: starting empty", level)

    def _warn_steps_after_end(self, after: int) -> None:
        if self._schedule is not None and self._schedule.unit == "steps":
            log.warning("checkpoints every %d steps are numbered by the job's clock: this job's stay below checkpoint "
                        "%d of the ended job and are never restored from %s; give this job a new --checkpoint-dir, "
                        "or checkpoint on a seconds schedule", self._schedule.every, after, self.directory)

    def start(self) -> None:
        if self._schedule is None:
            return
        if self._schedule.unit == "steps":
            # The store copies its state the moment its clock reaches each multiple, so every
            # shard's part of a checkpoint is the same cut even when the writer runs late.
            self._store.checkpoint_every(self._schedule.every)
        self._thread = threading.Thread(target=self._run, name="psserver-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._schedule is not None
        while not self._stopped.is_set():
            try:
                if self._schedule.unit == "steps":
                    cut = self._store.next_cut(timeout=0.5)
                    if cut is not None:
                        with self._lock:
                            self._write(*cut)
                    continue
                if self._stopped.wait(timeout=0.5):
                    break
                due = self._schedule.due_id(self._now())
                if due > self.last_id:
                    self.checkpoint(due)
            except NotReadyError:
                continue
            except Exception:  # keep checkpointing on later rounds; the error is logged
                log.exception("periodic checkpoint failed")

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
