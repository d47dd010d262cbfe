"""One shard's state: its slice of the model's variables, their optimizer state, versions,
workers and clocks. Pure Python and numpy, no gRPC: the servicer translates requests into these
calls, and the consistency decisions come from ``psserver.consistency``.

The store is one class over one lock; its concepts live in modules of their own, as mixins that
share its state and its lock: ``psserver.membership`` (registration, sessions, leases,
leaving), ``psserver.lifecycle`` (checkpoint copies, restore, the job's end),
``psserver.reports`` (status and metrics readings) and ``psserver.reads`` (pulls, reads of table
rows, and their waits). This module holds the state itself (the embedding tables' rows in
``psserver.tables``), the updates (initialisation, pushes of variables and rows, sync clocks)
and the job's dynamic data.

Every method either completes or raises a ``pswire.errors`` error with the state unchanged.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pswire.codec import Part, dtype_name
from pswire.data import DataPlan, DataTask
from pswire.tables import coalesce
from pswire.errors import FencedError, InvalidArgumentError, NotReadyError, PreconditionError
from pswire.wire import rows_from_proto
from psserver import consistency as cons
from psserver.consistency import Mode, PushAction
from psserver.dataqueue import DataQueue
from psserver.job import Registration, check_count, check_finite
from psserver.lifecycle import RESTORE_ID_GAP, Lifecycle
from psserver.membership import Membership
from psserver.groups import SlotGroup, group_slots
from psserver.optimizers import UpdateRule
from psserver.reads import Reads
from psserver.reports import Reports
from psserver.screen import NonFiniteError, gradient_bounds
from psserver.state import (
    Counters, EndedJob, EndedJobs, PulledPart, PullSnapshot, PushResult, Reading, RegisterResult, ShardState, Slot,
    SyncClock, Worker,
)
from psserver.tables import NonFiniteRows, RowTable, RowUpdate

__all__ = [
    "RESTORE_ID_GAP", "EndedJob", "NonFiniteError", "PullSnapshot", "PulledPart", "PushResult", "Reading",
    "RegisterResult", "Registration", "ShardState", "ShardStore",
]

log = logging.getLogger(__name__)


@dataclass
class _Screened:
    """One update a push makes, checked and ready to apply: one slot, or a group's slots as one."""

    slots: list[Slot]
    grad: np.ndarray
    state: dict[str, np.ndarray]
    bound: float | None
    """The updated variable's magnitude bound that verify proved (None: not known)."""
    group: SlotGroup | None = None


