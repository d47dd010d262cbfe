"""The reference model that ``test_store_machine`` checks a real ``ShardStore`` against, and the
registrations, shapes and gradients it draws (``test_store_scenarios`` uses the registrations too).

The model keeps every variable in float64 and updates it with SGD at lr=1, so after any run a
variable equals its initial value less the sum of the (scaled, or averaged per sync clock)
gradients the shard applied. It computes each update with the numpy operations of
``psserver.optimizers.Sgd`` (``param += -lr * grad``, a sync mean as ``sum / count``), so the
store's variables must equal it bit for bit. Expected outcomes are derived from the rules of DESIGN.md §4 and
``psserver.consistency``'s docstring, and the pure decisions are checked to agree with them.
Sync clocks take one gradient per worker (a re-registered worker's second one is dropped), and
only live senders fill a quorum, while a departed sender's gradient still joins the mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize

from psserver.consistency import Consistency, Mode, PushAction, StalePolicy, decide_pull, decide_push, sync_quorum
from psserver.store import PushResult, Registration, ShardStore
from pswire.codec import Part
from pswire.dtypes import FLOAT64
from pswire.errors import DeadlineError
from pswire.optim import OptimizerConfig

SGD = OptimizerConfig(name="sgd", lr=1.0)
F64 = FLOAT64
NAMES = ("w0", "w1", "w2", "w3")
DEDUPE_WINDOW = 8  # small, so that retries of forgotten pushes happen too
WORKER_FIELDS = ("worker_id", "worker_name", "generation", "pushes", "clock", "live")
COUNTERS = (
    "state", "version", "clock", "pushes_applied", "pushes_rejected", "pushes_dropped", "pushes_scaled",
    "pulls_served", "pulls_waiting", "max_staleness", "staleness_histogram",
)


# -- strategies -------------------------------------------------------------------------------


@st.composite
def part_specs(draw) -> list[Part]:
    parts = []
    for i in range(draw(st.integers(1, 3))):
        name = f"v{i}"
        kind = draw(st.sampled_from(["scalar", "vector", "matrix", "slice"]))
        if kind == "scalar":
            parts.append(Part(name, (), F64, 0, 1))
        elif kind == "vector":
            n = draw(st.integers(1, 4))
            parts.append(Part(name, (n,), F64, 0, n))
        elif kind == "matrix":
            r, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
            parts.append(Part(name, (r, c), F64, 0, r))
        else:
            rows, c = draw(st.integers(2, 5)), draw(st.integers(1, 3))
            start = draw(st.integers(0, rows - 1))
            parts.append(Part(name, (rows, c), F64, start, draw(st.integers(start + 1, rows))))
    return parts


def integer_tensor(shape: tuple[int, ...], bound: int):
    numel = 1
    for n in shape:
        numel *= n
    return st.lists(st.integers(-bound, bound), min_size=numel, max_size=numel).map(
        lambda xs: np.array(xs, dtype=F64.numpy).reshape(shape)
    )


def registration(name: str, parts: list[Part], consistency: Consistency) -> Registration:
    return Registration(
        worker_name=name, shard_index=0, num_shards=1, placement_digest="digest",
        parts=tuple(parts), optimizer=SGD, job_fingerprint="job", consistency=consistency,
    )


# -- the model --------------------------------------------------------------------------------


@dataclass
class Pulled:
    version: int
    clock: int
    """The shard clock of the snapshot (the push's base clock)."""
    at_clock: int
    """The clock the worker read at."""
    generation: int


@dataclass
class WorkerModel:
    name: str
    worker_id: int
    generation: int = 1
    clock: int = 0
    live: bool = True
    pushes: int = 0
    sequence: int = 0
    pulled: Pulled | None = None
    known: dict[str, int] = field(default_factory=dict)
    history: dict[int, tuple[dict, PushResult]] = field(default_factory=dict)
    """This generation's pushes: sequence -> (apply_push arguments, reply)."""


class StoreModel(RuleBasedStateMachine):
    """The shard as the model sees it, and the steps (a pull, a push, a round) that drive the store
    and check each reply against the model; ``test_store_machine.StoreMachine`` adds the rules
    that take them, and the invariants.

    Subclasses set ``CONSISTENCY``, a strategy of the job's setting."""

    CONSISTENCY: st.SearchStrategy[Consistency]

    # -- setup --------------------------------------------------------------------------------

    @initialize(data=st.data(), parts=part_specs(), workers=st.integers(2, 4), early=st.booleans())
    def setup(self, data, parts, workers, early):
        self.cons: Consistency = data.draw(self.CONSISTENCY, label="consistency")
        self.held: list = []
        """Unreleased pull snapshots and copies of their values when taken."""
        self.mode = self.cons.mode
        self.parts = parts
        self.keys = [p.key for p in parts]
        self.part = {p.key: p for p in parts}
        self.store = ShardStore(dedupe_window=DEDUPE_WINDOW)
        self.workers: dict[str, WorkerModel] = {}
        self.next_id = 1
        # The shard as the model sees it.
        self.version = 0
        self.part_version = dict.fromkeys(self.keys, 0)
        self.open_clock = 0
        self.floor = 0
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.received = 0
        self.contributors: set[str] = set()
        self.quorum_left_open = False
        """A departed sender re-registered and so completed the open clock: register() does not
        apply it, the next push or departure does."""
        self.aggregates = 0
        # Counters, by outcome.
        self.pushes_received = 0
        self.applied_pushes = 0  # async/ssp pushes with parts that changed the variables
        self.noop_pushes = 0  # async/ssp clock-only pushes that were not dropped
        self.dropped = 0
        self.scaled = 0
        self.accumulated = 0
        self.retries = 0
        self.rejected = 0
        self.pulls_served = 0
        self.max_staleness = 0
        self.histogram = [0] * 17
        self.last_version = 0
        self.last_clock = 0

        self._register(NAMES[0], must_initialize=True)
        if early:  # the others join while the first is still initialising
            for name in NAMES[1:workers]:
                self._register(name, must_initialize=False)
        initial = [data.draw(integer_tensor(p.shape, 8), label=f"initial {p.key}") for p in parts]
        self.params = {p.key: t.copy() for p, t in zip(parts, initial)}
        first = self.workers[NAMES[0]]
        assert self.store.initialize(first.worker_id, first.generation, initial) == (True, 0)
        if not early:
            for name in NAMES[1:workers]:
                self._register(name, must_initialize=False)

    # -- helpers ------------------------------------------------------------------------------

    def live(self) -> list[WorkerModel]:
        return [w for w in self.workers.values() if w.live]

    def member_clocks(self) -> dict[str, int]:
        return {w.name: w.clock for w in self.live()}

    def current_clock(self) -> int:
        if self.mode is Mode.SYNC:
            return self.open_clock
        members = self.member_clocks()
        return max(self.floor, min(members.values())) if members else self.floor

    def quorum(self) -> int:
        return sync_quorum(self.cons, len(self.live()))

    def live_contributors(self) -> int:
        # Gradients of workers that left still join the mean; only live senders fill a quorum.
        return sum(self.workers[name].live for name in self.contributors)

    def membership_changed(self) -> None:
        self.floor = self.current_clock()
        self.quorum_left_open = False
        if self.mode is Mode.SYNC and self.received and self.live_contributors() >= self.quorum():
            self.apply_aggregate()

    def apply_aggregate(self) -> None:
        self.version += 1
        for key, total in self.sums.items():
            mean = total / self.counts[key]
            self.params[key] += -SGD.lr * mean
            self.part_version[key] = self.version
        self.aggregates += 1
        event(f"aggregate of {self.received}")
        self.record_staleness(0)
        self.sums, self.counts, self.received = {}, {}, 0
        self.contributors = set()
        self.open_clock += 1

    def record_staleness(self, staleness: int) -> None:
        self.max_staleness = max(self.max_staleness, staleness)
        self.histogram[min(staleness, 16)] += 1

    def _register(self, name: str, *, must_initialize: bool) -> None:
        start = self.current_clock()
        worker = self.workers.get(name)
        result = self.store.register(registration(name, self.parts, self.cons))
        if worker is None:
            worker = WorkerModel(name, self.next_id, clock=start)
            self.next_id += 1
            self.workers[name] = worker
        else:
            worker.generation += 1
            worker.clock, worker.live = start, True
            worker.sequence = 0
            worker.history.clear()
        # register() re-checks membership like a departure does: a returning sync sender may
        # complete the open clock, which is then applied at once.
        self.membership_changed()
        got = (result.worker_id, result.generation, result.must_initialize, result.version, result.clock)
        assert got == (worker.worker_id, worker.generation, must_initialize, self.version, start)
        assert result.consistency == self.cons

    def pick(self, data, workers: list[WorkerModel]) -> WorkerModel:
        return self.workers[data.draw(st.sampled_from(sorted(w.name for w in workers)), label="worker")]

    def observable(self) -> tuple:
        """What a push that changes nothing must leave as it was (besides pushes_received)."""
        status = self.store.status()
        workers = [{k: w[k] for k in WORKER_FIELDS} for w in status["workers"]]
        counters = {k: status[k] for k in COUNTERS}
        tensors = {key: self.store.tensor(key) for key in self.keys}
        return counters, workers, tensors

    def assert_unchanged(self, before: tuple) -> None:
        after = self.observable()
        assert after[0] == before[0]
        assert after[1] == before[1]
        for key in self.keys:
            np.testing.assert_array_equal(after[2][key], before[2][key], err_msg=key, strict=True)

    # -- steps, each checked against the model ------------------------------------------------

    def do_round(self, data, use_known: bool, overlapped: bool) -> None:
        workers = sorted(self.live(), key=lambda w: w.name)
        if not overlapped:
            for worker in workers:
                if self.do_pull(worker, use_known):
                    self.do_push(worker, data)
            return
        pulled = [w for w in workers if self.do_pull(w, use_known)]
        for worker in data.draw(st.permutations(pulled), label="push order"):
            self.do_push(worker, data)

    def do_pull(self, worker: WorkerModel, use_known: bool) -> bool:
        clock = worker.clock
        members = self.member_clocks()
        if self.mode is Mode.ASYNC:
            proceed = True
        elif self.mode is Mode.SSP:
            proceed = all(c >= clock - self.cons.staleness for c in members.values())
        else:
            proceed = self.open_clock >= clock
        decision = decide_pull(self.cons, clock, members, self.open_clock)
        assert decision.proceed == proceed
        known = dict(worker.known) if use_known else {}
        call = dict(timeout=0.0, worker_id=worker.worker_id,
                    generation=worker.generation, clock=clock)
        if not proceed:
            event("pull refused")
            with pytest.raises(DeadlineError) as caught:
                self.store.pull(known, **call)
            message = str(caught.value)
            assert worker.name in message and f"clock {clock}" in message
            if self.mode is Mode.SSP:
                need = clock - self.cons.staleness
                slowest = min((c, n) for n, c in members.items() if c < need)
                assert decision.waiting_for == slowest[1]
                assert f"waiting for {slowest[1]}" in message
            return False
        snapshot = self.store.pull(known, **call)
        self.held.append((snapshot, {p.part.key: p.value.copy() for p in snapshot.parts if p.value is not None}))
        if len(self.held) > 2:  # the oldest is sent by now; the others stay held across updates
            self.held.pop(0)[0].release()
        self.pulls_served += 1
        assert snapshot.version == self.version
        assert snapshot.clock == self.current_clock()
        assert [p.part.key for p in snapshot.parts] == self.keys
        for pulled in snapshot.parts:
            key = pulled.part.key
            assert pulled.version == self.part_version[key]
            if known.get(key) == pulled.version:
                assert pulled.value is None
            else:
                assert pulled.value is not None
                np.testing.assert_array_equal(pulled.value, self.params[key], err_msg=key, strict=True)
        worker.pulled = Pulled(snapshot.version, snapshot.clock, clock, worker.generation)
        worker.known = {p.part.key: p.version for p in snapshot.parts}
        return True

    def do_push(self, worker: WorkerModel, data) -> None:
        pulled = worker.pulled
        assert pulled is not None
        keys = data.draw(
            st.lists(st.sampled_from(self.keys), unique=True, min_size=1 if self.mode is Mode.ASYNC else 0),
            label="keys",
        )
        grads = [data.draw(integer_tensor(self.part[k].shape, 4), label=f"grad {k}") for k in keys]
        clock = worker.clock
        sequence = worker.sequence + 1
        args = dict(
            worker_id=worker.worker_id, generation=worker.generation, sequence=sequence,
            base_version=pulled.version, parts=[self.part[k] for k in keys], grads=grads,
            clock=clock, base_clock=pulled.clock,
        )
        expected = self.expect_push(worker, keys, grads, clock, pulled)
        sent = [g.copy() for g in grads]
        result = self.store.apply_push(**{**args, "grads": sent})
        assert result == expected
        event(f"push {result.action.value}" + (" (stale)" if result.staleness > (self.cons.bound or 0) else ""))
        for g, s in zip(grads, sent):
            assert np.array_equal(g, s), "the store wrote into a gradient it was handed"
            s[...] = 1000  # the caller reuses its buffer, as the servicer does a receive buffer
        worker.sequence = sequence
        worker.history[sequence] = (args, result)
        worker.pulled = None

    def expect_push(self, worker: WorkerModel, keys, grads, clock: int, pulled: Pulled) -> PushResult:
        self.pushes_received += 1
        shard_clock = self.current_clock()
        if self.mode is Mode.ASYNC:
            staleness = self.version - pulled.version
        else:
            staleness = shard_clock - pulled.clock
        quorum, contributed = self.quorum(), self.live_contributors()
        if self.mode is Mode.ASYNC:
            action, scale = PushAction.APPLY, 1.0
        elif self.mode is Mode.SSP:
            if staleness <= self.cons.staleness:
                action, scale = PushAction.APPLY, 1.0
            elif self.cons.stale_policy is StalePolicy.DROP:
                action, scale = PushAction.DROP, 1.0
            else:
                action, scale = PushAction.SCALE, 1.0 / staleness
            if pulled.generation == worker.generation and pulled.at_clock == clock:
                # SSP's guarantee: a worker that read at its own clock and pushes that step is
                # never staler than S, whatever the others did meanwhile (they may have left).
                assert staleness <= self.cons.staleness
        else:
            accumulate = clock == self.open_clock and contributed < quorum
            action, scale = (PushAction.ACCUMULATE if accumulate else PushAction.DROP), 1.0
        decision = decide_push(
            self.cons, staleness, push_clock=clock, open_clock=self.open_clock, received=contributed, quorum=quorum
        )
        assert (decision.action, decision.lr_scale) == (action, scale)
        if action is PushAction.ACCUMULATE and worker.name in self.contributors:
            action = PushAction.DROP  # one gradient per worker and clock, even across generations

        if action is PushAction.ACCUMULATE:
            for key, grad in zip(keys, grads):
                self.sums[key] = self.sums[key] + grad if key in self.sums else grad.copy()
                self.counts[key] = self.counts.get(key, 0) + 1
            self.received += 1
            self.contributors.add(worker.name)
            self.accumulated += 1
        elif action is PushAction.DROP:
            self.dropped += 1
        elif keys:
            self.version += 1
            for key, grad in zip(keys, grads):
                self.params[key] += -(SGD.lr * scale) * grad
                self.part_version[key] = self.version
            self.applied_pushes += 1
            self.scaled += action is PushAction.SCALE
            self.record_staleness(staleness)
        else:
            self.noop_pushes += 1
        worker.pushes += 1
        worker.clock = max(worker.clock, clock + 1)
        result = PushResult(self.version, staleness, action)
        self.membership_changed()
        return result
