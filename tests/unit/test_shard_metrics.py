"""A shard's metrics from its store, without gRPC: every push counted under one outcome, the
applied-staleness histogram in the contract's buckets, workers by state, pulls that waited by the
worker they waited for, what a checkpoint keeps of them, and the ``--metrics-*`` settings.

Each test reads a fresh ``CollectorRegistry`` with ``get_sample_value``, never the global one.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from psserver.config import ServerConfig, parse_args
from psserver.consistency import Consistency, Mode, StalePolicy
from psserver.inflight import InflightBudget
from psserver.metrics import PUSH_OUTCOMES, STALENESS_BOUNDS, ShardCollector, metrics_url
from psserver.intake import Traffic
from psserver.state import STALENESS_BUCKETS, Counters
from psserver.store import NonFiniteError, Registration, ShardStore
from pswire.codec import Part
from pswire.dtypes import FLOAT64
from pswire.errors import DeadlineError, FencedError, InvalidArgumentError
from pswire.optim import OptimizerConfig
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(60)

SGD = OptimizerConfig(name="sgd", lr=1.0)
PART = Part("w", (2,), FLOAT64, 0, 2)
ONES = np.ones(2)


def registration(name: str, consistency: Consistency = Consistency()) -> Registration:
    return Registration(worker_name=name, shard_index=0, num_shards=1, placement_digest="digest", parts=(PART,),
                        optimizer=SGD, job_fingerprint="job", consistency=consistency)


class Clock:
    """The store's monotonic clock, moved on by hand (leases), still advancing (wait times)."""

    def __init__(self) -> None:
        import time

        self._monotonic = time.monotonic
        self.offset = 0.0

    def __call__(self) -> float:
        return self._monotonic() + self.offset


def job(*names: str, consistency: Consistency = Consistency(), **store_args):
    """A store with ``names`` registered and initialised (to ``initial``); returns it and the
    registrations by name."""
    store = ShardStore(**store_args)
    workers = {name: store.register(registration(name, consistency)) for name in names}
    first = workers[names[0]]
    assert store.initialize(first.worker_id, first.generation, [np.zeros(2)]) == (True, 0)
    return store, workers


def registry_of(store: ShardStore, **kwargs) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ShardCollector(store, traffic=Traffic(), budget=InflightBudget(0), checkpointer=None,
                                     **kwargs))
    return registry


def pushes(registry: CollectorRegistry) -> dict[str, float]:
    return {o: registry.get_sample_value("psserver_pushes_total", {"outcome": o}) for o in PUSH_OUTCOMES}


def refused(store: ShardStore, call) -> Exception:
    """Run a push the store refuses and count the refusal as the servicer does."""
    with pytest.raises(InvalidArgumentError if call.__name__ != "fenced" else FencedError) as info:
        call()
    store.note_rejected(info.value)
    return info.value


def test_every_push_is_counted_under_one_outcome():
    store, w = job("a", "b")
    a, b = w["a"], w["b"]
    for sequence in range(1, 21):  # every push based on version 0: staleness 0, 1, ..., 19
        assert store.apply_push(a.worker_id, a.generation, sequence, 0, [PART], [ONES]).staleness == sequence - 1
    assert store.apply_push(a.worker_id, a.generation, 20, 0, [PART], [ONES]).version == 20  # a retry

    def nonfinite():
        store.apply_push(b.worker_id, b.generation, 1, 20, [PART], [np.array([np.nan, 0.0])])

    def overflowing():  # a finite gradient whose update is not
        store.apply_push(b.worker_id, b.generation, 1, 20, [PART], [np.array([-1e308, 0.0])])
        store.apply_push(b.worker_id, b.generation, 2, 21, [PART], [np.array([-1e308, 0.0])])

    def bad_base_version():
        store.apply_push(b.worker_id, b.generation, 3, 99, [PART], [ONES])

    def fenced():
        store.apply_push(b.worker_id, b.generation + 1, 3, 21, [PART], [ONES])

    assert isinstance(refused(store, nonfinite), NonFiniteError)
    assert isinstance(refused(store, overflowing), NonFiniteError)
    assert not isinstance(refused(store, bad_base_version), NonFiniteError)
    refused(store, fenced)

    registry = registry_of(store)
    assert pushes(registry) == {"applied": 21, "scaled": 0, "dropped": 0, "duplicate": 1, "fenced": 1,
                                "nonfinite": 2, "rejected": 1}
    status = store.status()
    # Every push received counted once; psctl's pushes_rejected still counts every refusal.
    assert sum(pushes(registry).values()) == status["pushes_received"] == 26
    assert status["pushes_rejected"] == 4 and status["updates_nonfinite"] == 1

    # Staleness 0..19, and one of 0 (b's first push): the contract's buckets, cumulative.
    def bucket(le: str) -> float:
        return registry.get_sample_value("psserver_applied_staleness_bucket", {"le": le})

    assert [bucket(le) for le in ("0.0", "1.0", "2.0", "4.0", "8.0", "16.0", "+Inf")] == [2, 3, 4, 6, 10, 18, 21]
    assert registry.get_sample_value("psserver_applied_staleness_count") == 21
    assert registry.get_sample_value("psserver_applied_staleness_sum") == sum(range(20))
    assert registry.get_sample_value("psserver_version") == 21


