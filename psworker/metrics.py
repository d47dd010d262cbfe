"""Prometheus metrics of one worker: the ``psworker_*`` families of ``docs/metrics.md`` and the
standard ``process_*`` ones, served at ``/metrics`` by prometheus_client's own HTTP server.

Everything goes into a registry passed in (``psworker.main`` makes one per process), never the
global default one, so several workers in one test process stay apart. The client reports each
exchange's phases through ``ClientOptions.on_exchange`` and each retry through
``ClientOptions.on_retry``; the training loop reports steps. Importing this module loads
prometheus_client: ``psworker.main`` and ``psworker.training`` import it only when metrics are on.

Step phases (``psworker_step_phase_seconds{phase}``, one observation of each phase per step):

- ``push``, ``pull``, ``wait``: the step's exchange with the shards as the client measured it
  (see ``psworker.client.PSClient``): in async nothing waits; in ssp/sync the time the shards
  held the exchange is ``wait`` (the exchange's own transfer included).
- ``compute``: the rest of the step on this worker: the batch, forward, backward, copying
  gradients and weights (and a ``--slowdown`` straggler's pause). Without ``--overlap`` the four
  phases add up to the step's time. With ``--overlap`` the exchange runs beside the next step's
  compute: ``push``/``pull``/``wait`` are those of the background exchange that finished during
  the step, and ``compute`` is the step's time outside ``optimizer.step()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pswire.histograms import Histogram

__all__ = ["PHASES", "PHASE_BUCKETS", "MetricsServer", "WorkerMetrics", "metrics_url", "serve"]

log = logging.getLogger(__name__)

PHASES = ("compute", "push", "pull", "wait")
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the phase buckets: a small MLP's phases take tens of microseconds to
a millisecond, a pull may wait on the bound for as long as a straggler's step."""


