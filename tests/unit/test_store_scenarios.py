"""A real ``ShardStore``, driven directly (no gRPC) through one scenario each: the membership edge
cases (the async clock when the last worker leaves, a sync clock's one gradient per worker across
re-registration, a sync clock waiting for live workers after a contributor leaves) and the
checkpoint cuts taken as the clock reaches each multiple. The state machine that drives the
store through arbitrary interleavings is in ``test_store_machine``.
"""

from __future__ import annotations

import numpy as np
import pytest

from psserver.consistency import Consistency, Mode, PushAction
from psserver.store import PushResult, RegisterResult, ShardStore
from pswire.codec import Part
from tests.unit.store_model import F64, registration

pytestmark = pytest.mark.timeout(300)

ONE = [Part("v", (2,), F64, 0, 2)]


def _job(consistency: Consistency, *names: str) -> tuple[ShardStore, dict[str, RegisterResult]]:
    store = ShardStore()
    workers = {name: store.register(registration(name, ONE, consistency)) for name in names}
    first = workers[names[0]]
    assert store.initialize(first.worker_id, first.generation, [np.zeros(2, dtype=F64.numpy)]) == (True, 0)
    return store, workers


def _step(store: ShardStore, worker: RegisterResult, clock: int, sequence: int, grad: float) -> PushResult:
    snapshot = store.pull({}, timeout=0.0, worker_id=worker.worker_id,
                          generation=worker.generation, clock=clock)
    return store.apply_push(
        worker.worker_id, worker.generation, sequence, snapshot.version, ONE, [np.full(2, grad, dtype=F64.numpy)],
        clock=clock, base_clock=snapshot.clock,
    )


def test_async_shard_clock_holds_when_the_last_worker_leaves():
    """shard_clock's floor keeps the clock from going back when the membership empties."""
    store, workers = _job(Consistency(mode=Mode.ASYNC), "a")
    a = workers["a"]
    for clock in range(3):
        _step(store, a, clock, clock + 1, 1.0)
    assert store.status()["clock"] == 3
    store.leave(a.worker_id, a.generation)
    assert store.status()["clock"] == 3
    assert store.register(registration("a", ONE, Consistency(mode=Mode.ASYNC))).clock == 3


def test_sync_clock_takes_one_gradient_per_worker_across_re_registration():
    """A worker that re-registers after pushing for the open clock cannot fill the quorum twice."""
    consistency = Consistency(mode=Mode.SYNC)
    store, workers = _job(consistency, "a", "b")
    assert _step(store, workers["a"], 0, 1, 1.0).action is PushAction.ACCUMULATE
    again = store.register(registration("a", ONE, consistency))
    assert again.clock == 0
    assert _step(store, again, again.clock, 1, 3.0).action is PushAction.DROP
    assert store.status()["version"] == 0  # clock 0 still waits for b
    assert _step(store, workers["b"], 0, 1, 5.0).action is PushAction.ACCUMULATE
    assert store.status()["version"] == 1
    np.testing.assert_array_equal(store.tensor("v"), np.full(2, -3.0, dtype=F64.numpy), strict=True)  # mean of 1 and 5


def test_sync_clock_waits_for_live_workers_after_a_contributor_leaves():
    """A departed worker's gradient joins the mean but does not stand in for a live worker's."""
    store, workers = _job(Consistency(mode=Mode.SYNC), "a", "b")
    a, b = workers["a"], workers["b"]
    assert _step(store, a, 0, 1, 1.0).action is PushAction.ACCUMULATE
    store.leave(a.worker_id, a.generation)
    assert store.status()["version"] == 0
    assert _step(store, b, 0, 1, 5.0).action is PushAction.ACCUMULATE
    assert store.status()["version"] == 1
    np.testing.assert_array_equal(store.tensor("v"), np.full(2, -3.0, dtype=F64.numpy), strict=True)


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.ASYNC])
def test_checkpoint_cuts_copy_the_state_the_moment_the_clock_reaches_each_multiple(mode):
    """The writer may run late; a cut still holds the state at its clock, never a later one."""
    store, workers = _job(Consistency(mode=mode), "a")
    store.checkpoint_every(2)
    a = workers["a"]
    for clock in range(5):  # clocks 1..5 reached; cuts at 2 and 4
        _step(store, a, clock, clock + 1, 1.0)
    cuts = [store.next_cut(timeout=0.0) for _ in range(3)]
    assert cuts[2] is None
    for (checkpoint_id, (version, tensors, metadata)), expected in zip(cuts[:2], (2, 4)):
        assert checkpoint_id == metadata["clock"] == version == expected
        np.testing.assert_array_equal(tensors["var/v"], np.full(2, -1.0 * expected, dtype=F64.numpy), strict=True)
    assert store.status()["version"] == 5