def test_ssp_pushes_beyond_the_bound_are_scaled_or_dropped_and_pulls_count_who_they_waited_for():
    for policy, outcome in ((StalePolicy.SCALE, "scaled"), (StalePolicy.DROP, "dropped")):
        store, w = job("a", "b", consistency=Consistency(mode=Mode.SSP, staleness=1, stale_policy=policy))
        a, b = w["a"], w["b"]
        for clock in (0, 1):
            for worker in (a, b):
                store.apply_push(worker.worker_id, worker.generation, clock + 1, store.status()["version"],
                                 [PART], [ONES], clock=clock, base_clock=clock)
        # a pushes step 2 from what it read at clock 0: staleness 2 > S = 1.
        store.apply_push(a.worker_id, a.generation, 3, 0, [PART], [ONES], clock=2, base_clock=0)
        counted = pushes(registry_of(store))
        assert counted[outcome] == 1 and counted["applied"] == 4
        assert sum(counted.values()) == store.status()["pushes_received"] == 5

    # a goes on to clock 4 and reads there; b is at clock 2: with S = 1 the read waits for b.
    store.apply_push(a.worker_id, a.generation, 4, store.status()["version"], [PART], [ONES], clock=3, base_clock=2)
    with pytest.raises(DeadlineError, match="waiting for b"):
        store.pull({}, timeout=0.05, worker_id=a.worker_id, generation=a.generation, clock=4)
    registry = registry_of(store)
    assert registry.get_sample_value("psserver_pull_waits_total", {"worker": "b"}) == 1
    assert registry.get_sample_value("psserver_pull_waits_total", {"worker": "a"}) == 0  # there from the start
    assert registry.get_sample_value("psserver_pull_wait_seconds_total") >= 0.05
    assert registry.get_sample_value("psserver_clock") == 2


def test_workers_by_state_and_evictions():
    clock = Clock()
    store, w = job("a", "b", "c", "d", lease_timeout=10.0, clock=clock)
    store.leave(w["b"].worker_id, w["b"].generation)
    clock.offset = 5.0
    for name in ("a", "c"):
        store.heartbeat(w[name].worker_id, w[name].generation)
    clock.offset = 12.0  # d's lease is over; a and c renewed theirs at 5 s
    assert store.evict_expired() == ["d"]
    registry = registry_of(store, shard_index=0, num_shards=1)
    states = {s: registry.get_sample_value("psserver_workers", {"state": s}) for s in ("live", "evicted", "left",
                                                                                        "fenced")}
    assert states == {"live": 2, "evicted": 1, "left": 1, "fenced": 0}
    assert registry.get_sample_value("psserver_evictions_total") == 1
    assert registry.get_sample_value("psserver_info", {"shard_index": "0", "num_shards": "1", "mode": "async"}) == 1
    assert registry.get_sample_value("psserver_variable_bytes") == 16
    assert registry.get_sample_value("psserver_optimizer_state_bytes") == store.status()["optimizer_state_bytes"]

    # Restored, every worker is fenced until it registers again.
    restored = ShardStore()
    restored.restore(*store.export()[1:], source="test")
    assert registry_of(restored).get_sample_value("psserver_workers", {"state": "fenced"}) == 4


