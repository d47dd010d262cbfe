"""Leases and eviction, driven by an injected clock (no sleeping)."""

import threading
import time

import numpy as np
import pytest

from pswire.codec import Part
from pswire.consistency import Consistency
from pswire.dtypes import FLOAT32
from pswire.errors import DeadlineError, FencedError
from pswire.optim import OptimizerConfig
from psserver.job import Registration
from psserver.leases import expired
from psserver.store import ShardStore

pytestmark = pytest.mark.timeout(60)

PART = Part("w", (2,), FLOAT32, 0, 2)
F32 = FLOAT32.numpy


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _reg(name: str, consistency: Consistency) -> Registration:
    return Registration(
        worker_name=name, shard_index=0, num_shards=1, placement_digest="d", parts=(PART,),
        optimizer=OptimizerConfig(name="sgd", lr=1.0), consistency=consistency,
    )


def test_expired_is_pure_and_ordered():
    heard = {"a": 10.0, "b": 4.0, "c": 9.0}
    assert expired(heard, now=20.0, timeout=10.0) == ["b", "c"]
    assert expired(heard, now=20.0, timeout=None) == []
    assert expired({}, now=1e9, timeout=1.0) == []


def test_silent_worker_is_evicted_fenced_and_can_rejoin():
    clock = FakeClock()
    store = ShardStore(lease_timeout=5.0, clock=clock)
    ssp = Consistency(mode="ssp", staleness=0)
    a = store.register(_reg("a", ssp))
    b = store.register(_reg("b", ssp))
    store.initialize(a.worker_id, a.generation, [np.zeros(2, dtype=F32)])

    # a pushes clock 0; its next pull (clock 1) must wait for b, still at clock 0.
    store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [np.ones(2, dtype=F32)], clock=0, base_clock=0)
    with pytest.raises(DeadlineError, match="waiting for b"):
        store.pull({}, timeout=0.0, worker_id=a.worker_id, generation=a.generation, clock=1)

    clock.now += 3.0
    assert store.heartbeat(a.worker_id, a.generation) == 5.0
    assert store.evict_expired() == []
    clock.now += 3.0  # b silent for 6s > 5s; a heard 3s ago
    assert store.evict_expired() == ["b"]
    status = store.status()
    assert status["workers_evicted"] == 1
    assert {w["worker_name"]: (w["live"], w["evicted"]) for w in status["workers"]} == {
        "a": (True, False), "b": (False, True)}

    # b no longer holds a back.
    snapshot = store.pull({}, timeout=0.0, worker_id=a.worker_id, generation=a.generation, clock=1)
    assert snapshot.clock == 1

    # b's late push and heartbeat are fenced off; nothing changes.
    version = store.status()["version"]
    with pytest.raises(FencedError, match="evicted"):
        store.apply_push(b.worker_id, b.generation, 1, 0, [PART], [np.ones(2, dtype=F32)], clock=0, base_clock=0)
    with pytest.raises(FencedError, match="re-register"):
        store.heartbeat(b.worker_id, b.generation)
    # ... and so is its training pull, which would otherwise wait on a clock nobody advances.
    with pytest.raises(FencedError, match="evicted"):
        store.pull({}, timeout=0.0, worker_id=b.worker_id, generation=b.generation, clock=1)
    assert store.status()["version"] == version

    # b re-registers: a new generation, starting at the shard's clock.
    again = store.register(_reg("b", ssp))
    assert again.generation == b.generation + 1 and again.clock == 1
    store.apply_push(b.worker_id, again.generation, 1, 0, [PART], [np.ones(2, dtype=F32)], clock=1, base_clock=1)


def test_eviction_completes_an_open_sync_clock():
    clock = FakeClock()
    store = ShardStore(lease_timeout=5.0, clock=clock)
    sync = Consistency(mode="sync")
    a = store.register(_reg("a", sync))
    b = store.register(_reg("b", sync))
    store.initialize(a.worker_id, a.generation, [np.zeros(2, dtype=F32)])
    result = store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [np.full(2, 2.0, dtype=F32)], clock=0)
    assert result.action.value == "accumulate" and store.status()["version"] == 0
    clock.now += 6.0
    store.heartbeat(a.worker_id, a.generation)
    assert store.evict_expired() == ["b"]
    # The clock closed with a's gradient alone: one aggregate, applied once.
    assert store.status()["version"] == 1 and store.status()["clock"] == 1
    np.testing.assert_array_equal(store.tensor("w"), np.full(2, -2.0, dtype=F32), strict=True)


def test_no_eviction_without_a_lease():
    clock = FakeClock()
    store = ShardStore(clock=clock)
    store.register(_reg("a", Consistency()))
    clock.now += 1e6
    assert store.evict_expired() == []


def test_a_pull_waiting_on_the_bound_ends_when_its_registration_is_void():

    store = ShardStore(lease_timeout=5.0)
    ssp = Consistency(mode="ssp", staleness=0)
    a = store.register(_reg("a", ssp))
    b = store.register(_reg("b", ssp))
    store.initialize(a.worker_id, a.generation, [np.zeros(2, dtype=F32)])
    store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [np.ones(2, dtype=F32)], clock=0, base_clock=0)
    outcome: list[BaseException] = []

    def waiting_pull() -> None:
        try:
            store.pull({}, timeout=30.0, worker_id=a.worker_id, generation=a.generation, clock=1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    reader = threading.Thread(target=waiting_pull)
    reader.start()
    deadline = time.monotonic() + 10
    while store.status()["pulls_waiting"] == 0:
        assert time.monotonic() < deadline, "the pull never started waiting"
        reader.join(timeout=0.01)
    store.register(_reg("a", ssp))  # a joins again (e.g. after a restore): the old pull is void
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], FencedError), outcome


def test_a_shard_that_lost_its_state_fences_its_former_workers():
    """A shard restarted without a checkpoint knows no job and no workers: their pushes and
    pulls are told to register again (which re-initialises it) instead of failing or waiting."""
    store = ShardStore(lease_timeout=5.0)
    with pytest.raises(FencedError, match="register again"):
        store.upload_parts([PART], initialize=False)
    with pytest.raises(FencedError, match="register again"):
        store.pull({}, timeout=5.0, worker_id=3, generation=1, clock=-1)
    # A fresh worker (no id yet) and an initialisation are not fenced: they define the job.
    fresh = store.register(_reg("a", Consistency()))
    assert fresh.must_initialize
