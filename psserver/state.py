"""The records a shard's store keeps: where its job stands (``ShardState``), a slot per part
(the variable and its optimizer state), a record per worker, the gradients collected for the
open sync clock, the counters that ``psctl status`` shows and checkpoints carry, the jobs it
ended; and what its calls return (a registration, a pull's snapshot, a reading for metrics, an
ended job).

Plain data without locks of their own: ``ShardStore._lock`` guards every one of them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pswire.codec import Part
from pswire.consistency import Consistency
from pswire.errors import PreconditionError
from psserver.consistency import PushAction

if TYPE_CHECKING:
    from psserver.groups import SlotGroup

__all__ = [
    "STALENESS_BUCKETS", "Counters", "EndedJob", "EndedJobs", "PullSnapshot", "PulledPart", "PushResult", "Reading",
    "RegisterResult", "ShardState", "Slot", "SyncClock", "Worker",
]

STALENESS_BUCKETS = 17
"""Staleness histogram: one bucket per value 0..15, the last one for 16 and above."""


class ShardState(enum.Enum):
    EMPTY = "empty"
    INITIALIZING = "initializing"
    READY = "ready"
    ENDING = "ending"
    """``end_job`` is writing the final checkpoint: calls of the job wait (retryably)."""


@dataclass(frozen=True)
class PushResult:
    version: int
    staleness: int
    action: PushAction


@dataclass
class Slot:
    part: Part
    value: np.ndarray
    state: dict[str, np.ndarray]
    version: int = 0
    readers: int = 0
    """Unreleased pull snapshots holding ``value`` itself: an update first replaces it with a
    copy (copy on write), so a pull never copies the variables and never sees half a push."""
    largest: float | None = None
    """An upper bound on the magnitudes of ``value``'s elements, which are finite, as the last
    update's :meth:`~psserver.optimizers.UpdateRule.verify` proved it (so the next need not
    read the variable); None when not known (a fresh or restored slot)."""
    group: "SlotGroup | None" = None
    """The small variables ``value`` and ``state`` are views into (``psserver.groups``)."""

    def writable(self) -> np.ndarray:
        """``value``, once no snapshot holds it (caller holds the store's lock); a grouped
        slot's group is copied whole if a snapshot holds any member, so ``value`` stays a view."""
        if self.group is not None:
            self.group.writable()
        elif self.readers:
            self.value, self.readers = self.value.copy(), 0
        return self.value


@dataclass
class Worker:
    worker_id: int
    name: str
    generation: int
    clock: int = 0
    live: bool = True
    evicted: bool = False
    pushes: int = 0
    heard_at: float = 0.0
    """When the shard last heard from it, on the store's monotonic clock (for its lease)."""
    fenced: str = ""
    """Why this registration is void until the worker re-registers (e.g. the shard restored)."""
    data: dict = field(default_factory=dict)
    """The worker's progress as its last push reported it: step, epoch, position."""
    applied: dict[int, PushResult] = field(default_factory=dict)
    """Sequence -> reply of this generation's recent pushes, oldest first (bounded)."""
    max_sequence: int = 0
    secret: bytes = field(default=b"", repr=False)
    """This registration's session secret (never checkpointed, never shown: a restored worker
    is fenced and registers again for a new one)."""


@dataclass
class SyncClock:
    """The gradients received for the clock a sync shard is collecting. Sums are kept per part,
    and each mean divides by its own part's count: a push may name a subset of the parts."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    received: int = 0
    """Pushes added, the clock-only ones (no parts) included."""
    contributors: set[str] = field(default_factory=set)
    """Names of the workers whose gradient is in the sums: one each per clock."""
    spares: dict[str, np.ndarray] = field(default_factory=dict)
    """The previous clock's sums, reused for this clock's: a fresh buffer of a large variable
    costs a page fault per 4 KiB, more than the copy into it."""
    rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    """Table -> the ``(ids, gradients)`` blocks received for this clock, summed per row when the
    clock is applied and divided by the pushes received (a worker that touched no row of a
    table adds zeros to its mean, as an all-reduce of sparse gradients does)."""

    def add(self, worker: str, parts: Sequence[Part], grads: Sequence[np.ndarray],
            rows: Sequence[tuple[str, np.ndarray, np.ndarray]] = ()) -> None:
        for part, grad in zip(parts, grads):
            total = self.sums.get(part.key)
            if total is None:
                spare = self.spares.pop(part.key, None)
                if spare is None:
                    self.sums[part.key] = grad.copy()
                else:
                    spare[...] = grad
                    self.sums[part.key] = spare
            else:
                np.add(total, grad, out=total)
            self.counts[part.key] = self.counts.get(part.key, 0) + 1
        for table, ids, values in rows:
            self.rows.setdefault(table, []).append((ids, values))
        self.received += 1
        self.contributors.add(worker)

    def means(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(key, mean gradient)`` per part received, each mean computed in place in its sum."""
        for key, total in self.sums.items():
            count = self.counts[key]
            if count > 1:
                np.divide(total, count, out=total, casting="unsafe")
            yield key, total


@dataclass
class Counters:
    pushes_received: int = 0
    pushes_applied: int = 0
    pushes_rejected: int = 0
    """Every push refused, the fenced and non-finite ones below included."""
    pushes_dropped: int = 0
    pushes_scaled: int = 0
    pushes_duplicate: int = 0
    """Pushes handled before (a retry): acknowledged again with their first reply, not re-applied."""
    pushes_fenced: int = 0
    """Pushes refused because their registration is void (evicted, left, replaced, restored)."""
    pushes_nonfinite: int = 0
    """Pushes refused for a non-finite gradient or an update that would have made state non-finite."""
    pulls_served: int = 0
    pull_wait_seconds: float = 0.0
    pull_waits: dict[str, int] = field(default_factory=dict)
    """Pulls that waited on the consistency bound, by the name of the slowest worker they waited
    for ("" when none was behind: a sync clock not yet applied). Only names in the worker table,
    which ``--max-workers`` bounds: a forgotten worker's entry goes with it."""
    workers_evicted: int = 0
    updates_nonfinite: int = 0
    """Updates refused whole because they would have made a variable or its state non-finite."""
    max_staleness: int = 0
    staleness_counts: list[int] = field(default_factory=lambda: [0] * STALENESS_BUCKETS)
    staleness_sum: int = 0
    """The sum of every staleness recorded (the histogram's sum)."""
    staleness_beyond: int = 0
    """Staleness values above the last bucket's (``STALENESS_BUCKETS - 1``), which that bucket
    also counts: what tells 16 from 17 and more."""

    def record_staleness(self, staleness: int) -> None:
        self.max_staleness = max(self.max_staleness, staleness)
        self.staleness_counts[min(staleness, STALENESS_BUCKETS - 1)] += 1
        self.staleness_sum += staleness
        self.staleness_beyond += staleness > STALENESS_BUCKETS - 1

    def checkpointed(self) -> dict:
        """The counters a checkpoint keeps (the others count this process's traffic)."""
        return {"pushes_applied": self.pushes_applied, "pushes_dropped": self.pushes_dropped,
                "pushes_scaled": self.pushes_scaled, "max_staleness": self.max_staleness,
                "staleness_histogram": list(self.staleness_counts), "staleness_sum": self.staleness_sum,
                "staleness_beyond": self.staleness_beyond}

    def restore(self, doc: dict) -> None:
        """Carry on the counters of a checkpoint's :meth:`checkpointed` (those it lacks stay).
        A checkpoint written before the staleness sum was kept gets the sum its histogram
        implies, each of the last bucket's values counted as that bucket's least."""
        self.pushes_applied = int(doc.get("pushes_applied", self.pushes_applied))
        self.pushes_dropped = int(doc.get("pushes_dropped", self.pushes_dropped))
        self.pushes_scaled = int(doc.get("pushes_scaled", self.pushes_scaled))
        self.max_staleness = int(doc.get("max_staleness", self.max_staleness))
        self.staleness_counts = [int(n) for n in doc.get("staleness_histogram", self.staleness_counts)]
        if "staleness_histogram" in doc and "staleness_sum" not in doc:
            self.staleness_sum = sum(i * n for i, n in enumerate(self.staleness_counts))
            self.staleness_beyond = 0
        self.staleness_sum = int(doc.get("staleness_sum", self.staleness_sum))
        self.staleness_beyond = int(doc.get("staleness_beyond", self.staleness_beyond))


@dataclass(frozen=True)
class Reading:
    """The store's counters and gauges at one instant, read under its lock (for metrics)."""

    shard_index: int | None
    num_shards: int | None
    mode: str
    """The job's consistency mode, "" before a job."""
    version: int
    clock: int
    variable_bytes: int
    optimizer_state_bytes: int
    learning_rate: float
    """The rate the shard's next update of its variables runs at: the job's ``lr`` times its
    schedule's factor (``OptimizerConfig.lr_factor``); 0 before a job."""
    workers: dict[str, int]
    """Workers in each state: live, evicted, left, fenced (each counted in one)."""
    evictions: int
    pushes: dict[str, int]
    """Pushes by outcome, each in one (``ShardStore.reading``)."""
    staleness_counts: tuple[int, ...]
    staleness_sum: int
    staleness_beyond: int
    pull_wait_seconds: float
    pull_waits: dict[str, int]
    """Pulls that waited on the bound, by the worker waited for: every worker in the table."""
    data: dict | None = None
    """The data queue's status (``DataQueue.status``), None without dynamic data."""
    table_rows: dict[str, int] = field(default_factory=dict)
    """Rows of the job's tables on this shard, summed over tables: ``held``, ``written``,
    ``pushed`` (row updates received) and ``pulled`` (rows sent)."""


@dataclass(frozen=True)
class RegisterResult:
    worker_id: int
    generation: int
    must_initialize: bool
    version: int
    clock: int
    consistency: Consistency
    lease_seconds: float = 0.0
    data: dict = field(default_factory=dict)
    """This worker's last recorded progress (a restarted worker resumes from it)."""
    session: bytes = b""
    """The registration's secret: every later call of it must carry it."""
    workers_live: int = 1
    """Live registrations of the job on this shard, this one included."""


@dataclass(frozen=True)
class EndedJob:
    """What :meth:`ShardStore.end_job` ended."""

    job_fingerprint: str
    version: int
    workers_live: int
    final: object = None
    """What the ``final`` callback returned (the final checkpoint), None without one."""


@dataclass(frozen=True)
class EndedJobs:
    # The jobs this shard ended: every worker id below ``below`` belonged to one of them, and
    # ``sessions`` are the last one's registrations (a worker of it asking to register again).
    job_fingerprint: str
    below: int
    sessions: frozenset[bytes]
    at_unix: float

    def error(self) -> PreconditionError:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.at_unix))
        return PreconditionError(
            f"the job {self.job_fingerprint or '(unnamed)'!r} was ended on this shard at {when} "
            "(psctl end-job); this worker belonged to it. Start the next job with new workers"
        )


@dataclass(frozen=True)
class PulledPart:
    part: Part
    version: int
    value: np.ndarray | None
    """The part's value as of the snapshot (``None`` when skipped as unchanged): the variable
    itself, which the store leaves untouched until the snapshot is released, or a converted
    copy when the pull asked for a narrower wire dtype."""


@dataclass
class PullSnapshot:
    """A consistent view of the shard for one pull. Its values stay valid, and are not copied,
    until :meth:`release` (an update meanwhile goes to a fresh copy of the variable)."""

    version: int
    clock: int
    parts: list[PulledPart]
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        """Let the store update the variables in place again; idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> "PullSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
