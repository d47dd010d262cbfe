"""Who belongs to a shard's job: workers registering (and re-registering), the session secret
each registration proves itself with, leases renewed by heartbeats and evicted when silent, and
workers leaving. A mixin of :class:`psserver.store.ShardStore`, split out to keep the store
readable; it has no state or lock of its own.

Locking: every attribute used here is the store's, guarded by ``ShardStore._lock`` (see its
``__init__`` and ``_reset_job``). The public methods take ``_lock`` themselves; the underscored
helpers are called with it held, by these methods or the store's.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable
from threading import Lock

from pswire.errors import (
    FencedError, InvalidArgumentError, NotReadyError, OverloadedError, PreconditionError, TooLargeError,
    UnauthenticatedError,
)
from psserver.dataqueue import DataQueue
from psserver.job import Registration, check_parts, check_same_job, check_tables, fmt_bytes
from psserver.leases import expired
from psserver.optimizers import UpdateRule, create_update_rule
from psserver.state import Counters, EndedJobs, RegisterResult, ShardState, SyncClock, Worker
from psserver.tables import RowTable

__all__ = ["Membership"]

# The store's log lines keep the store's logger, whichever module writes them: operators and
# tests select them by that name.
log = logging.getLogger("psserver.store")


class Membership:
    """Registration, sessions, leases and leaving, for :class:`~psserver.store.ShardStore`.

    Besides the attributes below (the store's, under its ``_lock``), it calls the store's
    ``_current_clock``, ``_membership_changed`` and ``_release_data``, with ``_lock`` held.
    """

    _lock: Lock
    _now: Callable[[], float]
    _max_model_bytes: int
    _max_workers: int
    _init_timeout: float
    _lease_timeout: float | None
    _next_worker_id: int
    _ended: EndedJobs | None
    _state: ShardState
    _job: Registration | None
    _rule: UpdateRule | None
    _tables: dict[str, RowTable]
    _initializer: int | None
    _init_deadline: float
    _workers: dict[str, Worker]
    _by_id: dict[int, Worker]
    _version: int
    _sync: SyncClock
    _counters: Counters
    _data: DataQueue | None

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
        check_parts(reg.parts, self._max_model_bytes, num_shards=reg.num_shards)
        check_tables(reg.tables, reg.parts)
        rule = create_update_rule(reg.optimizer)
        with self._lock:
            if self._ended is not None and session and session in self._ended.sessions:
                raise self._ended.error()
            if self._state is ShardState.ENDING:
                raise NotReadyError("this shard's job is being ended (psctl end-job); retry")
            if self._job is None:
                tables = self._make_tables(reg)
                self._job, self._rule, self._tables = reg, rule, tables
                # A shard holding no variables (a packed model's other shards) has nothing to upload.
                self._state = ShardState.INITIALIZING if reg.parts else ShardState.READY
                log.info(
                    "job defined by %s: shard %d of %d, %d parts (%s), optimizer %s, %s",
                    reg.worker_name, reg.shard_index, reg.num_shards, len(reg.parts),
                    fmt_bytes(sum(p.nbytes for p in reg.parts)), reg.optimizer.name,
                    reg.consistency.describe(),
                )
                for table in tables.values():
                    log.info("table %r: rows %d of %d (row i on shard i %% %d), dim %d, %s lr %g, init %s %g; "
                             "%s reserved, resident as rows are written", table.spec.name, table.rows,
                             table.spec.num_rows, reg.num_shards, table.spec.dim, table.spec.optimizer.name,
                             table.spec.optimizer.lr, table.spec.init, table.spec.init_scale, fmt_bytes(table.nbytes))
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

    def _make_tables(self, reg: Registration) -> dict[str, RowTable]:
        # Caller holds _lock. The arrays are zero pages until rows are written; what they could
        # grow to is checked against the limit before anything is mapped.
        total = sum(p.nbytes for p in reg.parts) + sum(
            RowTable.reserved_bytes(t, reg.shard_index, reg.num_shards) for t in reg.tables)
        if total > self._max_model_bytes:
            raise InvalidArgumentError(
                f"registration puts {fmt_bytes(total)} of variables and table rows (with their optimizer state) on "
                f"this shard, above its limit of {fmt_bytes(self._max_model_bytes)} (--max-model-bytes)"
            )
        try:
            return {t.name: RowTable(t, reg.shard_index, reg.num_shards) for t in reg.tables}
        except OSError as exc:
            raise TooLargeError(f"cannot map the tables' {fmt_bytes(total)} on this shard: {exc}") from None

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
        # Caller holds _lock. The clock of every live member.
        return {w.name: w.clock for w in self._workers.values() if w.live}
