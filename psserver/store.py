"""One shard's state: its slice of the model's variables, their optimizer state, versions and
workers. Pure Python and torch, no gRPC: the servicer translates requests into these calls.

Every method either completes or raises a ``pswire.errors`` error with the state unchanged.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pswire.codec import Part, dtype_name, tensor_bytes
from pswire.errors import InvalidArgumentError, NotReadyError, PreconditionError
from pswire.optim import OptimizerConfig
from psserver.optimizers import UpdateRule, create_update_rule

__all__ = ["PulledPart", "RegisterResult", "Registration", "ShardState", "ShardStore"]

log = logging.getLogger(__name__)


class ShardState(enum.Enum):
    EMPTY = "empty"
    INITIALIZING = "initializing"
    READY = "ready"


@dataclass(frozen=True, kw_only=True)
class Registration:
    worker_name: str
    shard_index: int
    num_shards: int
    placement_digest: str
    parts: tuple[Part, ...]
    optimizer: OptimizerConfig
    job_fingerprint: str = ""


@dataclass(frozen=True)
class RegisterResult:
    worker_id: int
    generation: int
    must_initialize: bool
    version: int


@dataclass(frozen=True)
class PulledPart:
    part: Part
    version: int
    chunks: list[bytes] | None
    """The part's bytes, cut into chunks; ``None`` when skipped as unchanged."""


@dataclass
class _Slot:
    part: Part
    value: torch.Tensor
    state: dict[str, torch.Tensor]
    version: int = 0


@dataclass
class _Worker:
    worker_id: int
    name: str
    generation: int
    pushes: int = 0
    last_seen: float = field(default_factory=time.time)
    applied: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Sequence -> (version, staleness) of this generation's recent pushes, oldest first."""
    max_sequence: int = 0


@dataclass(frozen=True)
class _Job:
    shard_index: int
    num_shards: int
    placement_digest: str
    parts: tuple[Part, ...]
    optimizer: OptimizerConfig
    job_fingerprint: str


