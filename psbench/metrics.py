"""The cost of metrics: cluster training of the benchmark MLPs with every process exporting
Prometheus metrics (shards and workers with ``--metrics-port 0``) and every endpoint scraped once
a second, as Prometheus would, against the same training with none; alternated in one run so
that a change in the machine's load touches both.

Each setup has its own shards, all started before the first run. A scraping thread finds each
process's endpoint in its log (``metrics on http://HOST:PORT/metrics``, logged before a shard
reports its port and before a worker connects) and fetches every live one each second with the
headers Prometheus 2 sends (OpenMetrics preferred, gzip accepted). Both setups run their workers
with ``--log-level INFO`` (which is how the workers' endpoints are found), so logging is no
difference between them.
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from psbench.config import TrainingCase
from psbench.procs import Child, ChildError, Children
from psbench.ps import start_shards
from psbench.stats import median, median_ratio
from psbench.training import BATCH_SIZE, cluster_fields, run_cluster

__all__ = ["MetricsTrainingResult", "ScrapeStats", "Scraper", "measure_metrics_training", "metrics_url_in"]

log = logging.getLogger(__name__)

SCRAPE_PERIOD = 1.0
"""Seconds between scrapes of every endpoint (Prometheus' scrape_interval; its default is 60 s)."""
SCRAPE_TIMEOUT = 10.0
"""Prometheus' default scrape_timeout."""
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
"""The Accept header Prometheus 2.42 sends with each scrape."""
_METRICS_LINE = re.compile(r"metrics on (http://\S+/metrics)")
_WORKER_FLAGS = ("--log-level", "INFO")
_METRICS_FLAGS = ("--metrics-port", "0")


def metrics_url_in(log_path: Path) -> str | None:
    """The first metrics address a process logged (``metrics on http://HOST:PORT/metrics``)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = _METRICS_LINE.search(text)
    return found.group(1) if found else None


@dataclass
class ScrapeStats:
    """What one on-run's scrapes did, by kind of process (``shard``, ``worker``)."""

    scrapes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    """Scrapes of a live process that failed."""
    gone: dict[str, int] = field(default_factory=dict)
    """Scrapes that met a process on its way out (``Scraper._ending``): not failures."""
    seconds: list[float] = field(default_factory=list)
    """Time of each successful scrape, request to last byte."""
    bytes: list[int] = field(default_factory=list)
    """Bytes of each successful scrape as sent (gzip)."""
    errors: list[str] = field(default_factory=list)
    """The first few failures, for the log."""
    endpoints: dict[str, set[str]] = field(default_factory=dict)
    """The endpoints scraped at least once, by kind."""


class Scraper:
    """Scrapes every endpoint it knows each ``period`` seconds on its own thread, until
    stopped. Children are added as they start; each one's endpoint is read from its log once it
    appears there (looked for every ``_LOOK_EVERY`` seconds) and scraped at once, then each
    ``period``, as Prometheus scrapes a target it discovers."""

    _LOOK_EVERY = 0.1

    def __init__(self, period: float = SCRAPE_PERIOD) -> None:
        self.period = period
        self.stats = ScrapeStats()
        self._lock = threading.Lock()  # guards _pending and _targets
        self._pending: list[tuple[str, Child]] = []
        self._targets: list[tuple[str, Child, str]] = []
        self._due: dict[str, float] = {}  # url -> when it is next scraped (this thread only)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psbench-scraper", daemon=True)

    def add(self, child: Child, kind: str = "worker") -> None:
        with self._lock:
            self._pending.append((kind, child))

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._thread.join(timeout=SCRAPE_TIMEOUT + 5)

    def _run(self) -> None:
        while True:
            self._resolve()
            with self._lock:
                targets = list(self._targets)
            for kind, child, url in targets:
                now = time.monotonic()
                if child.popen.poll() is None and now >= self._due.setdefault(url, now):
                    self._due[url] = max(self._due[url] + self.period, now)
                    self._scrape(kind, child, url)
            if self._stopped.wait(timeout=self._LOOK_EVERY):
                return

    def _resolve(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        still = []
        for kind, child in pending:
            url = metrics_url_in(child.log_path)
            if url is not None:
                with self._lock:
                    self._targets.append((kind, child, url))
            elif child.popen.poll() is None:
                still.append((kind, child))
        with self._lock:
            self._pending[:0] = still

    def _ending(self, kind: str, child: Child, url: str, exc: BaseException) -> bool:
        """Whether a failed scrape met a process on its way out, not a broken endpoint: it
        exited, printed its result, or closed an endpoint that had answered (a worker closes its
        endpoint once it has trained, then prints its result and exits, which takes a moment)."""
        if child.popen.poll() is not None:
            return True
        out = child.stdout_path
        if out is not None and out.exists() and out.stat().st_size > 0:
            return True
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        answered = url in self.stats.endpoints.get(kind, set())
        return answered and isinstance(reason, (ConnectionRefusedError, ConnectionResetError))

    def _scrape(self, kind: str, child: Child, url: str) -> None:
        request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT) as reply:
                body = reply.read()
        except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
            if self._ending(kind, child, url, exc):
                self.stats.gone[kind] = self.stats.gone.get(kind, 0) + 1
            else:
                self.stats.failures[kind] = self.stats.failures.get(kind, 0) + 1
                if len(self.stats.errors) < 5:
                    self.stats.errors.append(f"{child.name} {url}: {exc}")
            return
        self.stats.seconds.append(time.monotonic() - started)
        self.stats.bytes.append(len(body))
        self.stats.scrapes[kind] = self.stats.scrapes.get(kind, 0) + 1
        self.stats.endpoints.setdefault(kind, set()).add(url)


@dataclass(frozen=True)
class MetricsTrainingResult:
    """Cluster runs of one model without metrics and with them, one of each per repetition."""

    case: TrainingCase
    off: list[list[dict]]
    """Per repetition, every worker's result line without metrics."""
    on: list[list[dict]]
    """Per repetition, every worker's result line with metrics on and scraped."""
    off_shard_cpu_seconds: list[float]
    on_shard_cpu_seconds: list[float]
    scrapes: list[ScrapeStats]
    """Per on-run, what its scrapes did."""
    shard_idle_rss_bytes: dict[str, int]
    """``off``/``on``: the median resident memory of the setup's shards right after start."""
    workers: int
    shards: int

    @property
    def off_samples_per_second(self) -> float:
        return median(_rates(self.off))

    @property
    def on_samples_per_second(self) -> float:
        return median(_rates(self.on))

    @property
    def ratio(self) -> float:
        """The median over repetitions of the run with metrics against the run without of the
        same repetition (run back to back)."""
        return median_ratio(_rates(self.on), _rates(self.off))

    def to_dict(self) -> dict:
        scrapes: dict[str, dict[str, int]] = {"scrapes": {}, "failures": {}, "gone": {}}
        for stats in self.scrapes:
            for key in scrapes:
                for kind, n in getattr(stats, key).items():
                    scrapes[key][kind] = scrapes[key].get(kind, 0) + n
        seconds = [s for stats in self.scrapes for s in stats.seconds]
        sizes = [b for stats in self.scrapes for b in stats.bytes]
        return {
            **cluster_fields(self.case, self.shards, self.workers),
            "off_samples_per_second": self.off_samples_per_second,
            "on_samples_per_second": self.on_samples_per_second,
            "ratio": self.ratio,
            "off_reps": _rates(self.off),
            "on_reps": _rates(self.on),
            "off_shard_cpu_ms_per_step": _per_step(self.off_shard_cpu_seconds, self.off),
            "on_shard_cpu_ms_per_step": _per_step(self.on_shard_cpu_seconds, self.on),
            "scrape_period_seconds": SCRAPE_PERIOD,
            **scrapes,
            "median_scrape_seconds": median(seconds) if seconds else None,
            "median_scrape_bytes": median(sizes) if sizes else None,
            "shard_idle_rss_bytes": dict(self.shard_idle_rss_bytes),
        }


def _rates(reps: list[list[dict]]) -> list[float]:
    return [sum(w["samples_per_second"] for w in rep) for rep in reps]


def _per_step(cpu_seconds: list[float], reps: list[list[dict]]) -> float:
    steps = [sum(w["samples"] for w in rep) / BATCH_SIZE for rep in reps]
    return median([1e3 * cpu / n for cpu, n in zip(cpu_seconds, steps)])


def _shard_urls(started: list[tuple[Child, str]]) -> list[str]:
    urls = []
    for child, _ in started:
        url = metrics_url_in(child.log_path)
        if url is None:  # logged before the port file was written: its absence is a failure
            raise child.failure("reported its port without logging a metrics address")
        urls.append(url)
    return urls


def measure_metrics_training(
    children: Children, case: TrainingCase, *, reps: int, shards: int = 2, workers: int = 2, timeout: float = 600.0,
) -> MetricsTrainingResult:
    """``reps`` cluster runs of ``case`` without metrics and ``reps`` with (``shards`` shards,
    ``workers`` async workers, every one of them with ``--metrics-port 0`` and scraped each
    second), back to back, the first of each pair alternating. Raises ``ChildError``."""
    plain, metered = [], []
    runs: dict[bool, list[list[dict]]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    scrapes: list[ScrapeStats] = []
    try:
        plain = start_shards(children, shards)
        metered = start_shards(children, shards, *_METRICS_FLAGS)
        rss = {"off": int(median([c.rss_bytes() for c, _ in plain])),
               "on": int(median([c.rss_bytes() for c, _ in metered]))}
        _shard_urls(metered)
        for rep in range(reps):
            for on in ((False, True) if rep % 2 == 0 else (True, False)):
                started = metered if on else plain
                ps = ",".join(address for _, address in started)
                before = sum(child.cpu_seconds() for child, _ in started)
                if on:
                    with Scraper() as scraper:
                        for child, _ in started:
                            scraper.add(child, "shard")
                        runs[on].append(run_cluster(children, case, ps, workers=workers, timeout=timeout, run=rep,
                                                    extra=(*_WORKER_FLAGS, *_METRICS_FLAGS), started=scraper.add))
                    scrapes.append(scraper.stats)
                    _check_scrapes(scraper.stats, shards, workers)
                else:
                    runs[on].append(run_cluster(children, case, ps, workers=workers, timeout=timeout, run=rep,
                                                extra=_WORKER_FLAGS))
                cpu[on].append(sum(child.cpu_seconds() for child, _ in started) - before)
            log.info("mlp%d rep %d: metrics off %.0f samples/s, on %.0f samples/s (%d scrapes)", case.width, rep + 1,
                     _rates(runs[False][-1:])[0], _rates(runs[True][-1:])[0], sum(scrapes[-1].scrapes.values()))
    finally:
        for child, _ in plain + metered:
            children.stop(child)
    return MetricsTrainingResult(case, runs[False], runs[True], cpu[False], cpu[True], scrapes, rss, workers, shards)


def _check_scrapes(stats: ScrapeStats, shards: int, workers: int) -> None:
    """Raises ``ChildError`` unless every shard and worker endpoint answered at least once and
    none failed while its process lived: an overhead measured without scrapes means nothing."""
    if stats.failures:
        raise ChildError(f"metrics scrapes failed: {stats.failures}; e.g. {stats.errors}")
    scraped = {kind: len(urls) for kind, urls in stats.endpoints.items()}
    if scraped.get("shard", 0) < shards or scraped.get("worker", 0) < workers:
        raise ChildError(f"not every endpoint was scraped: {scraped} of {shards} shards and {workers} workers")
