"""A real ``ShardStore``, driven directly (no gRPC) through arbitrary interleavings of pulls,
pushes, retried pushes, departures and re-registrations, against a reference model (the model,
and what it predicts for each step, are in ``store_model``; its docstring says how it computes).

This module holds the state machine's rules and invariants, and runs it for each consistency
mode: async, SSP and sync. Single scenarios of the same store are in ``test_store_scenarios``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from psserver.consistency import Consistency, Mode, StalePolicy
from pswire.errors import InvalidArgumentError, PreconditionError
from tests.unit.store_model import DEDUPE_WINDOW, F64, NAMES, StoreModel

pytestmark = pytest.mark.timeout(300)

MACHINE = settings(max_examples=75, stateful_step_count=40, deadline=None)


class StoreMachine(StoreModel):
    """Subclasses set ``CONSISTENCY``, a strategy of the job's setting."""

    # -- rules --------------------------------------------------------------------------------

    @precondition(lambda self: self.live())
    @rule(data=st.data(), use_known=st.booleans())
    def pull(self, data, use_known):
        """A live worker reads at its own clock, without waiting."""
        self.do_pull(self.pick(data, self.live()), use_known)

    @precondition(lambda self: any(w.live and w.pulled for w in self.workers.values()))
    @rule(data=st.data())
    def push(self, data):
        """A worker that pulled pushes a gradient (or, in ssp/sync, just its clock) for its clock,
        based on what it pulled; after a re-registration that pull may be from its old generation."""
        self.do_push(self.pick(data, [w for w in self.live() if w.pulled]), data)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), use_known=st.booleans(), overlapped=st.booleans())
    def round(self, data, use_known, overlapped):
        """A training round: every live worker pulls and (when its pull succeeds) pushes, either
        one after the other or all pulls first and then the pushes in any order."""
        self.do_round(data, use_known, overlapped)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), steps=st.integers(1, 6))
    def run_ahead(self, data, steps):
        """One worker trains alone for a few steps, until a pull of it would have to wait."""
        worker = self.pick(data, self.live())
        for _ in range(steps):
            if not self.do_pull(worker, use_known=True):
                break
            self.do_push(worker, data)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), rounds=st.integers(0, 6), overlapped=st.booleans())
    def away_and_back(self, data, rounds, overlapped):
        """A worker reads, leaves (its lease expired, say) while the others train on, then
        re-registers and pushes the gradient it computed from that old read."""
        worker = self.pick(data, self.live())
        self.do_pull(worker, use_known=False)
        self.store.leave(worker.worker_id, worker.generation)
        worker.live = False
        self.membership_changed()
        for _ in range(rounds):
            self.do_round(data, use_known=True, overlapped=overlapped)
        self._register(worker.name, must_initialize=False)
        if worker.pulled is not None:
            self.do_push(worker, data)

    @precondition(lambda self: any(w.live and w.history for w in self.workers.values()))
    @rule(data=st.data())
    def retry(self, data):
        """A push is sent again (its reply was lost): acknowledged with the same reply, not re-applied."""
        worker = self.pick(data, [w for w in self.live() if w.history])
        sequence = data.draw(st.sampled_from(sorted(worker.history)), label="sequence")
        args, reply = worker.history[sequence]
        before = self.observable()
        if sequence not in list(worker.history)[-DEDUPE_WINDOW:]:
            # Past the window the reply is forgotten: the push is refused, never re-applied, and
            # never acknowledged as applied (its outcome is no longer known).
            event("retry past the window")
            with pytest.raises(PreconditionError, match="not known"):
                self.store.apply_push(**{**args, "grads": [g.copy() for g in args["grads"]]})
            self.pushes_received += 1
            self.rejected += 1
            self.assert_unchanged(before)
            return
        result = self.store.apply_push(**{**args, "grads": [g.copy() for g in args["grads"]]})
        self.pushes_received += 1
        self.retries += 1
        assert result == reply
        self.assert_unchanged(before)

    @precondition(lambda self: self.mode is not Mode.ASYNC and any(w.live and w.clock > 0 for w in self.workers.values()))
    @rule(data=st.data())
    def push_for_a_past_clock(self, data):
        """A push tagged with a clock the worker has already passed is refused, changing nothing."""
        worker = self.pick(data, [w for w in self.live() if w.clock > 0])
        before = self.observable()
        with pytest.raises(InvalidArgumentError, match=f"already at clock {worker.clock}"):
            self.store.apply_push(
                worker.worker_id, worker.generation, worker.sequence + 1, self.version,
                [self.parts[0]], [np.ones(self.parts[0].shape, dtype=F64.numpy)],
                clock=worker.clock - 1, base_clock=self.current_clock(),
            )
        self.pushes_received += 1
        self.rejected += 1
        self.assert_unchanged(before)

    @precondition(lambda self: any(not w.live or w.generation > 1 for w in self.workers.values()))
    @rule(data=st.data())
    def departed_or_stale_generation_is_refused(self, data):
        """A departed worker, or an old generation of a re-registered one, cannot push or leave."""
        worker = self.pick(data, [w for w in self.workers.values() if not w.live or w.generation > 1])
        generation = worker.generation if not worker.live else worker.generation - 1
        before = self.observable()
        with pytest.raises(PreconditionError, match="re-register"):
            self.store.apply_push(
                worker.worker_id, generation, worker.sequence + 1, self.version,
                [self.parts[0]], [np.ones(self.parts[0].shape, dtype=F64.numpy)],
                clock=worker.clock, base_clock=self.current_clock(),
            )
        with pytest.raises(PreconditionError, match="re-register"):
            self.store.leave(worker.worker_id, generation)
        self.pushes_received += 1
        self.rejected += 1
        self.assert_unchanged(before)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def leave(self, data):
        worker = self.pick(data, self.live())
        self.store.leave(worker.worker_id, worker.generation)
        worker.live = False
        self.membership_changed()

    @precondition(lambda self: self.workers)
    @rule(data=st.data())
    def reregister(self, data):
        """A worker (departed or not) registers again: a new generation at the shard's clock. It
        keeps what it last pulled, so its next push may be based on a much older clock."""
        worker = self.pick(data, list(self.workers.values()))
        self._register(worker.name, must_initialize=False)

    @precondition(lambda self: len(self.workers) < len(NAMES))
    @rule()
    def join(self):
        self._register(NAMES[len(self.workers)], must_initialize=False)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def status_matches_the_model(self):
        status = self.store.status()
        assert status["state"] == "ready"
        assert status["version"] == self.version
        assert status["clock"] == self.current_clock()
        assert status["pushes_received"] == self.pushes_received
        assert status["pushes_applied"] == self.applied_pushes + self.aggregates
        assert status["pushes_dropped"] == self.dropped
        assert status["pushes_scaled"] == self.scaled
        assert status["pushes_rejected"] == 0  # counted by the servicer only
        assert status["pulls_served"] == self.pulls_served
        assert status["pulls_waiting"] == 0
        assert status["max_staleness"] == self.max_staleness
        assert status["staleness_histogram"] == self.histogram
        workers = {
            w["worker_name"]: (w["worker_id"], w["generation"], w["clock"], w["live"], w["pushes"])
            for w in status["workers"]
        }
        assert workers == {
            w.name: (w.worker_id, w.generation, w.clock, w.live, w.pushes) for w in self.workers.values()
        }

    @invariant()
    def every_push_is_accounted_for(self):
        status = self.store.status()
        assert status["pushes_received"] == (
            status["pushes_applied"] - self.aggregates + status["pushes_dropped"]
            + self.accumulated + self.noop_pushes + self.retries + self.rejected
        )

    @invariant()
    def held_snapshots_never_change(self):
        """A pull's snapshot holds the variables without a copy; updates go to copies meanwhile."""
        for snapshot, values in self.held:
            for pulled in snapshot.parts:
                if pulled.value is not None:
                    np.testing.assert_array_equal(pulled.value, values[pulled.part.key], strict=True)

    @invariant()
    def variables_equal_the_reference(self):
        for key in self.keys:
            np.testing.assert_array_equal(self.store.tensor(key), self.params[key], err_msg=key, strict=True)

    @invariant()
    def versions_and_clocks_never_go_back(self):
        status = self.store.status()
        assert status["version"] >= self.last_version
        self.last_version = status["version"]
        assert status["clock"] >= self.last_clock
        self.last_clock = status["clock"]

    @invariant()
    def the_bound_holds(self):
        status = self.store.status()
        if self.mode is Mode.SSP and self.scaled == 0:
            # Dropped pushes are not applied, so nothing applied was staler than S.
            assert status["max_staleness"] <= self.cons.staleness
        if self.mode is Mode.SYNC:
            # One aggregate per clock, nothing else changes the variables.
            assert status["version"] == self.open_clock == self.aggregates == status["clock"]
            assert status["max_staleness"] == 0
            # A reached quorum is applied at once, by the push or the departure that reached it.
            assert self.live_contributors() < self.quorum() or self.quorum_left_open
            assert self.received == len(self.contributors)


class AsyncMachine(StoreMachine):
    CONSISTENCY = st.just(Consistency(mode=Mode.ASYNC))


class SspMachine(StoreMachine):
    CONSISTENCY = st.builds(
        Consistency, mode=st.just(Mode.SSP), staleness=st.integers(0, 3), stale_policy=st.sampled_from(list(StalePolicy))
    )


class SyncMachine(StoreMachine):
    CONSISTENCY = st.builds(Consistency, mode=st.just(Mode.SYNC), backup_workers=st.integers(0, 1))


def test_async_store_agrees_with_the_model():
    run_state_machine_as_test(AsyncMachine, settings=MACHINE)


def test_ssp_store_agrees_with_the_model():
    run_state_machine_as_test(SspMachine, settings=MACHINE)


def test_sync_store_agrees_with_the_model():
    run_state_machine_as_test(SyncMachine, settings=MACHINE)