class ShardStore:
    """The variables and optimizer state of one shard.

    Locking: ``_lock`` guards every attribute below it in ``__init__``; ``_ready`` is a condition
    on the same lock. It is held while an update is applied (so a pull never sees half of a push)
    and while a pull's bytes are copied out, never while waiting on the network.
    """

    def __init__(
        self,
        *,
        init_timeout: float = 60.0,
        max_waiting_pulls: int = 8,
        dedupe_window: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._init_timeout = init_timeout
        # A pull waiting for initialisation parks a handler thread; capping them leaves threads
        # free for the Initialize that releases them (pulls beyond the cap retry on UNAVAILABLE).
        self._max_waiting_pulls = max_waiting_pulls
        self._dedupe_window = dedupe_window
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._state = ShardState.EMPTY
        self._job: _Job | None = None
        self._rule: UpdateRule | None = None
        self._slots: dict[str, _Slot] = {}
        self._initializer: int | None = None
        self._init_deadline = 0.0
        self._workers: dict[str, _Worker] = {}
        self._next_worker_id = 1
        self._version = 0
        self._waiting_pulls = 0
        self._pushes_received = 0
        self._pushes_applied = 0
        self._pushes_rejected = 0
        self._pulls_served = 0
        self._max_staleness = 0

    # -- membership -------------------------------------------------------------------------

    def register(self, reg: Registration) -> RegisterResult:
        """Join the job. The first registration defines it; later ones must agree.

        Raises ``InvalidArgumentError`` for a malformed registration and ``PreconditionError``
        naming the first disagreement (shard index, variable shape, optimizer setting, ...).
        """
        _check_parts(reg.parts)
        rule = create_update_rule(reg.optimizer)
        with self._lock:
            if self._job is None:
                self._job = _Job(
                    reg.shard_index, reg.num_shards, reg.placement_digest, reg.parts,
                    reg.optimizer, reg.job_fingerprint,
                )
                self._rule = rule
                self._state = ShardState.INITIALIZING
                log.info(
                    "job defined by %s: shard %d of %d, %d parts, %s, optimizer %s",
                    reg.worker_name, reg.shard_index, reg.num_shards, len(reg.parts),
                    _fmt_bytes(sum(p.nbytes for p in reg.parts)), reg.optimizer.name,
                )
            else:
                _check_same_job(self._job, reg)
            worker = self._workers.get(reg.worker_name)
            if worker is None:
                worker = _Worker(self._next_worker_id, reg.worker_name, 1)
                self._next_worker_id += 1
                self._workers[reg.worker_name] = worker
            else:
                worker.generation += 1
                worker.applied.clear()  # sequences restart with each generation
                worker.max_sequence = 0
            worker.last_seen = time.time()
            must_init = False
            if self._state is ShardState.INITIALIZING:
                now = self._clock()
                if self._initializer in (None, worker.worker_id) or now > self._init_deadline:
                    self._initializer = worker.worker_id
                    self._init_deadline = now + self._init_timeout
                    must_init = True
            return RegisterResult(worker.worker_id, worker.generation, must_init, self._version)

    def _check_worker(self, worker_id: int, generation: int) -> _Worker:
        # Caller holds _lock.
        for worker in self._workers.values():
            if worker.worker_id == worker_id:
                if generation != worker.generation:
                    raise PreconditionError(
                        f"worker {worker.name!r} (id {worker_id}) sent generation {generation}, "
                        f"but its current generation is {worker.generation}: re-register"
                    )
                worker.last_seen = time.time()
                return worker
        raise PreconditionError(f"worker id {worker_id} is not registered with this shard: register first")

    # -- uploads ----------------------------------------------------------------------------

    def upload_parts(self, header_parts: Sequence[Part], *, initialize: bool) -> list[Part]:
        """Validate the parts an Initialize or Push stream announces, before any bytes arrive.

        An initialisation must list every part of the shard, in order; a push lists a subset of
        them without repeats. Raises ``InvalidArgumentError`` naming the offending variable, or
        ``NotReadyError`` / ``PreconditionError`` when the shard has no job yet.
        """
        with self._lock:
            if self._job is None:
                raise PreconditionError("this shard has no job yet: register first")
            expected = {p.key: p for p in self._job.parts}
        if not header_parts:
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
                    f"variable {part.key!r} has dtype {dtype_name(known.dtype)}, "
                    f"got {dtype_name(part.dtype)}"
                )
            if part.full_shape != known.full_shape:
                raise InvalidArgumentError(
                    f"variable {part.key!r} has shape {list(known.full_shape)}, "
                    f"got {list(part.full_shape)}"
                )
            if part.key in seen:
                raise InvalidArgumentError(f"variable {part.key!r} is listed twice")
            seen.add(part.key)
        if initialize and [p.key for p in header_parts] != list(expected):
            raise InvalidArgumentError(
                "initialisation must list every variable of the shard in placement order"
            )
        return [expected[p.key] for p in header_parts]

    def initialize(self, worker_id: int, generation: int, values: Sequence[torch.Tensor]) -> tuple[bool, int]:
        """Adopt ``values`` (one tensor per part, in order; ownership passes to the store) as the
        initial variables. Returns ``(applied, version)``; ``applied`` is False when another
        worker's upload won. Raises ``InvalidArgumentError`` for non-finite values."""
        with self._lock:
            job = self._job
        if job is None:
            raise PreconditionError("this shard has no job yet: register first")
        for part, value in zip(job.parts, values, strict=True):
            _check_finite(part, value, "initial value")
        with self._lock:
            self._check_worker(worker_id, generation)
            if self._state is ShardState.READY:
                return False, self._version
            assert self._rule is not None
            self._slots = {
                part.key: _Slot(part, value, self._rule.init_state(value))
                for part, value in zip(job.parts, values)
            }
            self._state = ShardState.READY
            self._ready.notify_all()
            log.info("initialised %d parts by worker id %d", len(self._slots), worker_id)
            return True, self._version

    def apply_push(
        self,
        worker_id: int,
        generation: int,
        sequence: int,
        base_version: int,
        parts: Sequence[Part],
        grads: Sequence[torch.Tensor],
    ) -> tuple[int, int]:
        """Apply one push atomically: every part's update, or none. Returns ``(version,
        staleness)``. A push whose ``sequence`` this worker generation already had applied is
        acknowledged again (with its original reply when still remembered) and not re-applied. Raises ``InvalidArgumentError`` for non-finite gradients or a base version
        from the future, ``NotReadyError`` before initialisation, ``PreconditionError`` for an
        unknown worker or a stale generation."""
        for part, grad in zip(parts, grads, strict=True):
            _check_finite(part, grad, "gradient")
        with self._lock:
            self._pushes_received += 1
            if self._state is not ShardState.READY:
                raise NotReadyError("this shard is not initialised yet")
            worker = self._check_worker(worker_id, generation)
            if 0 < sequence <= worker.max_sequence:
                log.info("push %d of %s already applied; acknowledged again", sequence, worker.name)
                return worker.applied.get(sequence, (self._version, 0))
            if base_version > self._version or base_version < 0:
                raise InvalidArgumentError(
                    f"base version {base_version} is not a version of this shard (now {self._version})"
                )
            assert self._rule is not None
            staleness = self._version - base_version
            self._version += 1
            for part, grad in zip(parts, grads):
                slot = self._slots[part.key]
                self._rule.apply(slot.value, grad, slot.state)
                slot.version = self._version
            self._pushes_applied += 1
            self._max_staleness = max(self._max_staleness, staleness)
            worker.pushes += 1
            if sequence > 0:
                worker.max_sequence = sequence
                worker.applied[sequence] = (self._version, staleness)
                if len(worker.applied) > self._dedupe_window:
                    del worker.applied[next(iter(worker.applied))]
            return self._version, staleness

    def note_rejected(self) -> None:
        with self._lock:
            self._pushes_rejected += 1

    # -- reads ------------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> None:
        """Block until initialised; raises ``NotReadyError`` after ``timeout`` seconds."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._state is ShardState.READY, timeout=timeout):
                who = f" (waiting for worker id {self._initializer})" if self._initializer else ""
                raise NotReadyError(f"shard not initialised after {timeout:.1f}s{who}")

    def pull(
        self, known_versions: Mapping[str, int], *, chunk_bytes: int, timeout: float
    ) -> tuple[int, list[PulledPart]]:
        """A consistent snapshot of every part, cut into chunks; parts whose version equals
        ``known_versions[key]`` are skipped. Waits up to ``timeout`` for initialisation; raises
        ``NotReadyError`` at once when too many pulls are waiting already."""
        with self._lock:
            ready = self._state is ShardState.READY
            if not ready:
                if self._waiting_pulls >= self._max_waiting_pulls:
                    raise NotReadyError(
                        f"shard not initialised yet ({self._waiting_pulls} pulls already waiting); retry"
                    )
                self._waiting_pulls += 1
        if not ready:
            try:
                self.wait_ready(timeout)
            finally:
                with self._lock:
                    self._waiting_pulls -= 1
        with self._lock:
            out = []
            for key, slot in self._slots.items():
                if known_versions.get(key) == slot.version:
                    out.append(PulledPart(slot.part, slot.version, None))
                    continue
                view = tensor_bytes(slot.value)
                chunks = [bytes(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]
                out.append(PulledPart(slot.part, slot.version, chunks))
            self._pulls_served += 1
            return self._version, out

    def status(self) -> dict:
        """Plain-data view of the shard for ``psctl status``."""
        with self._lock:
            job = self._job
            return {
                "state": self._state.value,
                "shard_index": job.shard_index if job else -1,
                "num_shards": job.num_shards if job else 0,
                "placement_digest": job.placement_digest if job else "",
                "job_fingerprint": job.job_fingerprint if job else "",
                "optimizer": job.optimizer if job else None,
                "parts": list(job.parts) if job else [],
                "version": self._version,
                "bytes_held": sum(p.nbytes for p in job.parts) if job else 0,
                "optimizer_state_bytes": sum(
                    t.numel() * t.element_size() for s in self._slots.values() for t in s.state.values()
                ),
                "workers": [
                    {"worker_id": w.worker_id, "worker_name": w.name, "generation": w.generation,
                     "pushes": w.pushes, "last_seen_unix": w.last_seen}
                    for w in self._workers.values()
                ],
                "pushes_received": self._pushes_received,
                "pushes_applied": self._pushes_applied,
                "pushes_rejected": self._pushes_rejected,
                "pulls_served": self._pulls_served,
                "max_staleness": self._max_staleness,
                "uptime_seconds": self._clock() - self._started,
            }

    def tensor(self, key: str) -> torch.Tensor:
        """A copy of one part's current value (for tests and tools)."""
        with self._lock:
            return self._slots[key].value.clone()


