"""One shard's state: its slice of the model's variables, their optimizer state, versions,
workers and clocks. Pure Python and numpy, no gRPC: the servicer translates requests into these
calls, and the consistency decisions come from ``psserver.consistency``.

Every method either completes or raises a ``pswire.errors`` error with the state unchanged.
"""

from __future__ import annotations

import enum
import hmac
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pswire.codec import Part, dtype_name, on_wire
from pswire.dtypes import DType
from pswire.errors import (
    DeadlineError, FencedError, InvalidArgumentError, NotReadyError, OverloadedError, PreconditionError,
    UnauthenticatedError,
)
from psserver import consistency as cons
from psserver import snapshot
from psserver.leases import expired
from psserver.consistency import Mode, PushAction
from psserver.dataqueue import DataQueue
from pswire.data import DataPlan, DataTask
from psserver.job import (
    MAX_COUNT, Registration, check_count, check_finite, check_parts, check_same_job, fmt_bytes,
)
from psserver.optimizers import UpdateRule, create_update_rule
from psserver.state import (
    Counters, EndedJob, EndedJobs, PulledPart, PullSnapshot, PushResult, Reading, RegisterResult, Slot, SyncClock,
    Worker,
)

__all__ = [
    "EndedJob", "NonFiniteError", "PullSnapshot", "PulledPart", "PushResult", "Reading", "RegisterResult",
    "Registration", "ShardState", "ShardStore",
]

log = logging.getLogger(__name__)

RESTORE_ID_GAP = 1 << 20
"""Worker ids a restored shard skips: more registrations than this between a checkpoint and the
crash it is restored after would be needed for a fenced worker's id to be given out again."""


class ShardState(enum.Enum):
    EMPTY = "empty"
    INITIALIZING = "initializing"
    READY = "ready"
    ENDING = "ending"
    """``end_job`` is writing the final checkpoint: calls of the job wait (retryably)."""


class NonFiniteError(InvalidArgumentError):
    """A push refused for a non-finite gradient, or for an update that would have made a
    variable or its optimizer state non-finite (INVALID_ARGUMENT on the wire, like its parent;
    counted apart from other refusals)."""