class ShardStore(Membership, Lifecycle, Reports, Reads):
    """The variables and optimizer state of one shard.

    Locking: ``_lock`` guards every attribute assigned after it in ``__init__`` (and in
    ``_reset_job``); ``_changed`` is a condition on the same lock, notified whenever readiness,
    clocks or membership change. It is the one lock of the store and of its mixins
    (``Membership``, ``Lifecycle``, ``Reports``, ``Reads``), which have none of their own: each public
    method takes it, and each underscored helper that says "caller holds _lock" runs only under
    it. The lock is held while an update is applied and while a pull takes its snapshot (it
    holds the variables themselves; an update meanwhile goes to a copy), never while waiting on
    the network.
    """

    def __init__(
        self,
        *,
        init_timeout: float = 60.0,
        max_waiting_pulls: int = 8,
        dedupe_window: int = 64,
        lease_timeout: float | None = None,
        max_model_bytes: int = 64 << 30,
        max_workers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._init_timeout = init_timeout
        self._max_model_bytes = max_model_bytes
        self._max_workers = max_workers
        self._lease_timeout = lease_timeout
        # A waiting pull parks a handler thread; capping them leaves threads free for the pushes
        # and the Initialize that release them (pulls beyond the cap are refused as retryable).
        self._max_waiting_pulls = max_waiting_pulls
        self.data_slots_scarce: Callable[[], bool] | None = None
        """Set by the server to its admission control's: a pull does not start waiting while it
        returns True (``psserver.auth.Admission.data_slots_scarce``)."""
        self._dedupe_window = dedupe_window
        self._now = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Worker ids only grow, across jobs too: an ended job's ids are never given out again.
        self._next_worker_id = 1
        self._ended: EndedJobs | None = None
        self._waiting_pulls = 0
        self._cut_every = 0
        self._reset_job()

    def _reset_job(self) -> None:
        # Caller holds _lock (or is __init__): everything that belongs to one job, as before any.
        self._state = ShardState.EMPTY
        self._job: Registration | None = None
        self._rule: UpdateRule | None = None
        self._slots: dict[str, Slot] = {}
        self._tables: dict[str, RowTable] = {}  # the job's embedding tables: this shard's rows of each
        self._initializer: int | None = None
        self._init_deadline = 0.0
        self._workers: dict[str, Worker] = {}
        self._by_id: dict[int, Worker] = {}  # the same workers, keyed by id for every push
        self._version = 0
        self._clock_floor = 0
        # Sync mode: the clock being collected, and the gradients received for it.
        self._open_clock = 0
        self._sync = SyncClock()
        self._counters = Counters()
        # Checkpoints every N steps (``_cut_every``): the state is copied the moment the clock
        # reaches a multiple of N (in sync an exact cut), so every shard's part of checkpoint C
        # is its state at clock C whenever its writer thread gets to it. At most two cuts wait.
        self._last_cut = 0
        self._cuts: deque[tuple[int, tuple[int, dict[str, np.ndarray], dict]]] = deque()
        self._data: DataQueue | None = None  # dynamic data: the job's queue (shard 0 only)

    # -- clocks ------------------------------------------------------------------------------

    def _current_clock(self) -> int:
        # Caller holds _lock. Sync counts applied clocks; SSP/async the slowest live member.
        if self._job is not None and self._job.consistency.mode is Mode.SYNC:
            return self._open_clock
        return cons.shard_clock(self._member_clocks(), self._clock_floor)

    def _quorum(self) -> int:
        # Caller holds _lock.
        assert self._job is not None
        return cons.sync_quorum(self._job.consistency, sum(w.live for w in self._workers.values()))

    def _live_contributors(self) -> int:
        # Caller holds _lock. Gradients of workers that left still join the mean, but only live
        # ones fill a quorum.
        return sum(1 for n in self._sync.contributors if self._workers[n].live)

    def _membership_changed(self) -> None:
        # Caller holds _lock. A clock may have advanced, or a sync quorum been reached.
        self._clock_floor = self._current_clock()
        job = self._job
        if job is not None and job.consistency.mode is Mode.SYNC and self._sync.received:
            if self._live_contributors() >= self._quorum():
                self._apply_aggregate()
        self._maybe_cut()
        self._changed.notify_all()

    # -- uploads ----------------------------------------------------------------------------

    def upload_parts(self, header_parts: Sequence[Part], *, initialize: bool, rows: bool = False) -> list[Part]:
        """Validate the parts an Initialize or Push stream announces, before any bytes arrive.

        An initialisation lists every part of the shard, in order; a push lists a subset of
        them without repeats (none at all when it carries table ``rows``, or in ssp/sync, where
        it just advances the clock).
        Raises ``InvalidArgumentError`` naming the offending variable; when the shard has no job
        yet, ``PreconditionError`` for an initialisation and ``FencedError`` for a push (its
        sender registered with a shard that has since lost its state: it must register again).
        """
        with self._lock:
            if self._job is None:
                if initialize:
                    raise PreconditionError("this shard has no job yet: register first")
                raise FencedError("this shard has no job (it restarted without a checkpoint?): register again")
            expected = {p.key: p for p in self._job.parts}
            clock_only_ok = not initialize and self._job.consistency.mode is not Mode.ASYNC
        if not header_parts and not clock_only_ok and not rows:
            raise InvalidArgumentError("the request names no variables")
        seen: set[str] = set()
        for part in header_parts:
            known = expected.get(part.key)
            if known is None:
                names = [p.key for p in expected.values() if p.name == part.name]
                where = f"; this shard holds {', '.join(names)}" if names else ""
                raise InvalidArgumentError(f"unknown variable {part.key!r} on this shard{where}")
            if part.dtype != known.dtype:
                raise InvalidArgumentError(
                    f"variable {part.key!r} has dtype {dtype_name(known.dtype)}, got {dtype_name(part.dtype)}"
                )
            if part.full_shape != known.full_shape:
                raise InvalidArgumentError(
                    f"variable {part.key!r} has shape {list(known.full_shape)}, got {list(part.full_shape)}"
                )
            if part.key in seen:
                raise InvalidArgumentError(f"variable {part.key!r} is listed twice")
            seen.add(part.key)
        if initialize and [p.key for p in header_parts] != list(expected):
            raise InvalidArgumentError("initialisation must list every variable of the shard in placement order")
        return [expected[p.key] for p in header_parts]

    def may_initialize(self, worker_id: int, generation: int, *, session: bytes | None = None) -> bool:
        """Whether this registration should upload the initial values now (checked before any
        of their bytes are read): False once the shard is initialised. Raises
        ``PreconditionError`` when another worker was chosen to initialise it, and the errors
        of a call whose registration is void."""
        with self._lock:
            if self._job is None:
                raise PreconditionError("this shard has no job yet: register first")
            self._check_worker(worker_id, generation, session)
            if self._state is ShardState.READY:
                return False
            if self._initializer != worker_id:
                raise PreconditionError(
                    f"worker id {worker_id} was not chosen to initialise this shard (worker id "
                    f"{self._initializer} was): register again to be told whether to"
                )
            return True

    def initialize(
        self, worker_id: int, generation: int, values: Sequence[np.ndarray], *, session: bytes | None = None
    ) -> tuple[bool, int]:
        """Adopt ``values`` (one tensor per part, in order; ownership passes to the store) as the
        initial variables. Returns ``(applied, version)``; ``applied`` is False when another
        worker's upload won. Raises ``InvalidArgumentError`` for non-finite values."""
        with self._lock:
            job = self._job
        if job is None:
            raise PreconditionError("this shard has no job yet: register first")
        for part, value in zip(job.parts, values, strict=True):
            check_finite(part, value, "initial value")
        with self._lock:
            self._check_worker(worker_id, generation, session)
            if self._state is ShardState.READY:
                return False, self._version
            assert self._rule is not None
            self._slots = {
                part.key: Slot(part, value, self._rule.init_state(value)) for part, value in zip(job.parts, values)
            }
            group_slots(self._slots)
            self._state = ShardState.READY
            self._changed.notify_all()
            log.info("initialised %d parts by worker id %d", len(self._slots), worker_id)
            return True, self._version

    def apply_push(
        self,
        worker_id: int,
        generation: int,
        sequence: int,
        base_version: int,
        parts: Sequence[Part],
        grads: Sequence[np.ndarray],
        *,
        clock: int = 0,
        base_clock: int = 0,
        data: Mapping[str, int] | None = None,
        session: bytes | None = None,
        rows: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
        screened: Sequence[float | None] = (),
    ) -> PushResult:
        """Handle one push atomically per the job's consistency: apply it (every part and every
        table's rows, or none), scale it, drop it, or add it to the open sync clock. ``rows``:
        ``(table, ids, gradients)`` of this shard's rows (:meth:`decode_rows`), each id once.
        ``screened``: per gradient, a bound on its magnitude already read by this shard (every
        element finite and at most that; a bulk push's bytes are read while they arrive), or None
        where it is still to be read.

        A push whose ``sequence`` this worker generation already had handled is acknowledged
        again with its original reply and not re-applied; one older than the dedupe window, whose
        outcome is no longer known, is refused (``PreconditionError``), never acknowledged as
        applied. Every integer is range-checked before it touches state, and an update that would
        make a variable or its optimizer state non-finite is refused whole and counted. Raises
        ``InvalidArgumentError`` for non-finite gradients or updates and for sequences, versions,
        clocks or progress that cannot be, ``NotReadyError`` before initialisation,
        ``PreconditionError`` for an unknown, departed or stale-generation worker.
        """
        try:
            known = gradient_bounds(parts, grads, screened)  # read here, outside the lock
            check_count("sequence", sequence)
            check_count("clock", clock)
            check_count("base clock", base_clock)
            for key, value in (data or {}).items():
                check_count(f"data {key}", value)
        except InvalidArgumentError:
            with self._lock:  # refused before the lock, but received all the same
                self._counters.pushes_received += 1
            raise
        with self._lock:
            self._counters.pushes_received += 1
            if (ended := self._ended_job(worker_id)) is not None:
                raise ended
            if self._state is not ShardState.READY:
                raise NotReadyError(
                    "this shard's job is being ended (psctl end-job); retry" if self._state is ShardState.ENDING
                    else "this shard is not initialised yet"
                )
            worker = self._check_worker(worker_id, generation, session)
            if 0 < sequence <= worker.max_sequence:
                known = worker.applied.get(sequence)
                if known is None:
                    raise PreconditionError(
                        f"push {sequence} of {worker.name} is older than this shard's record of its last "
                        f"{self._dedupe_window} pushes (the newest is {worker.max_sequence}): whether it was "
                        "applied is not known"
                    )
                log.info("push %d of %s already handled; acknowledged again", sequence, worker.name)
                self._counters.pushes_duplicate += 1
                return known
            if sequence > worker.max_sequence + self._dedupe_window:
                raise InvalidArgumentError(
                    f"push sequence {sequence} is far ahead of {worker.name}'s last ({worker.max_sequence}); "
                    f"sequences count up from 1 per registration, at most {self._dedupe_window} ahead"
                )
            if clock > worker.clock + 1:
                raise InvalidArgumentError(
                    f"push for clock {clock}, but {worker.name} is at clock {worker.clock}: a push belongs to "
                    "the worker's current step"
                )
            job = self._job
            assert job is not None and self._rule is not None
            mode = job.consistency.mode
            if not 0 <= base_version <= self._version:
                raise InvalidArgumentError(
                    f"base version {base_version} is not a version of this shard (now {self._version})"
                )
            shard_clock = self._current_clock()
            if mode is not Mode.ASYNC and not 0 <= base_clock <= shard_clock:
                raise InvalidArgumentError(f"base clock {base_clock} is not a clock of this shard (now {shard_clock})")
            if mode is not Mode.ASYNC and clock < worker.clock:
                raise InvalidArgumentError(f"push for clock {clock}, but {worker.name} is already at clock {worker.clock}")
            staleness = self._version - base_version if mode is Mode.ASYNC else shard_clock - base_clock
            decision = cons.decide_push(
                job.consistency, staleness, push_clock=clock, open_clock=self._open_clock,
                received=self._live_contributors(), quorum=self._quorum(),
            )
            if decision.action is PushAction.ACCUMULATE and worker.name in self._sync.contributors:
                # One gradient per worker per clock, even across a re-registration.
                decision = cons.PushDecision(PushAction.DROP, f"sync: {worker.name} already sent clock {clock}")
            if decision.action is PushAction.ACCUMULATE:
                self._sync.add(worker.name, parts, grads, rows)
            elif decision.action is PushAction.DROP:
                self._counters.pushes_dropped += 1
                log.debug("push of %s dropped: %s", worker.name, decision.reason)
            elif parts or rows:  # a push with neither only advances the worker's clock
                # The learning-rate schedule runs on this shard's update count (OptimizerConfig.lr_factor).
                lr_scale = decision.lr_scale * job.optimizer.lr_factor(self._version + 1)
                screened = self._verify_update(parts, grads, lr_scale, f"push of {worker.name}", known)
                updates = self._prepare_rows(rows, decision.lr_scale, worker.name)
                self._version += 1
                self._apply_update(screened, lr_scale)
                for update in updates:
                    update.table.commit(update)
                self._counters.pushes_applied += 1
                self._counters.pushes_scaled += decision.action is PushAction.SCALE
                self._counters.record_staleness(staleness)
            worker.pushes += 1
            worker.clock = max(worker.clock, clock + 1)
            if data:
                worker.data = dict(data)
            result = PushResult(self._version, staleness, decision.action)
            if sequence > 0:
                worker.max_sequence = sequence
                worker.applied[sequence] = result
                if len(worker.applied) > self._dedupe_window:
                    del worker.applied[next(iter(worker.applied))]
            self._membership_changed()
            return result

    def _verify_update(
        self, parts: Sequence[Part], grads: Sequence[np.ndarray], lr_scale: float, who: str,
        known: Sequence[float | None],
    ) -> list[_Screened]:
        """Every part checked before any is changed (a push applies whole or not at all), a
        group of small variables (``psserver.groups``) as one when the push covers it: what
        :meth:`_apply_update` then applies. ``known``: each gradient's largest magnitude, or
        None to read it. Caller holds _lock."""
        assert self._rule is not None
        by_key = dict(zip((part.key for part in parts), grads))
        bound_of = dict(zip(by_key, known))
        screened: list[_Screened] = []
        grouped: set[str] = set()
        for part in parts:
            group = self._slots[part.key].group
            if group is None or part.key in grouped or not group.covers(by_key):
                continue
            grouped |= group.keys
            grad, state = group.gather(by_key), group.step_state()
            largest = [bound_of[key] for key in group.keys]
            given = {"grad": max(largest)} if None not in largest else {}
            if (param := group.known_largest()) is not None:
                given["param"] = param
            try:
                bound = self._rule.verify(group.value, grad, state, lr_scale=lr_scale, known=given)
            except InvalidArgumentError as exc:  # refused as one: named by the member that fails alone
                for slot in group.slots:
                    self._verify_one(slot, by_key[slot.part.key], lr_scale, who, bound_of[slot.part.key])
                self._counters.updates_nonfinite += 1
                raise NonFiniteError(f"{who} refused: {', '.join(map(repr, sorted(group.keys)))}: {exc}") from None
            screened.append(_Screened(group.slots, grad, state, bound, group))
        for part, grad, largest in zip(parts, grads, known):
            if part.key not in grouped:
                slot = self._slots[part.key]
                screened.append(_Screened([slot], grad, slot.state, self._verify_one(slot, grad, lr_scale, who, largest)))
        return screened

    def _verify_one(self, slot: Slot, grad: np.ndarray, lr_scale: float, who: str, largest: float | None) -> float | None:
        # Caller holds _lock.
        assert self._rule is not None
        given = {key: value for key, value in (("param", slot.largest), ("grad", largest)) if value is not None}
        try:
            return self._rule.verify(slot.value, grad, slot.state, lr_scale=lr_scale, known=given)
        except InvalidArgumentError as exc:
            self._counters.updates_nonfinite += 1
            raise NonFiniteError(f"{who} refused: {slot.part.key!r}: {exc}") from None

    def _apply_update(self, screened: Sequence[_Screened], lr_scale: float) -> None:
        # Caller holds _lock and has advanced _version.
        assert self._rule is not None
        for update in screened:
            if update.group is not None:
                self._rule.apply(update.group.writable(), update.grad, update.state, lr_scale=lr_scale)
                update.group.set_step(update.state, update.bound)
            else:
                slot = update.slots[0]
                self._rule.apply(slot.writable(), update.grad, slot.state, lr_scale=lr_scale)
                slot.largest = update.bound
            for slot in update.slots:
                slot.version = self._version

    def _prepare_rows(
        self, rows: Sequence[tuple[str, np.ndarray, np.ndarray]], lr_scale: float, who: str
    ) -> list[RowUpdate]:
        # Caller holds _lock. Every table's update is computed and checked before anything is
        # written.
        update = self._version + 1
        try:
            tables = [(self._tables[name], ids, values) for name, ids, values in rows]
            return [t.prepare(ids, values, lr_scale * t.spec.optimizer.lr_factor(update)) for t, ids, values in tables]
        except NonFiniteRows as exc:
            self._counters.updates_nonfinite += exc.update
            raise NonFiniteError(f"push of {who} refused: {exc}") from None

    def step_layout(self) -> tuple[list[Part], dict[str, int]]:
        """What a ``Step`` (``pswire.step``) is checked against: every part this shard holds, in
        the job's order, and each table's row width. Raises ``FencedError`` without a job."""
        with self._lock:
            if self._job is None:
                raise FencedError("this shard has no job (it restarted without a checkpoint?): register again")
            return list(self._job.parts), {name: table.spec.dim for name, table in self._tables.items()}

    def decode_rows(self, blocks: Sequence) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``(table, ids, gradients)`` of a push's ``RowBlock`` messages, their sizes checked
        against the job's tables (each table once). Raises ``InvalidArgumentError`` naming the
        problem, ``FencedError`` when the shard has no job."""
        with self._lock:
            if self._job is None:
                raise FencedError("this shard has no job (it restarted without a checkpoint?): register again")
            tables = dict(self._tables)
        out, seen = [], set()
        for block in blocks:
            table = tables.get(block.table)
            if table is None:
                known = ", ".join(repr(t) for t in tables) or "none"
                raise InvalidArgumentError(f"unknown table {block.table!r} (the job's tables: {known})")
            if block.table in seen:
                raise InvalidArgumentError(f"table {block.table!r} is listed twice in one push")
            seen.add(block.table)
            ids, values = rows_from_proto(block, table.spec.dim)
            out.append((block.table, ids, values))
        return out

    def _apply_aggregate(self) -> None:
        # Caller holds _lock. One update per sync clock: the mean of the gradients received.
        assert self._rule is not None and self._job is not None
        means = list(self._sync.means())
        received = self._sync.received
        update = self._version + 1
        lr_scale = self._job.optimizer.lr_factor(update)
        try:
            screened = self._verify_update(  # counts a refusal in updates_nonfinite
                [self._slots[key].part for key, _ in means], [mean for _, mean in means], lr_scale,
                f"the mean of sync clock {self._open_clock}", [None] * len(means),
            )
            updates = []
            for table, blocks in self._sync.rows.items():
                ids, sums = coalesce(blocks, self._tables[table].spec.dim)
                if received > 1:
                    sums /= np.float32(received)
                try:
                    held = self._tables[table]
                    updates.append(held.prepare(ids, sums, held.spec.optimizer.lr_factor(update)))
                except InvalidArgumentError as exc:
                    self._counters.updates_nonfinite += 1
                    raise InvalidArgumentError(f"table {table!r}: {exc}") from None
        except InvalidArgumentError as exc:
            # The clock's pushes were acknowledged as accumulated; its update is dropped whole.
            self._counters.pushes_dropped += 1
            log.warning("sync clock %d's update dropped: %s", self._open_clock, exc)
        else:
            self._version += 1
            self._apply_update(screened, lr_scale)
            for update in updates:
                update.table.commit(update)
            self._counters.pushes_applied += 1
            self._counters.record_staleness(0)
        self._sync = SyncClock(spares=self._sync.sums)
        self._open_clock += 1

    def note_rejected(self, error: BaseException | None = None, *, received: bool = False) -> None:
        """Count a refused push, as fenced (``FencedError``) or non-finite (``NonFiniteError``)
        when ``error`` is one; ``received``: refused before :meth:`apply_push` saw it (which
        counts every push it is handed), so that every push is counted received once."""
        with self._lock:
            self._counters.pushes_rejected += 1
            self._counters.pushes_received += received
            self._counters.pushes_fenced += isinstance(error, FencedError)
            self._counters.pushes_nonfinite += isinstance(error, NonFiniteError)

    # -- dynamic data ------------------------------------------------------------------------

    def data(
        self,
        worker_id: int,
        generation: int,
        *,
        plan: DataPlan | None,
        finished: Sequence[tuple[DataTask, int]] = (),
        want: int = 0,
        session: bytes | None = None,
    ) -> tuple[list[DataTask], DataPlan, dict]:
        """One exchange with the job's data queue: the worker stops holding each ``(task,
        trained)`` of ``finished`` (the rest of a task it did not fully train goes back), then
        leases up to ``want`` tasks. The first call of the job sets ``plan``; later ones must
        give the same plan or none. Returns ``(every task this registration holds now, the
        job's plan, queue status)``: a worker whose reply was lost learns its tasks from the next.

        A worker that left the job may still ask (``want`` 0, nothing finished): a worker waiting
        for data in an ssp/sync job leaves the membership meanwhile, so that nobody waits on it.
        Raises ``NotReadyError`` before initialisation, ``PreconditionError`` on a shard other
        than 0, without a plan, for a plan that differs from the job's, or for a task not leased
        to this registration, ``InvalidArgumentError`` for impossible counts, and as any call of
        a registration (fenced, evicted, no session)."""
        with self._lock:
            if (ended := self._ended_job(worker_id)) is not None:
                raise ended
            if self._state is not ShardState.READY or self._job is None:
                raise NotReadyError("this shard is not initialised yet")
            if self._job.shard_index != 0:
                raise PreconditionError(
                    f"the job's data queue lives on shard 0; this is shard {self._job.shard_index}"
                )
            worker = self._by_id.get(worker_id)
            waiting = (worker is not None and worker.generation == generation and not worker.live
                       and not worker.evicted and not worker.fenced and not want and not finished)
            if not waiting or session is not None and not hmac.compare_digest(session, worker.secret):
                worker = self._check_worker(worker_id, generation, session)
            queue = DataQueue.for_plan(self._data, plan, worker.name)
            held = queue.exchange(worker.name, generation, finished, want)
            if self._data is None:
                log.info("dynamic data: %s, set by %s", queue.plan.describe(), worker.name)
                self._data = queue
            elif queue.finished and finished:
                log.info("dynamic data: every task of the job is done (%d examples)", queue.examples_done)
            return held, queue.plan, queue.status()

    def _release_data(self, worker: Worker, why: str) -> None:
        # Caller holds _lock. A registration that ended gives its data tasks back.
        if self._data is None:
            return
        tasks = self._data.release(worker.name, below=worker.generation if why == "registered again" else None)
        if tasks:
            log.info("%s %s: %d data task(s) back in the queue (%s)", worker.name, why, len(tasks),
                     ", ".join(map(str, tasks)))

    def tensor(self, key: str) -> np.ndarray:
        """A copy of one part's current value (for tests and tools)."""
        with self._lock:
            return self._slots[key].value.copy()