def _check_parts(parts: Sequence[Part]) -> None:
    if not parts:
        raise InvalidArgumentError("registration lists no variables for this shard")
    keys = [p.key for p in parts]
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError("registration lists a variable twice")


def _check_finite(part: Part, value: torch.Tensor, what: str) -> None:
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise InvalidArgumentError(f"{what} for {part.key!r} contains NaN or Inf")


def _check_same_job(job: _Job, reg: Registration) -> None:
    if reg.num_shards != job.num_shards or reg.shard_index != job.shard_index:
        raise PreconditionError(
            f"this shard is shard {job.shard_index} of {job.num_shards}, but the worker addressed "
            f"it as shard {reg.shard_index} of {reg.num_shards}: give every worker the same "
            "--ps list in the same order"
        )
    mine = {p.key: p for p in job.parts}
    theirs = {p.key: p for p in reg.parts}
    by_name_mine = {p.name: p for p in job.parts}
    for part in reg.parts:
        known = mine.get(part.key) or by_name_mine.get(part.name)
        if known is None:
            raise PreconditionError(f"variable {part.name!r} is not in the job's model")
        if known.full_shape != part.full_shape or known.dtype != part.dtype:
            raise PreconditionError(
                f"variable {part.name!r} is {dtype_name(known.dtype)}{list(known.full_shape)} in the "
                f"job but {dtype_name(part.dtype)}{list(part.full_shape)} in the worker's model"
            )
    missing = [k for k in mine if k not in theirs]
    if missing or [p.key for p in reg.parts] != list(mine):
        raise PreconditionError(
            f"the worker's model lacks variable(s) {', '.join(missing) or '(order differs)'} of the job"
        )
    if reg.placement_digest != job.placement_digest:
        raise PreconditionError(
            "the worker's placement differs from the job's on another shard: its model or "
            "shard count disagrees"
        )
    diffs = job.optimizer.differences(reg.optimizer)
    if diffs:
        raise PreconditionError("optimizer settings differ from the job's: " + "; ".join(diffs))
    if reg.job_fingerprint != job.job_fingerprint:
        raise PreconditionError(
            f"job {reg.job_fingerprint!r} differs from the job this shard serves ({job.job_fingerprint!r})"
        )


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"