def test_before_a_job_the_info_metric_names_what_the_flags_say():
    assert registry_of(ShardStore()).get_sample_value(
        "psserver_info", {"shard_index": "", "num_shards": "", "mode": ""}) == 1
    assert registry_of(ShardStore(), shard_index=2, num_shards=4).get_sample_value(
        "psserver_info", {"shard_index": "2", "num_shards": "4", "mode": ""}) == 1


def test_a_restore_keeps_the_checkpointed_counters_and_restarts_the_traffic_ones():
    store, w = job("a")
    a = w["a"]
    for sequence in range(1, 20):
        store.apply_push(a.worker_id, a.generation, sequence, 0, [PART], [ONES])
    store.apply_push(a.worker_id, a.generation, 19, 0, [PART], [ONES])  # a duplicate
    refused(store, lambda: store.apply_push(a.worker_id, a.generation, 20, 999, [PART], [ONES]))
    _, tensors, metadata = store.export()
    restored = ShardStore()
    restored.restore(tensors, metadata, source="test")
    before, after = store.reading(), restored.reading()
    assert after.pushes == {**before.pushes, "duplicate": 0, "rejected": 0}
    assert (after.staleness_counts, after.staleness_sum, after.staleness_beyond) == (
        before.staleness_counts, before.staleness_sum, before.staleness_beyond) == (
        before.staleness_counts, sum(range(19)), 2)
    assert after.version == before.version == 19


def test_a_checkpoint_without_the_staleness_sum_gets_the_sum_its_histogram_implies():
    counters = Counters()
    old = {"pushes_applied": 4, "staleness_histogram": [1, 2] + [0] * (STALENESS_BUCKETS - 3) + [1]}
    counters.restore(old)
    assert (counters.staleness_sum, counters.staleness_beyond) == (2 + STALENESS_BUCKETS - 1, 0)
    counters.record_staleness(40)
    assert (counters.staleness_sum, counters.staleness_beyond, counters.max_staleness) == (58, 1, 40)
    fresh = Counters()
    fresh.restore(counters.checkpointed())
    assert fresh.checkpointed() == counters.checkpointed()


def test_the_top_staleness_bucket_is_the_stores_last():
    assert STALENESS_BOUNDS == (0, 1, 2, 4, 8, 16) and STALENESS_BOUNDS[-1] == STALENESS_BUCKETS - 1


def test_a_forgotten_workers_wait_counter_goes_with_it():
    store, w = job("a", "b", consistency=Consistency(mode=Mode.SSP, staleness=0), max_workers=2)
    a = w["a"]
    store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [ONES], clock=0, base_clock=0)
    with pytest.raises(DeadlineError):
        store.pull({}, timeout=0.01, worker_id=a.worker_id, generation=a.generation, clock=1)
    assert store.reading().pull_waits == {"a": 0, "b": 1}
    store.leave(w["b"].worker_id, w["b"].generation)
    store.register(registration("c", Consistency(mode=Mode.SSP, staleness=0)))  # the table is full: b goes
    assert store.reading().pull_waits == {"a": 0, "c": 0}


# -- settings -------------------------------------------------------------------------------


def test_metrics_flags_and_environment():
    assert ServerConfig().metrics_address is None
    config = parse_args(["--metrics-port", "0", "--host", "0.0.0.0"], env={})
    assert (config.metrics_port, config.metrics_address) == (0, "0.0.0.0")
    config = parse_args(["--metrics-host", "127.0.0.1"], env={"PSSERVER_METRICS_PORT": "9400"})
    assert (config.metrics_port, config.metrics_address) == (9400, "127.0.0.1")


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"metrics_port": 65536}, "metrics_port"), ({"metrics_port": -1}, "metrics_port"),
    ({"metrics_host": "127.0.0.1"}, "needs --metrics-port"), ({"metrics_port": 0, "metrics_host": " "}, "empty"),
])
def test_bad_metrics_settings_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ServerConfig(**kwargs)


def test_metrics_url_brackets_ipv6():
    assert metrics_url("127.0.0.1", 9400) == "http://127.0.0.1:9400/metrics"
    assert metrics_url("::1", 9400) == "http://[::1]:9400/metrics"


def test_a_shard_without_metrics_does_not_load_prometheus_client():
    # It costs 3.3 MiB resident, out of the shard-memory check's margin (docs/benchmarks.md).
    code = ("import sys; from psserver.main import main; from psserver.server import create_server; "
            "assert 'prometheus_client' not in sys.modules, 'loaded'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
