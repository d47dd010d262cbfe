"""Prometheus metrics of one shard: the ``psserver_*`` families of ``docs/metrics.md`` and the
standard ``process_*`` ones, served at ``/metrics`` by prometheus_client's own HTTP server.

What the store, the checkpointer, the in-flight budget and the servicer already count is read
at scrape time by :class:`ShardCollector`, so serving metrics adds nothing to a push or a pull.
Only what must be observed as it happens uses prometheus_client's objects: the duration of
every call by method and status code (:class:`RpcTimer`, a server interceptor) and of every
checkpoint written.

Every collector goes into the registry a :class:`ShardMetrics` owns, never the global default
one, so several shards in one process stay apart. Importing this module loads prometheus_client
(3.3 MiB resident, out of the shard-memory check's margin): ``psserver.server`` imports it only
when ``--metrics-port`` is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from psserver.checkpointer import Checkpointer
from psserver.inflight import InflightBudget
from psserver.intake import Traffic
from psserver.state import STALENESS_BUCKETS
from psserver.store import ShardStore
from pswire.histograms import Histogram
from pswire.v1 import ps_pb2

__all__ = [
    "CHECKPOINT_BUCKETS", "PUSH_OUTCOMES", "RPC_BUCKETS", "STALENESS_BOUNDS", "RpcTimer", "ShardCollector",
    "ShardMetrics", "metrics_url",
]

log = logging.getLogger(__name__)

RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds of the call-duration buckets (seconds): a small call takes about a millisecond
here, a pull may wait on the staleness bound for up to its deadline (30 s by default)."""
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALENESS_BOUNDS = (0, 1, 2, 4, 8, STALENESS_BUCKETS - 1)
"""Upper bounds of the applied-staleness buckets, besides +Inf: 0, 1, 2, 4, 8, 16. The top one is
the store's last bucket, which ``Counters.staleness_beyond`` splits into 16 and above."""
PUSH_OUTCOMES = ("applied", "scaled", "dropped", "duplicate", "fenced", "nonfinite", "rejected")
WORKER_STATES = ("live", "evicted", "left", "fenced")
DATA_TASK_STATES = ("done", "leased", "queued")

_HEALTH_METHODS = frozenset({"Check", "Watch"})


def metrics_url(host: str, port: int) -> str:
    """``http://HOST:PORT/metrics``, an IPv6 host in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


class RpcTimer(grpc.ServerInterceptor):
    """Times every call of the shard's service and of the health service, from the moment a
    handler thread starts it until its handler returns (a streamed response: until the stream
    ends), into ``psserver_rpc_duration_seconds{method, code}``. Installed first, it also times
    the calls the token and admission interceptors refuse. Calls to methods that do not exist
    are not observed: ``method`` stays a closed set."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._histogram = Histogram(  # pswire's: a call's observation costs 0.5 us, not prometheus_client's 3-5
            "psserver_rpc_duration_seconds",
            "Time a call took on the shard, by gRPC method and status code (a streamed response: until "
            "its last message).",
            ("method", "code"), RPC_BUCKETS,
        )
        registry.register(self._histogram)
        self._methods = frozenset(m.name for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods) \
            | _HEALTH_METHODS
        self._children: dict[tuple[str, str], list] = {}  # label lookups done once per (method, code)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rpartition("/")[2]
        if method not in self._methods:
            return handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                timed = self._streaming if handler.response_streaming else self.timed_unary
                return handler._replace(**{kind: timed(method, behavior)})
        return handler

    def _observe(self, method: str, context: grpc.ServicerContext, started: float, failed: str | None) -> None:
        code = context.code()
        name = code.name if isinstance(code, grpc.StatusCode) else failed or "OK"
        key = (method, name)
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, self._histogram.series(method, name))
        self._histogram.observe(child, time.perf_counter() - started)

    def timed_unary(self, method: str, behavior: Callable) -> Callable:
        """``behavior`` (a unary handler) timed as ``method`` (also for the calls bulk lanes carry)."""

        def timed(request, context):
            started = time.perf_counter()
            try:
                response = behavior(request, context)
            except BaseException:
                self._observe(method, context, started, "UNKNOWN")
                raise
            self._observe(method, context, started, None)
            return response

        return timed

    def _streaming(self, method: str, behavior: Callable) -> Callable:
        def timed(request, context):
            started = time.perf_counter()
            try:
                yield from behavior(request, context)
            except GeneratorExit:  # the call ended before the stream did
                self._observe(method, context, started, "CANCELLED")
                raise
            except BaseException:
                self._observe(method, context, started, "UNKNOWN")
                raise
            self._observe(method, context, started, None)

        return timed


