"""A shard's reads: a pull's consistent snapshot of the variables (and its wait on the ssp/sync
bound), reads of table rows, and the waits both share (readiness, the bound, the cap on waiting
pulls). A mixin of :class:`psserver.store.ShardStore`, split out to keep the store readable; it
has no state or lock of its own.

Locking: every attribute used here is the store's, guarded by ``ShardStore._lock`` (see its
``__init__`` and ``_reset_job``). The public methods take ``_lock`` (or ``_changed``, the
condition on it) themselves; the underscored helpers say when their caller holds it.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping, Sequence
from threading import Condition, Lock

import numpy as np

from pswire.codec import on_wire
from pswire.dtypes import DType
from pswire.errors import DeadlineError, InvalidArgumentError, NotReadyError
from psserver import consistency as cons
from psserver.consistency import Mode
from psserver.job import Registration, check_count
from psserver.state import Counters, PulledPart, PullSnapshot, ShardState, Slot, Worker
from psserver.tables import RowTable

__all__ = ["Reads"]

# The store's log lines keep the store's logger, whichever module writes them: operators and
# tests select them by that name.
log = logging.getLogger("psserver.store")


class Reads:
    """Pulls, row reads and their waits, for :class:`~psserver.store.ShardStore`.

    Besides the attributes below (the store's, under its ``_lock``), it calls the store's
    ``_current_clock``, ``_member_clocks``, ``_check_worker`` and ``_unknown`` with ``_lock``
    held.
    """

    _lock: Lock
    _changed: Condition
    _now: Callable[[], float]
    _max_waiting_pulls: int
    data_slots_scarce: Callable[[], bool] | None
    _waiting_pulls: int
    _state: ShardState
    _job: Registration | None
    _slots: dict[str, Slot]
    _tables: dict[str, RowTable]
    _by_id: dict[int, Worker]
    _initializer: int | None
    _version: int
    _open_clock: int
    _counters: Counters

    def _wait(
        self, ready: Callable[[], bool], deadline: float, on_timeout: Callable[[], Exception],
        waiting_for: str | None = None,
    ) -> None:
        # Caller holds _lock (through _changed). Waiting pulls are capped; see __init__.
        # ``waiting_for``: the worker a wait on the consistency bound waits for (counted).
        if ready():
            return
        if self._waiting_pulls >= self._max_waiting_pulls:
            raise NotReadyError(f"{self._waiting_pulls} pulls already waiting on this shard; retry")
        if self.data_slots_scarce is not None and self.data_slots_scarce():
            raise NotReadyError("too few data call slots are free on this shard to wait in one (they are kept for "
                                "the pushes and the Initialize that end waits); retry")
        if waiting_for is not None:
            waits = self._counters.pull_waits
            waits[waiting_for] = waits.get(waiting_for, 0) + 1
        self._waiting_pulls += 1
        started = self._now()
        try:
            while not ready():
                remaining = deadline - self._now()
                if remaining <= 0 or not self._changed.wait(timeout=remaining):
                    if not ready():
                        raise on_timeout()
        finally:
            self._waiting_pulls -= 1
            self._counters.pull_wait_seconds += self._now() - started

    def wait_ready(self, timeout: float, *, worker_id: int = 0) -> None:
        """Block until initialised; raises ``NotReadyError`` after ``timeout`` seconds, and at
        once the error of a ``worker_id`` the shard stops knowing meanwhile (its job ended)."""
        with self._changed:
            self._wait(
                lambda: self._state is ShardState.READY or bool(worker_id) and worker_id not in self._by_id,
                self._now() + timeout,
                lambda: NotReadyError(
                    f"shard not initialised after {timeout:.1f}s"
                    + (f" (waiting for worker id {self._initializer})" if self._initializer else "")
                ),
            )

    def pull(
        self,
        known_versions: Mapping[str, int],
        *,
        timeout: float,
        worker_id: int = 0,
        generation: int = 0,
        clock: int = -1,
        wire_dtype: DType | None = None,
        session: bytes | None = None,
    ) -> PullSnapshot:
        """A consistent snapshot of every part; parts whose version equals
        ``known_versions[key]`` are skipped. The snapshot holds the variables themselves, without
        a copy, until it is released (release it once its bytes are sent). ``wire_dtype``
        (float16/bfloat16): floating-point parts come as copies converted to it.

        Waits up to ``timeout`` for initialisation and, for a registered worker reading at
        ``clock >= 0`` in ssp/sync, until the consistency bound lets it read. Such a training
        pull must come from the worker's current registration: a worker fenced off (evicted, or
        the shard restored) gets ``FencedError`` rather than waiting on a clock this shard may
        never reach. Raises ``NotReadyError`` (not initialised, or too many pulls waiting) or
        ``DeadlineError`` naming the worker it waited for.
        """
        deadline = self._admit_reader(worker_id, generation, session, clock, timeout)
        with self._changed:
            self._await_bound(worker_id, generation, session, clock, deadline)
            out, held = [], []
            for slot in self._slots.values():
                if known_versions.get(slot.part.key) == slot.version:
                    out.append(PulledPart(slot.part, slot.version, None))
                elif on_wire(slot.part, wire_dtype) is not slot.part:
                    out.append(PulledPart(slot.part, slot.version, slot.value.astype(wire_dtype.numpy)))
                else:
                    slot.readers += 1
                    held.append((slot, slot.value))
                    out.append(PulledPart(slot.part, slot.version, slot.value))
            self._counters.pulls_served += 1
            return PullSnapshot(self._version, self._current_clock(), out, lambda: self._release(held))

    def pull_rows(
        self,
        requests: Sequence[tuple[str, np.ndarray]],
        *,
        timeout: float,
        worker_id: int = 0,
        generation: int = 0,
        clock: int = -1,
        session: bytes | None = None,
        checked: list | None = None,
    ) -> tuple[int, int, list[tuple[str, np.ndarray, np.ndarray]]]:
        """Rows of the job's tables: ``(version, clock, [(table, ids, values)])`` for each
        ``(table, ids)`` asked (copies; initial values for rows never written). Waits as
        :meth:`pull` does, and raises as it does, plus ``InvalidArgumentError`` for an unknown
        table or an id outside the table or on another shard (nothing is read then).
        ``checked``: what :meth:`check_rows` returned for the same ``requests``, whose ids
        are then not located again (unless the job's tables changed meanwhile)."""
        deadline = self._admit_reader(worker_id, generation, session, clock, timeout)
        with self._changed:
            self._await_bound(worker_id, generation, session, clock, deadline)
            if checked is None or any(self._tables.get(name) is not table for name, table, _, _ in checked):
                checked = self._locate_rows(requests)
            out = [(name, ids, table.read(ids, index)) for name, table, ids, index in checked]
            self._counters.pulls_served += 1
            return self._version, self._current_clock(), out

    def check_rows(self, requests: Sequence[tuple[str, np.ndarray]]) -> list:
        """Raise what :meth:`pull_rows` would for ``requests`` (an unknown table, an id outside
        its table or on another shard), reading nothing: a read that rides on a push is checked
        before the push is applied. Returns what ``pull_rows`` takes as ``checked``."""
        with self._lock:
            return self._locate_rows(requests)

    def _locate_rows(self, requests: Sequence[tuple[str, np.ndarray]]) -> list:
        # Caller holds _lock. Every request is checked before any is read.
        located = []
        for name, ids in requests:
            table = self._table(name)
            located.append((name, table, ids, table.locate(ids, unique=False)))
        return located

    def _table(self, name: str):
        # Caller holds _lock.
        table = self._tables.get(name)
        if table is None:
            known = ", ".join(repr(t) for t in self._tables) or "none"
            raise InvalidArgumentError(f"unknown table {name!r} (the job's tables: {known})")
        return table

    def rows_bytes(self, requests: Sequence[tuple[str, np.ndarray]]) -> int:
        """Bytes of values a read of ``requests`` would answer with (0 for unknown tables, which
        the read itself refuses)."""
        with self._lock:
            return sum(ids.size * self._tables[name].spec.row_bytes for name, ids in requests if name in self._tables)

    def _admit_reader(self, worker_id: int, generation: int, session: bytes | None, clock: int,
                      timeout: float) -> float:
        # The checks of a read before it waits for the shard to be ready, which it then does;
        # returns the read's deadline.
        check_count("clock", max(clock, 0))
        deadline = self._now() + timeout
        with self._lock:
            if worker_id and worker_id not in self._by_id:
                # The shard lost its state (restarted without a checkpoint) or its job ended:
                # waiting would not help.
                raise self._unknown(worker_id)
            if worker_id and session is not None:
                worker = self._by_id[worker_id]
                if not (worker.secret and hmac.compare_digest(session, worker.secret)):
                    # A read as a worker is that worker's: only its session may make it.
                    self._check_worker(worker_id, generation, session)
        self.wait_ready(timeout, worker_id=worker_id)
        return deadline

    def _await_bound(self, worker_id: int, generation: int, session: bytes | None, clock: int,
                     deadline: float) -> None:
        # Caller holds _lock (through _changed). A training read (a worker's, at clock >= 0)
        # waits until the consistency bound lets it read.
        if worker_id and worker_id not in self._by_id:
            raise self._unknown(worker_id)
        job = self._job
        assert job is not None
        if clock >= 0 and worker_id:
            reader = self._check_worker(worker_id, generation, session)
            if job.consistency.mode is not Mode.ASYNC:
                self._wait_for_bound(job.consistency, reader, clock, deadline)
                self._check_worker(worker_id, generation, session)  # it may have been evicted meanwhile

    def _release(self, held: list[tuple[Slot, np.ndarray]]) -> None:
        with self._lock:
            for slot, value in held:
                if slot.value is value:  # else an update already moved to a copy
                    slot.readers -= 1

    def _wait_for_bound(self, consistency: cons.Consistency, reader: Worker, clock: int, deadline: float) -> None:
        # Caller holds _lock. Also ends when the reader is fenced off or leaves while it waits.
        name, generation = reader.name, reader.generation

        def decide() -> cons.PullDecision:
            return cons.decide_pull(consistency, clock, self._member_clocks(), self._open_clock)

        def void() -> bool:
            return reader.generation != generation or bool(reader.fenced) or reader.evicted or not reader.live

        first = decide()
        if first.proceed:
            return
        log.debug("pull of %s at clock %d waits for %s: %s", name, clock, first.waiting_for, first.reason)

        def timed_out() -> Exception:
            last = decide()
            return DeadlineError(f"pull of {name} at clock {clock} timed out waiting for {last.waiting_for}: {last.reason}")

        self._wait(lambda: void() or decide().proceed, deadline, timed_out,
                   waiting_for=first.waiting_for or "")