class WorkerMetrics:
    """The ``psworker_*`` metrics of one worker, registered on ``registry``.

    ``exchanged`` and ``retried`` may be called from any thread (the client's); the rest from
    the training loop's."""

    def __init__(self, registry: CollectorRegistry, *, worker: str, task: str, mode: str, device: str,
                 overlap: bool = False) -> None:
        self.registry = registry
        self.overlap = overlap
        Gauge("psworker_info", "This worker: its name, task, consistency mode (or local) and device; always 1.",
              ("worker", "task", "mode", "device"), registry=registry).labels(worker, task, mode, device).set(1)
        self._steps = _Steps()  # steps, samples and loss: plain numbers, read when scraped
        registry.register(self._steps)
        # pswire's histogram: prometheus_client's cost a step of the 15K MLP about 15 us (3-4% of
        # its throughput with metrics on) for these four observations; this one about 2.
        histogram = Histogram(
            "psworker_step_phase_seconds",
            "Time of each training step by phase: compute (on the worker), push and pull (the exchange with the "
            "shards) and wait (the shards holding the exchange on the ssp/sync bound).",
            ("phase",), PHASE_BUCKETS,
        )
        registry.register(histogram)
        self._observe = histogram.observe
        self._phase = [histogram.series(phase) for phase in PHASES]  # label lookups done once
        self.retries = Counter("psworker_retries_total", "Calls to a shard retried after it was unreachable, "
                               "did not answer in time or turned the call away as overloaded.", registry=registry)
        self.rejoins = Counter("psworker_rejoins_total", "Re-registrations after the shards fenced this worker "
                               "off (evicted, or a shard restored).", registry=registry)
        self._accuracy: Gauge | None = None
        # Dynamic data's counters, at 0 on a static worker (as the shards' psserver_data_*).
        self._data = (
            Counter("psworker_data_tasks_total", "Data tasks this worker trained to the end and reported "
                    "(dynamic data; 0 with --worker-index).", registry=registry),
            Counter("psworker_data_wait_seconds_total", "Time this worker waited for a data task to come free "
                    "(dynamic data: the rest were held by other workers).", registry=registry),
        )
        self._data_seen = (0, 0.0)
        # Embedding tables' lookups, at 0 for a model without ShardedEmbedding tables.
        self._table = (
            Counter("psworker_table_ids_total", "Ids this worker's training steps looked up in the job's embedding "
                    "tables, repeats included.", registry=registry),
            Counter("psworker_table_rows_total", "Distinct table rows those lookups pulled (and pushed back): "
                    "rows / ids is the unique-row ratio of the batches.", registry=registry),
        )
        self._table_seen = (0, 0)
        self._rejoins_seen = 0
        self._lock = threading.Lock()  # guards _exchange: the client's threads add, the training loop takes
        self._exchange = [0.0, 0.0, 0.0]
        """Push, pull and wait seconds reported since the last ``take_exchange``."""

    def data(self, *, tasks: int, wait_seconds: float) -> None:
        """Dynamic data: the feed's totals so far (tasks this worker finished, seconds it waited
        for a free one)."""
        done, waited = self._data_seen
        self._data[0].inc(max(0, tasks - done))
        self._data[1].inc(max(0.0, wait_seconds - waited))
        self._data_seen = (max(tasks, done), max(wait_seconds, waited))

    def tables(self, *, ids: int, rows: int) -> None:
        """Table lookups: the totals so far (``TableRows.rows_looked_up`` and ``rows_unique``)."""
        seen_ids, seen_rows = self._table_seen
        self._table[0].inc(max(0, ids - seen_ids))
        self._table[1].inc(max(0, rows - seen_rows))
        self._table_seen = (max(ids, seen_ids), max(rows, seen_rows))

    def retried(self, what: str) -> None:
        """``ClientOptions.on_retry``."""
        self.retries.inc()

    def exchanged(self, push: float, pull: float, wait: float) -> None:
        """``ClientOptions.on_exchange``: adds to the current step's exchange."""
        with self._lock:
            self._exchange[0] += push
            self._exchange[1] += pull
            self._exchange[2] += wait

    def take_exchange(self) -> tuple[float, float, float]:
        """The push, pull and wait seconds reported since the last call, and start over."""
        with self._lock:
            push, pull, wait = self._exchange
            self._exchange = [0.0, 0.0, 0.0]
        return push, pull, wait

    def step(self, *, seconds: float, exchange_seconds: float, samples: int, loss: float, rejoins: int = 0) -> None:
        """One finished step: ``seconds`` from its start to its loss, ``exchange_seconds`` of
        them in ``optimizer.step()``; ``rejoins``: the session's count so far."""
        push, pull, wait = self.take_exchange()
        compute = seconds - (exchange_seconds if self.overlap else push + pull + wait)
        observe, (c, pu, pl, w) = self._observe, self._phase
        observe(c, max(compute, 0.0))
        observe(pu, push)
        observe(pl, pull)
        observe(w, wait)
        self._steps.add(samples, loss)
        if rejoins > self._rejoins_seen:
            self.rejoins.inc(rejoins - self._rejoins_seen)
            self._rejoins_seen = rejoins

    def evaluated(self, result: dict) -> None:
        """An evaluation's result (``psworker.tasks.evaluate``): its test accuracy, if the task
        has one, becomes ``psworker_test_accuracy`` (absent until then)."""
        accuracy = result.get("test_accuracy")
        if accuracy is None:
            return
        if self._accuracy is None:
            self._accuracy = Gauge("psworker_test_accuracy", "Test accuracy of this worker's last evaluation "
                                   "(--eval-every, and at the end).", registry=self.registry)
        self._accuracy.set(accuracy)


class _Steps(Collector):
    """``psworker_steps_total``, ``psworker_samples_total`` and ``psworker_loss`` (absent until
    the first step rather than a misleading 0), kept as plain numbers by the training loop, their
    only writer, and read when scraped: prometheus_client's counters and gauge take a lock each
    per update, three a step."""

    def __init__(self) -> None:
        self._totals: tuple[int, int, float | None] = (0, 0, None)  # replaced whole: a scrape sees one step's

    def add(self, samples: int, loss: float) -> None:
        steps, total, _ = self._totals
        self._totals = (steps + 1, total + samples, loss)

    def collect(self) -> Iterator[Metric]:
        steps, samples, loss = self._totals
        yield CounterMetricFamily("psworker_steps", "Training steps this worker process completed.", value=steps)
        yield CounterMetricFamily("psworker_samples", "Training examples this worker process stepped on.",
                                  value=samples)
        if loss is not None:
            yield GaugeMetricFamily("psworker_loss", "Loss of this worker's last training step.", value=loss)


def metrics_url(host: str, port: int) -> str:
    """``http://HOST:PORT/metrics``, an IPv6 host in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (see :func:`serve`)."""

    registry: CollectorRegistry
    host: str
    port: int
    _server: object
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return metrics_url(self.host, self.port)

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5)


def serve(host: str, port: int, registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve ``registry`` (a new one when None, with the process collector) at
    ``http://host:port/metrics`` from a daemon thread; ``port`` 0 picks a free one. Raises
    ``OSError`` naming the address when it cannot be bound."""
    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
    return MetricsServer(registry, host, server.server_port, server, thread)