class ShardCollector(Collector):
    """Reads the shard's counters and gauges when Prometheus scrapes: the store's
    (:meth:`ShardStore.reading`, one pass under its lock), the servicer's bytes by transport,
    the in-flight budget and the checkpointer's record."""

    def __init__(
        self, store: ShardStore, *, traffic: Traffic, budget: InflightBudget, checkpointer: Checkpointer | None,
        shard_index: int = -1, num_shards: int = 0,
    ) -> None:
        self._store = store
        self._traffic = traffic
        self._budget = budget
        self._checkpointer = checkpointer
        # Before a job the shard knows its place only from --shard-index/--num-shards, if given.
        self._shard_index = str(shard_index) if shard_index >= 0 else ""
        self._num_shards = str(num_shards) if num_shards > 0 else ""

    def collect(self) -> Iterator[Metric]:
        r = self._store.reading()
        info = GaugeMetricFamily("psserver_info", "The shard's place in its job and the job's consistency mode "
                                 "(always 1; mode and place empty before a job).",
                                 labels=("shard_index", "num_shards", "mode"))
        info.add_metric((self._shard_index if r.shard_index is None else str(r.shard_index),
                         self._num_shards if r.num_shards is None else str(r.num_shards), r.mode), 1)
        yield info

        pushes = CounterMetricFamily(
            "psserver_pushes", "Pushes by outcome, each counted once: applied (at the full learning rate; in "
            "sync, one per clock: the mean of its gradients), scaled (applied at learning rate / staleness), "
            "dropped (staler than the bound, or a closed sync clock), duplicate (a retry acknowledged again, "
            "not re-applied), fenced (the registration is void: re-register), nonfinite (a NaN/Inf gradient "
            "or update), rejected (any other refusal).", labels=("outcome",))
        for outcome in PUSH_OUTCOMES:
            pushes.add_metric((outcome,), r.pushes[outcome])
        yield pushes

        pushed, pulled = self._traffic.totals()
        for name, what, totals in (("psserver_push_bytes", "Tensor bytes of pushes received", pushed),
                                   ("psserver_pull_bytes", "Tensor bytes of pulls sent", pulled)):
            family = CounterMetricFamily(name, f"{what}, by transport (grpc: in gRPC messages; lane: on a bulk "
                                         "lane).", labels=("transport",))
            for transport in Traffic.TRANSPORTS:
                family.add_metric((transport,), totals[transport])
            yield family

        yield _staleness(r.staleness_counts, r.staleness_sum, r.staleness_beyond)
        yield CounterMetricFamily("psserver_pull_wait_seconds", "Seconds pulls spent waiting on the consistency "
                                  "bound (and, before it, on the shard's initialisation).",
                                  value=r.pull_wait_seconds)
        waits = CounterMetricFamily("psserver_pull_waits", "Pulls that waited on the consistency bound, by the "
                                    "slowest worker they waited for (empty: none was behind, a sync clock not yet "
                                    "applied).", labels=("worker",))
        for worker, count in sorted(r.pull_waits.items()):
            waits.add_metric((worker,), count)
        yield waits

        yield GaugeMetricFamily("psserver_version", "Updates applied to this shard's variables.", value=r.version)
        yield GaugeMetricFamily("psserver_learning_rate", "The learning rate this shard's next update runs at: the "
                                "job's lr times its schedule's factor at that update (0 before a job).",
                                value=r.learning_rate)
        yield GaugeMetricFamily("psserver_clock", "The shard's clock: steps every live worker has completed (sync: "
                                "clocks applied).", value=r.clock)
        workers = GaugeMetricFamily("psserver_workers", "Workers this shard knows, by state.", labels=("state",))
        for state in WORKER_STATES:
            workers.add_metric((state,), r.workers[state])
        yield workers
        yield CounterMetricFamily("psserver_evictions", "Workers evicted for a lease that expired.",
                                  value=r.evictions)
        yield GaugeMetricFamily("psserver_variable_bytes", "Bytes of this shard's variables.",
                                value=r.variable_bytes)
        yield GaugeMetricFamily("psserver_optimizer_state_bytes", "Bytes of this shard's optimizer state.",
                                value=r.optimizer_state_bytes)
        yield GaugeMetricFamily("psserver_inflight_push_bytes", "Bytes of pushes received but not yet applied "
                                "(bounded by --max-inflight-bytes).", value=self._budget.held)

        yield from _data_queue(r.data)

        rows = GaugeMetricFamily("psserver_table_rows", "Rows of the job's embedding tables on this shard, summed "
                                 "over tables: held (this shard's share), written (updated at least once; the rest "
                                 "hold their initial values and cost no memory).", labels=("state",))
        for state in ("held", "written"):
            rows.add_metric((state,), r.table_rows.get(state, 0))
        yield rows
        yield CounterMetricFamily("psserver_table_rows_pushed", "Table rows updated by pushes (a row once per push), "
                                  "summed over tables.", value=r.table_rows.get("pushed", 0))
        yield CounterMetricFamily("psserver_table_rows_pulled", "Table rows sent by PullRows, summed over tables.",
                                  value=r.table_rows.get("pulled", 0))

        cp = self._checkpointer
        yield GaugeMetricFamily("psserver_checkpoint_last_success_timestamp_seconds",
                                "Unix time of the last checkpoint this shard wrote (0: none yet).",
                                value=cp.last_success_unix if cp else 0.0)
        yield CounterMetricFamily("psserver_checkpoint_failures", "Checkpoint writes that failed.",
                                  value=cp.failures if cp else 0)
        yield GaugeMetricFamily("psserver_checkpoint_last_id", "Id of the last checkpoint written or restored "
                                "(0: none).", value=cp.last_id if cp else 0)
        yield GaugeMetricFamily("psserver_checkpoint_schedule_seconds", "The --checkpoint-every period in seconds "
                                "(0: none, or a schedule in steps).", value=cp.schedule_seconds if cp else 0.0)


