"""pswire's cheap histogram: the exposition prometheus_client's own ``Histogram`` gives for the
same observations, its counts whole under concurrent observers, and its refusals."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as ClientHistogram
from prometheus_client.parser import text_string_to_metric_families

from pswire.histograms import Histogram

pytestmark = pytest.mark.timeout(60)

BUCKETS = (0.001, 0.01, 0.1, 1.0)
VALUES = (0.0, 0.0005, 0.001, 0.002, 0.01, 0.5, 1.0, 7.0, 0.1, 0.1000001)


def _samples(registry: CollectorRegistry) -> set[tuple]:
    return {(s.name, frozenset(s.labels.items()), s.value)
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if not s.name.endswith("_created")}


def test_the_exposition_is_prometheus_clients_for_the_same_observations():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = Histogram("t_seconds", "doc", ("method",), BUCKETS)
    ours.register(mine)
    reference = ClientHistogram("t_seconds", "doc", ("method",), buckets=BUCKETS, registry=theirs)
    for method in ("a", "b"):
        series = mine.series(method)
        for value in VALUES if method == "a" else VALUES[:3]:
            mine.observe(series, value)
            reference.labels(method).observe(value)
    assert _samples(ours) == _samples(theirs)
    assert len(_samples(ours)) == 2 * (len(BUCKETS) + 3)


def test_concurrent_observers_lose_no_count():
    histogram = Histogram("c_seconds", "doc", (), BUCKETS)
    series = histogram.series()

    def observe():
        for _ in range(20_000):
            histogram.observe(series, 0.005)

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    family = next(histogram.collect())
    count = next(s for s in family.samples if s.name == "c_seconds_count")
    assert count.value == 80_000
    assert next(s for s in family.samples if s.labels.get("le") == "0.001").value == 0


def test_it_refuses_unordered_buckets_and_wrong_labels():
    with pytest.raises(ValueError, match="increasing"):
        Histogram("x", "doc", (), (1.0, 0.5))
    with pytest.raises(ValueError, match="takes labels"):
        Histogram("x", "doc", ("a",), BUCKETS).series()
