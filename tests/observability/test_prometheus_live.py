"""Real clusters scraped by a real Prometheus (Debian's package), loaded with docker/prometheus/
alerts.yml and queried through its HTTP API:

- a 2x2 ``pscluster --metrics-sd-file`` run gives every dashboard query and every alert
  expression data;
- a worker killed with SIGKILL shows up as evicted;
- a shard whose checkpoints fail raises the checkpoint alerts.

How alert expressions are evaluated: an alert is ``VALUE OP THRESHOLD [and CONDITION]`` and
does not fire on a healthy run, so its expression as a whole has no series then. Each rule's
expression, as Prometheus loaded it (``/api/v1/rules``), is split at its top-level comparison and
set operators (:func:`tests.observability.promql.operands`); every piece that selects a metric
(the value, a threshold made of metrics, the condition) is queried on its own and must return a
series with a finite value. Dashboard queries are queried whole, with ``$job``/``$instance`` as
``.*`` and ``$__rate_interval`` as 10s (ten one-second scrapes).

Fails (in CI) or skips (elsewhere) when ``prometheus`` is not installed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from psworker.children import METRICS_LINE
from tests.conftest import ROOT, child_env, run_cli, start_shard, terminate
from tests.observability.prom import (
    Prometheus, config, dashboard_query_list, file_sd_job_config, loaded_alert_queries, tool, wait_for, without_data,
)
from tests.observability.promql import ALERTS, contract_metrics, load_dashboard, metric_names, substitute, variable_queries

pytestmark = [pytest.mark.integration]


@pytest.fixture
def prometheus_binary():
    return tool("prometheus")


# --- processes -----------------------------------------------------------------------------


class PsCluster:
    """``pscluster`` in the background, its output in a log file."""

    def __init__(self, directory: Path, *args: str) -> None:
        self.log_path = directory / "pscluster.log"
        with open(self.log_path, "w") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", "psworker.cluster", *args], stdout=log,
                                          stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_running(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"pscluster exited with {self.popen.returncode}:\n{self.log()[-4000:]}")

    def shard_addresses(self) -> str | None:
        self.check_running()
        match = re.search(r"shard\(s\) listening: (\S+)", self.log())
        return match.group(1) if match else None

    def child_pids(self) -> dict[str, int]:
        """The latest pid pscluster logged for each child ("started worker1, pid 1234")."""
        return {name: int(pid) for name, pid in re.findall(r"started (\w+), pid (\d+)", self.log())}

    def stop(self) -> None:
        """Interrupt pscluster, which stops its children; should it hang, kill it and them."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=60)
                return
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=15)
        for pid in self.child_pids().values():  # children run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Worker:
    def __init__(self, directory: Path, name: str, ps: str, *args: str) -> None:
        self.log_path = directory / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "psworker", "--ps", ps, "--threads", "1", "--progress", "none", *args],
                stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.popen)


def metrics_address(log, popen: subprocess.Popen, what: str, timeout: float = 60.0) -> str:
    """The ``HOST:PORT`` a process logged as its metrics endpoint."""
    def found():
        match = METRICS_LINE.search(log())
        if match is None and popen.poll() is not None:
            raise AssertionError(f"{what} exited with {popen.returncode}:\n{log()[-3000:]}")
        return match.group(1) if match else None

    return wait_for(found, timeout, f"{what}'s metrics endpoint", pace=popen, explain=lambda: log()[-3000:])