def _data_queue(status: dict | None) -> Iterator[Metric]:
    """The job's data queue (``DataQueue.status``). Every family from the start, at 0 on a shard
    that holds no queue (shards other than 0, jobs without dynamic data, before the first data
    request), as the checkpoint gauges are before a checkpoint: series that appear mid-run hide
    their first change from ``rate()``, and ``examples{state="total"}`` 0 says there is no queue."""
    d = status or {}
    yield GaugeMetricFamily("psserver_data_epoch", "Dynamic data: the oldest epoch with examples not yet "
                            "trained (0 without a data queue on this shard).", value=d.get("epoch", 0))
    tasks = GaugeMetricFamily("psserver_data_tasks", "Dynamic data: tasks by state: done (trained whole), leased "
                              "(held by a worker), queued (given back, or not yet cut).", labels=("state",))
    for state in DATA_TASK_STATES:
        tasks.add_metric((state,), d.get(f"tasks_{state}", 0))
    yield tasks
    examples = GaugeMetricFamily("psserver_data_examples", "Dynamic data: examples trained (done) and to train "
                                 "in the whole job (total; 0 without a data queue on this shard).",
                                 labels=("state",))
    examples.add_metric(("done",), d.get("examples_done", 0))
    examples.add_metric(("total",), d.get("examples_total", 0))
    yield examples
    yield CounterMetricFamily("psserver_data_tasks_requeued", "Dynamic data: tasks, or the untrained rest of "
                              "one, given back to the queue (a worker left, was evicted or registered again, "
                              "or reported a task partly trained).", value=d.get("tasks_requeued", 0))


def _staleness(counts: tuple[int, ...], total_sum: int, beyond: int) -> HistogramMetricFamily:
    """The applied-staleness histogram from the store's per-value counts (``counts[i]``: i,
    the last: ``STALENESS_BUCKETS - 1`` and above, ``beyond`` of which are above)."""
    total = sum(counts)
    buckets = [(floatToGoString(bound), sum(counts[: bound + 1])) for bound in STALENESS_BOUNDS[:-1]]
    buckets += [(floatToGoString(STALENESS_BOUNDS[-1]), total - beyond), ("+Inf", total)]
    return HistogramMetricFamily(
        "psserver_applied_staleness", "Staleness of the updates applied (async: versions applied since the "
        "gradient's base version; ssp and sync: clocks).", buckets=buckets, sum_value=total_sum)


class ShardMetrics:
    """One shard's registry (process collector, call and checkpoint durations, then the shard's
    own collector once :meth:`watch` names what to read) and its HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.rpc = RpcTimer(self.registry)
        self._checkpoints = Histogram(
            "psserver_checkpoint_duration_seconds", "Time this shard took to write its part of a checkpoint.",
            (), CHECKPOINT_BUCKETS,
        )
        self.registry.register(self._checkpoints)
        self._checkpoint_seconds = self._checkpoints.series()
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def checkpoint_written(self, seconds: float) -> None:
        self._checkpoints.observe(self._checkpoint_seconds, seconds)

    def watch(self, collector: ShardCollector) -> None:
        self.registry.register(collector)

    def serve(self, host: str, port: int) -> int:
        """Start serving ``/metrics`` on ``host:port`` (0: any free port); returns the bound port.
        Raises ``RuntimeError`` naming the address when it cannot be bound."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RuntimeError(f"cannot bind the metrics port {host}:{port}: {exc.strerror or exc}") from exc
        self.port = self._server.server_port
        return self.port

    def stop(self) -> None:
        """Stop the endpoint; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