class ShardStore:
    """The variables and optimizer state of one shard.

    Locking: ``_lock`` guards every attribute assigned after it in ``__init__``; ``_changed``
    is a condition on the same lock, notified whenever readiness, clocks or membership change.
    The lock is held while an update is applied and while a pull takes its snapshot (it holds
    the variables themselves; an update meanwhile goes to a copy), never while waiting on the
    network.
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

    # -- membership -------------------------------------------------------------------------

    def register(self, reg: Registration, *, session: bytes | None = None) -> RegisterResult:
        """Join the job. The first registration defines it; later ones must agree. Every
        registration gets a new generation and a new session secret (``RegisterResult.session``).

        A name whose registration is live can be registered again only with that registration's
        ``session`` (a worker re-registering itself) or once its lease has expired: anyone else
        gets ``NotReadyError`` (retryable: a restarted worker waits out its old lease).
        ``session=None`` is for in-process callers that need no proof; the servicer always
        passes the bytes the call carried.

        Raises ``InvalidArgumentError`` for a malformed registration (or one above
        ``max_model_bytes``), ``PreconditionError`` naming the first disagreement (shard index,
        variable shape, optimizer setting, ...), and ``OverloadedError`` when the worker table
        is full of live workers.
        """
        check_parts(reg.parts, self._max_model_bytes)
        rule = create_update_rule(reg.optimizer)
        with self._lock:
            if self._ended is not None and session and session in self._ended.sessions:
                raise self._ended.error()
            if self._state is ShardState.ENDING:
                raise NotReadyError("this shard's job is being ended (psctl end-job); retry")
            if self._job is None:
                self._job, self._rule = reg, rule
                self._state = ShardState.INITIALIZING
                log.info(
                    "job defined by %s: shard %d of %d, %d parts (%s), optimizer %s, %s",
                    reg.worker_name, reg.shard_index, reg.num_shards, len(reg.parts),
                    fmt_bytes(sum(p.nbytes for p in reg.parts)), reg.optimizer.name,
                    reg.consistency.describe(),
                )
            else:
                check_same_job(self._job, reg)
            # A (re)joining worker starts at the shard's clock, so it never holds others back.
            start = self._current_clock()
            worker = self._workers.get(reg.worker_name)
            if worker is not None and session is not None:
                self._check_takeover(worker, session)
            if worker is None:
                self._make_room()
                worker = Worker(self._next_worker_id, reg.worker_name, 1, clock=start)
                self._next_worker_id += 1
                self._workers[reg.worker_name] = self._by_id[worker.worker_id] = worker
            else:
                worker.generation += 1
                if self._data is not None:  # what the old registration held goes back
                    self._release_data(worker, "registered again")
                worker.applied.clear()  # sequences restart with each generation
                worker.max_sequence = 0
                worker.clock, worker.live, worker.evicted, worker.fenced = start, True, False, ""
            worker.secret = secrets.token_bytes(32)
            worker.heard_at = self._now()
            must_init = False
            if self._state is ShardState.INITIALIZING:
                now = self._now()
                if self._initializer in (None, worker.worker_id) or now > self._init_deadline:
                    self._initializer = worker.worker_id
                    self._init_deadline = now + self._init_timeout
                    must_init = True
            self._membership_changed()  # a returning sync contributor may complete the open clock
            return RegisterResult(
                worker.worker_id, worker.generation, must_init, self._version, start, self._job.consistency,
                self._lease_timeout or 0.0, dict(worker.data), worker.secret,
                sum(w.live for w in self._workers.values()),
            )

    def _check_takeover(self, worker: Worker, session: bytes) -> None:
        # Caller holds _lock. A live registration of this name belongs to whoever holds its secret.
        if not worker.live or worker.evicted or worker.fenced:
            return
        if hmac.compare_digest(session, worker.secret):
            return
        if self._lease_timeout:
            left = self._lease_timeout - (self._now() - worker.heard_at)
            when = f"its lease expires in {max(left, 0.0):.1f}s unless it renews it"
        else:
            when = "leases are off on this shard (--lease-timeout 0), so only it can leave"
        raise NotReadyError(
            f"worker name {worker.name!r} is held by a live registration (generation {worker.generation}); "
            f"{when}. Give each worker its own --worker-name"
        )

    def _make_room(self) -> None:
        # Caller holds _lock. The worker table is bounded: forget the longest-silent departed
        # worker (not one whose gradient is in the open sync clock) to admit a new name.
        if len(self._workers) < self._max_workers:
            return
        gone = [w for w in self._workers.values() if not w.live and w.name not in self._sync.contributors]
        if not gone:
            raise OverloadedError(
                f"this shard already knows {len(self._workers)} workers, all live (--max-workers "
                f"{self._max_workers}); retry once one leaves"
            )
        oldest = min(gone, key=lambda w: w.heard_at)
        del self._workers[oldest.name], self._by_id[oldest.worker_id]
        self._counters.pull_waits.pop(oldest.name, None)  # its label goes with it: names stay bounded

    def session_secret(self, worker_id: int, generation: int) -> bytes | None:
        """The secret of registration ``(worker_id, generation)`` while it is live, else None
        (for the bulk lanes' handshake)."""
        with self._lock:
            worker = self._by_id.get(worker_id)
            if worker is None or worker.generation != generation or not worker.live or worker.fenced:
                return None
            return worker.secret or None

    def check_session(self, worker_id: int, generation: int, session: bytes | None) -> None:
        """Raise as :meth:`apply_push` would for this registration and session (before a
        transfer's bytes are read)."""
        with self._lock:
            self._check_worker(worker_id, generation, session)

    def leave(self, worker_id: int, generation: int, *, session: bytes | None = None) -> None:
        """A worker leaves the job: it stops counting for SSP/sync membership at once."""
        with self._lock:
            worker = self._check_worker(worker_id, generation, session)
            worker.live = False
            # Its clock is not its step count: a (re)joining worker starts at the shard's clock.
            step = f" at its step {worker.data['step']}," if "step" in worker.data else ""
            log.info("%s left the job%s after %d pushes to this shard in %d registration(s); its clock here is %d "
                     "(the shard's clock when it last registered, plus one per push since)",
                     worker.name, step, worker.pushes, worker.generation, worker.clock)
            self._release_data(worker, "left")
            self._membership_changed()

    def heartbeat(self, worker_id: int, generation: int, *, session: bytes | None = None) -> float:
        """Renew a worker's lease; returns the lease in seconds (0: leases off). Raises
        ``PreconditionError`` when the worker was evicted, left, or re-registered since."""
        with self._lock:
            self._check_worker(worker_id, generation, session)
            return self._lease_timeout or 0.0

    def evict_expired(self) -> list[str]:
        """Evict live workers silent for longer than the lease: they leave SSP/sync membership
        at once and their later pushes are refused. Returns their names."""
        with self._lock:
            now = self._now()
            live = {w.name: w.heard_at for w in self._workers.values() if w.live}
            names = expired(live, now, self._lease_timeout)
            for name in names:
                worker = self._workers[name]
                worker.live, worker.evicted = False, True
                self._counters.workers_evicted += 1
                self._release_data(worker, "was evicted")
                log.warning(
                    "evicted %s (generation %d, clock %d): no heartbeat for %.1fs, lease %.1fs",
                    name, worker.generation, worker.clock, now - worker.heard_at, self._lease_timeout,
                )
            if names:
                self._membership_changed()
            return names

    def _check_worker(self, worker_id: int, generation: int, session: bytes | None) -> Worker:
        # Caller holds _lock. ``session`` None: an in-process caller (no proof needed).
        worker = self._by_id.get(worker_id)
        if worker is None:
            raise self._unknown(worker_id)
        if self._state is ShardState.ENDING:
            raise NotReadyError("this shard's job is being ended (psctl end-job); retry")
        if generation != worker.generation:
            raise FencedError(
                f"worker {worker.name!r} (id {worker_id}) sent generation {generation}, "
                f"but its current generation is {worker.generation}: re-register"
            )
        # The registration's state first (Status shows it anyway), then its proof: a late call of
        # a fenced worker is told to re-register whoever sends it.
        if worker.fenced:
            raise FencedError(f"worker {worker.name!r}: {worker.fenced}; re-register")
        if worker.evicted:
            raise FencedError(
                f"worker {worker.name!r} was evicted: no heartbeat for over "
                f"{self._lease_timeout:.1f}s; re-register"
            )
        if not worker.live:
            raise FencedError(f"worker {worker.name!r} left the job: re-register")
        if session is not None and not (worker.secret and hmac.compare_digest(session, worker.secret)):
            raise UnauthenticatedError(
                f"the call for worker id {worker_id} (generation {generation}) does not carry that "
                "registration's session secret"
            )
        worker.heard_at = self._now()
        return worker

    def _ended_job(self, worker_id: int) -> PreconditionError | None:
        # Caller holds _lock. The error for a worker of a job this shard ended, else None.
        if self._ended is not None and worker_id not in self._by_id and 0 < worker_id < self._ended.below:
            return self._ended.error()
        return None

    def _unknown(self, worker_id: int) -> PreconditionError:
        # Caller holds _lock. What a call of a worker id this shard does not know is told.
        return self._ended_job(worker_id) or FencedError(
            f"worker id {worker_id} is not registered with this shard (it restarted without a checkpoint?): "
            "register again"
        )

    def _member_clocks(self) -> dict[str, int]:
        return {w.name: w.clock for w in self._workers.values() if w.live}

    def _current_clock(self) -> int:
        # Caller holds _lock. Sync counts applied clocks; SSP/async the slowest live member.
        if self._job is not None and self._job.consistency.mode is Mode.SYNC:
            return self._open_clock
        return cons.shard_clock(self._member_clocks(), self._clock_floor)

    def _quorum(self) -> int:
        assert self._job is not None
        return cons.sync_quorum(self._job.consistency, sum(w.live for w in self._workers.values()))

    def _live_contributors(self) -> int:
        # Gradients of workers that left still join the mean, but only live ones fill a quorum.
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

    # -- uploads ----------------------------------------------------------------------------

    def upload_parts(self, header_parts: Sequence[Part], *, initialize: bool) -> list[Part]:
        """Validate the parts an Initialize or Push stream announces, before any bytes arrive.

        An initialisation lists every part of the shard, in order; a push lists a subset of
        them without repeats (none at all only in ssp/sync, where it just advances the clock).
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
        if not header_parts and not clock_only_ok:
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
    ) -> PushResult:
        """Handle one push atomically per the job's consistency: apply it (every part or none),
        scale it, drop it, or add it to the open sync clock.

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
            for part, grad in zip(parts, grads, strict=True):
                try:
                    check_finite(part, grad, "gradient")
                except InvalidArgumentError as exc:
                    raise NonFiniteError(str(exc)) from None
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
                self._sync.add(worker.name, parts, grads)
            elif decision.action is PushAction.DROP:
                self._counters.pushes_dropped += 1
                log.debug("push of %s dropped: %s", worker.name, decision.reason)
            elif parts:  # a push with no parts only advances the worker's clock
                self._verify_update(parts, grads, decision.lr_scale, worker.name)
                self._version += 1
                for part, grad in zip(parts, grads):
                    slot = self._slots[part.key]
                    self._rule.apply(slot.writable(), grad, slot.state, lr_scale=decision.lr_scale)
                    slot.version = self._version
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

    def _verify_update(self, parts: Sequence[Part], grads: Sequence[np.ndarray], lr_scale: float, who: str) -> None:
        # Caller holds _lock. Every part is checked before any is changed: a push applies whole
        # or not at all.
        assert self._rule is not None
        for part, grad in zip(parts, grads):
            slot = self._slots[part.key]
            try:
                self._rule.verify(slot.value, grad, slot.state, lr_scale=lr_scale)
            except InvalidArgumentError as exc:
                self._counters.updates_nonfinite += 1
                raise NonFiniteError(f"push of {who} refused: {part.key!r}: {exc}") from None

    def _apply_aggregate(self) -> None:
        # Caller holds _lock. One update per sync clock: the mean of the gradients received.
        assert self._rule is not None
        means = list(self._sync.means())
        try:
            for key, mean in means:
                slot = self._slots[key]
                self._rule.verify(slot.value, mean, slot.state)
        except InvalidArgumentError as exc:
            # The clock's pushes were acknowledged as accumulated; its update is dropped whole.
            self._counters.updates_nonfinite += 1
            self._counters.pushes_dropped += 1
            log.warning("sync clock %d's update dropped: %r: %s", self._open_clock, key, exc)
        else:
            self._version += 1
            for key, mean in means:
                slot = self._slots[key]
                self._rule.apply(slot.writable(), mean, slot.state)
                slot.version = self._version
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

    # -- reads ------------------------------------------------------------------------------

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
                    # A pull as a worker is that worker's: only its session may make it.
                    self._check_worker(worker_id, generation, session)
        self.wait_ready(timeout, worker_id=worker_id)
        with self._changed:
            if worker_id and worker_id not in self._by_id:
                raise self._unknown(worker_id)
            job = self._job
            assert job is not None
            if clock >= 0 and worker_id:
                reader = self._check_worker(worker_id, generation, session)
                if job.consistency.mode is not Mode.ASYNC:
                    self._wait_for_bound(job.consistency, reader, clock, deadline)
                    self._check_worker(worker_id, generation, session)  # it may have been evicted meanwhile
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
            )

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
        tensors, metadata = snapshot.encode(self._job, self._slots, self._sync, self._workers, self._counters, position)
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

    def tensor(self, key: str) -> np.ndarray:
        """A copy of one part's current value (for tests and tools)."""
        with self._lock:
            return self._slots[key].value.copy()