def static_targets(**jobs: list[str]) -> list[dict]:
    return [{"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()]


def wait_targets_up(prom: Prometheus, expected: dict[str, int], timeout: float, explain=lambda: "",
                    check=lambda: None) -> None:
    """Until Prometheus has scraped ``expected[job]`` targets of each job, all healthy; ``check()``
    raises to end the wait early (a cluster that died)."""
    def all_up():
        check()
        up: dict[str, int] = {}
        for target in prom.targets():
            if target["health"] == "up":
                job = target["labels"]["job"]
                up[job] = up.get(job, 0) + 1
        return up == expected

    wait_for(all_up, timeout, f"Prometheus to scrape {expected} targets", pace=prom.popen,
             explain=lambda: f"targets: {[(t['labels'], t['health'], t['lastError']) for t in prom.targets()]}\n"
                             f"{explain()}")


def replace_with_file(directory: Path) -> None:
    """Put a regular file where ``directory`` is. The shard re-creates a missing checkpoint
    directory on its next write, so the directory is moved away and the file renamed into its
    place, again if the shard was quicker (rename onto a directory fails)."""
    spare = directory.with_name(directory.name + ".file")
    spare.write_text("not a directory\n")
    for attempt in range(10):
        if directory.is_dir():
            directory.rename(directory.with_name(f"{directory.name}.moved{attempt}"))
        try:
            os.rename(spare, directory)
            return
        except IsADirectoryError:
            continue
    raise AssertionError(f"the shard kept re-creating {directory}")


def alert_states(prom: Prometheus, name: str) -> set[str]:
    return {a["state"] for a in prom.alerts() if a["labels"]["alertname"] == name}


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_every_dashboard_query_and_alert_expression_has_data(tmp_path, prometheus_binary):
    sd_file = tmp_path / "targets.json"
    (tmp_path / "prom").mkdir()
    with Prometheus(tmp_path / "prom", config(scrape_configs=file_sd_job_config(sd_file),
                                               rule_files=[str(ALERTS)])) as prom:
        # SSP with a bound of 1 and evaluations, so that the waits, the worker waited on and the
        # accuracy have data; checkpoints every 2 s for the checkpoint panels. The steps outlast
        # the test, which stops the cluster once every query has answered.
        cluster = PsCluster(
            tmp_path, "--shards", "2", "--workers", "2", "--task", "mnist1d-mlp", "--metrics-sd-file", str(sd_file),
            f"--shard-arg=--checkpoint-dir={tmp_path / 'checkpoints'}", "--shard-arg=--checkpoint-every=2s",
            "--mode", "ssp", "--staleness", "1", "--steps", "200000", "--eval-every", "100",
        )
        try:
            wait_targets_up(prom, {"psserver": 2, "psworker": 2}, timeout=120, explain=lambda: cluster.log()[-4000:],
                            check=cluster.check_running)
            # The error panel's by-code query has a series once some call has failed: a checkpoint
            # id far beyond the shards' clocks is refused (INVALID_ARGUMENT) by both.
            ps = wait_for(cluster.shard_addresses, 30, "the shards' addresses", pace=cluster.popen)
            refused = run_cli("psworker.ctl", "checkpoint", "--ps", ps, "--id", "999999999999", "--timeout", "30",
                              timeout=120)
            assert refused.returncode != 0, refused.stdout + refused.stderr

            queries = dashboard_query_list() + loaded_alert_queries(prom)
            assert len(queries) > 40
            last: list[str] = []

            def all_have_data() -> bool:
                cluster.check_running()
                last[:] = without_data(prom, queries)
                return not last

            wait_for(all_have_data, 120, "every dashboard and alert query to return data", pace=prom.popen,
                     explain=lambda: "\n".join(last) + "\n" + cluster.log()[-3000:])

            # The variables' queries list the jobs and instances scraped.
            for name, selector, label in variable_queries(load_dashboard()):
                values = prom.api(f"label/{label}/values", **{"match[]": substitute(selector)})
                assert values, f"variable {name}: label_values({selector}, {label}) is empty"
            # Every metric a query names is one the processes export.
            exported = set(prom.api("label/__name__/values"))
            used = set().union(*(metric_names(expr) for _, expr in queries))
            assert used <= exported, f"named but not exported: {sorted(used - exported)}"
            # And docs/metrics.md, which the static tests hold the queries to, describes what
            # Prometheus scraped: each metric's type and label names.
            metadata = prom.api("metadata")
            for metric in contract_metrics().values():
                family = metadata.get(metric.name) or metadata.get(metric.name.removesuffix("_total"))
                assert family and family[0]["type"] == metric.type, (metric.name, family)
                series = metric.name + ("_count" if metric.type == "histogram" else "")
                labels = set().union(*(s.keys() for s in prom.api("series", **{"match[]": series})))
                assert labels - {"__name__", "job", "instance"} == set(metric.labels), (metric.name, labels)
        finally:
            cluster.stop()


@pytest.mark.timeout(180)
def test_a_worker_killed_with_sigkill_shows_up_as_evicted(tmp_path, prometheus_binary):
    shard = start_shard(tmp_path, "shard0", "--lease-timeout", "3", "--metrics-port", "0")
    workers: list[Worker] = []
    try:
        shard_metrics = metrics_address(shard.log, shard.popen, "shard0")
        workers = [Worker(tmp_path, f"worker{i}", shard.address, "--task", "mnist1d-mlp", "--worker-index", str(i),
                          "--num-workers", "2", "--steps", "200000", "--metrics-port", "0") for i in range(2)]
        worker_metrics = [metrics_address(w.log, w.popen, f"worker{i}") for i, w in enumerate(workers)]
        (tmp_path / "prom").mkdir()
        with Prometheus(tmp_path / "prom", config(
                scrape_configs=static_targets(psserver=[shard_metrics], psworker=worker_metrics),
                rule_files=[str(ALERTS)])) as prom:
            wait_targets_up(prom, {"psserver": 1, "psworker": 2}, timeout=60)
            wait_for(lambda: prom.value('psserver_workers{state="live"}') == 2, 60, "two live workers",
                     pace=prom.popen, explain=shard.log)
            assert prom.value("psserver_evictions_total") == 0

            workers[1].popen.send_signal(signal.SIGKILL)
            workers[1].popen.wait(timeout=15)

            wait_for(lambda: prom.value('psserver_workers{state="evicted"}') == 1, 60,
                     "Prometheus to see worker1 evicted", pace=prom.popen, explain=lambda: shard.log()[-3000:])
            assert prom.value("psserver_evictions_total") == 1
            assert prom.value('psserver_workers{state="live"}') == 1
            wait_for(lambda: "firing" in alert_states(prom, "PsserverWorkerEvicted"), 30,
                     "the PsserverWorkerEvicted alert", pace=prom.popen,
                     explain=lambda: str(prom.alerts()))
            assert workers[0].popen.poll() is None, workers[0].log()[-3000:]  # the survivor trains on
    finally:
        for w in workers:
            w.stop()
        shard.stop()


@pytest.mark.timeout(180)
def test_a_shard_whose_checkpoints_fail_raises_the_checkpoint_alerts(tmp_path, prometheus_binary):
    checkpoints = tmp_path / "checkpoints"
    shard = start_shard(tmp_path, "shard0", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1s",
                        "--metrics-port", "0")
    worker = None
    try:
        shard_metrics = metrics_address(shard.log, shard.popen, "shard0")
        worker = Worker(tmp_path, "worker0", shard.address, "--task", "mnist1d-mlp", "--steps", "200000")
        (tmp_path / "prom").mkdir()
        with Prometheus(tmp_path / "prom", config(scrape_configs=static_targets(psserver=[shard_metrics]),
                                                   rule_files=[str(ALERTS)])) as prom:
            wait_targets_up(prom, {"psserver": 1}, timeout=60)
            wait_for(lambda: (prom.value("psserver_checkpoint_last_success_timestamp_seconds") or 0) > 0, 60,
                     "a first checkpoint", pace=prom.popen, explain=lambda: shard.log()[-3000:] + worker.log()[-2000:])
            assert prom.value("psserver_checkpoint_schedule_seconds") == 1
            # The worker has no --worker-index: dynamic data, whose queue this shard (0) holds.
            wait_for(lambda: (prom.value('psserver_data_tasks{state="done"}') or 0) > 0, 60, "a data task done",
                     pace=prom.popen, explain=lambda: shard.log()[-3000:] + worker.log()[-2000:])
            done, total = (prom.value(f'psserver_data_examples{{state="{state}"}}') for state in ("done", "total"))
            assert total > done > 0

            # The checkpoint directory becomes a regular file: every later checkpoint fails.
            replace_with_file(checkpoints)

            wait_for(lambda: "firing" in alert_states(prom, "PsserverCheckpointFailing"), 60,
                     "the PsserverCheckpointFailing alert", pace=prom.popen,
                     explain=lambda: f"{prom.alerts()}\n{shard.log()[-3000:]}")
            # Three 1 s periods after the last success; alerts.yml gives it no `for:` (nor the one
            # above), so the test uses the shipped rules unchanged.
            wait_for(lambda: "firing" in alert_states(prom, "PsserverCheckpointStale"), 60,
                     "the PsserverCheckpointStale alert", pace=prom.popen, explain=lambda: str(prom.alerts()))
            assert prom.value("psserver_checkpoint_failures_total") >= 1
            assert worker.popen.poll() is None, worker.log()[-3000:]  # training goes on
    finally:
        if worker is not None:
            worker.stop()
        shard.stop()
