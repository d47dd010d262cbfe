"""The worker's metrics (psworker.metrics) on fresh registries, its endpoint, the client's hooks
that feed it, its flags, and pscluster's service discovery file: no shard, no training."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pswire import errors
from psworker import children, cluster, sdfile
from psworker.exchange import _phases
from psworker.config import parse_args
from psworker.metrics import PHASES, WorkerMetrics, metrics_url, serve
from psworker.retry import retrying
from psworker.shard import ClientOptions

pytestmark = pytest.mark.timeout(60)


def _metrics(registry: CollectorRegistry | None = None, **kw) -> tuple[CollectorRegistry, WorkerMetrics]:
    registry = CollectorRegistry() if registry is None else registry
    labels = dict(worker="worker-0", task="linreg", mode="async", device="cpu") | kw
    return registry, WorkerMetrics(registry, **labels)


def _phase(registry: CollectorRegistry, phase: str, suffix: str = "sum") -> float | None:
    return registry.get_sample_value(f"psworker_step_phase_seconds_{suffix}", {"phase": phase})


def test_a_step_observes_every_phase_once_and_compute_is_the_rest_of_the_step():
    registry, metrics = _metrics()
    metrics.exchanged(0.010, 0.020, 0.0)
    metrics.exchanged(0.001, 0.002, 0.0)  # a rejoin's pull in the same step adds up
    metrics.step(seconds=0.100, exchange_seconds=0.040, samples=100, loss=1.5)
    assert _phase(registry, "push") == pytest.approx(0.011)
    assert _phase(registry, "pull") == pytest.approx(0.022)
    assert _phase(registry, "wait") == 0.0
    assert _phase(registry, "compute") == pytest.approx(0.100 - 0.033)  # the phases add up to the step
    assert all(_phase(registry, p, "count") == 1 for p in PHASES)
    assert registry.get_sample_value("psworker_steps_total") == 1
    assert registry.get_sample_value("psworker_samples_total") == 100
    assert registry.get_sample_value("psworker_loss") == 1.5
    assert registry.get_sample_value(
        "psworker_info", {"worker": "worker-0", "task": "linreg", "mode": "async", "device": "cpu"}) == 1

    metrics.step(seconds=0.050, exchange_seconds=0.0, samples=100, loss=1.25)  # nothing exchanged (local)
    assert _phase(registry, "compute") == pytest.approx(0.067 + 0.050)
    assert _phase(registry, "push") == pytest.approx(0.011) and _phase(registry, "push", "count") == 2
    assert registry.get_sample_value("psworker_loss") == 1.25


def test_with_overlap_compute_is_the_step_outside_the_exchange_call():
    registry, metrics = _metrics(overlap=True)
    metrics.exchanged(0.030, 0.030, 0.0)  # the background exchange, hidden behind compute
    metrics.step(seconds=0.100, exchange_seconds=0.005, samples=10, loss=1.0)
    assert _phase(registry, "compute") == pytest.approx(0.095)
    assert _phase(registry, "push") == pytest.approx(0.030)


def test_loss_and_accuracy_are_absent_until_known():
    registry, metrics = _metrics()
    assert registry.get_sample_value("psworker_loss") is None
    metrics.evaluated({"test_loss": 0.5})  # a task without accuracy (linreg)
    assert registry.get_sample_value("psworker_test_accuracy") is None
    metrics.evaluated({"test_loss": 0.5, "test_accuracy": 0.75})
    metrics.evaluated({"test_loss": 0.4, "test_accuracy": 0.8})
    assert registry.get_sample_value("psworker_test_accuracy") == 0.8


def test_retries_and_rejoins_count():
    registry, metrics = _metrics()
    metrics.retried("push")
    metrics.retried("pull")
    for rejoins in (0, 1, 1, 3):  # the session's running count, read after every step
        metrics.step(seconds=0.01, exchange_seconds=0.0, samples=1, loss=0.0, rejoins=rejoins)
    assert registry.get_sample_value("psworker_retries_total") == 2
    assert registry.get_sample_value("psworker_rejoins_total") == 3


def test_workers_on_separate_registries_stay_apart():
    first, a = _metrics(worker="a")
    second, b = _metrics(worker="b")
    a.step(seconds=0.01, exchange_seconds=0.0, samples=5, loss=1.0)
    assert first.get_sample_value("psworker_samples_total") == 5
    assert second.get_sample_value("psworker_samples_total") == 0
    with pytest.raises(ValueError, match="Duplicated"):
        _metrics(first)  # one registry holds one worker's metrics


def test_the_endpoint_serves_the_contract_and_closes():
    server = serve("127.0.0.1", 0)
    _, metrics = _metrics(server.registry, mode="ssp")
    metrics.exchanged(0.0, 0.0, 0.25)
    metrics.step(seconds=0.5, exchange_seconds=0.25, samples=32, loss=2.0)
    metrics.evaluated({"test_accuracy": 0.5})
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    types = {name: f.type for name, f in families.items()
             if name.startswith("psworker_") and not name.endswith("_created")}  # prometheus_client's own
    assert types == {
        "psworker_info": "gauge", "psworker_steps": "counter", "psworker_samples": "counter",
        "psworker_step_phase_seconds": "histogram", "psworker_loss": "gauge", "psworker_test_accuracy": "gauge",
        "psworker_retries": "counter", "psworker_rejoins": "counter", "psworker_data_tasks": "counter",
        "psworker_data_wait_seconds": "counter", "psworker_table_ids": "counter", "psworker_table_rows": "counter",
    }
    buckets = [s for s in families["psworker_step_phase_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["phase"] for s in buckets} == set(PHASES)
    wait_inf = next(s for s in buckets if s.labels == {"phase": "wait", "le": "+Inf"})
    assert wait_inf.value == 1
    assert "process_resident_memory_bytes" in families and "process_cpu_seconds" in families
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)
    server.close()  # idempotent


def test_a_taken_port_is_an_os_error_naming_it():
    server = serve("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{server.port}"):
            serve("127.0.0.1", server.port)
    finally:
        server.close()


def test_metrics_url_brackets_ipv6():
    assert metrics_url("::1", 9) == "http://[::1]:9/metrics"
    assert metrics_url("127.0.0.1", 9) == "http://127.0.0.1:9/metrics"


def test_exchange_phases_of_one_call():
    assert _phases(0.3, 100, 200, may_wait=True) == (0.0, 0.0, 0.3)  # ssp/sync: the shard may hold it
    push, pull, wait = _phases(0.3, 100, 200, may_wait=False)
    assert (push, pull, wait) == (pytest.approx(0.1), pytest.approx(0.2), 0.0)  # async: split by bytes
    assert _phases(0.3, 0, 200, may_wait=False) == (0.0, 0.3, 0.0)  # a pull alone


def test_every_retry_reaches_the_hook():
    seen: list[str] = []
    options = ClientOptions(on_retry=seen.append)
    failures = iter([errors.UnavailableError("down"), errors.OverloadedError("busy")])

    def call():
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return "done"

    assert retrying(call, options, "h:1", "push") == "done"
    assert seen == ["push", "push"]
    assert ClientOptions(on_retry=seen.append) == ClientOptions()  # hooks are not settings


def test_metrics_flags():
    config = parse_args(["--ps", "h:1"], {})
    assert (config.metrics_port, config.metrics_host) == (None, "127.0.0.1")
    config = parse_args(["--ps", "h:1", "--metrics-port", "0"], {"PSWORKER_METRICS_HOST": "0.0.0.0"})
    assert (config.metrics_port, config.metrics_host) == (0, "0.0.0.0")
    assert parse_args(["--ps", "h:1"], {"PSWORKER_METRICS_PORT": "9100"}).metrics_port == 9100


@pytest.mark.parametrize("argv, message", [
    (["--metrics-port", "70000"], "--metrics-port must be in 0..65535"),
    (["--metrics-port", "-1"], "--metrics-port must be in 0..65535"),
    (["--metrics-port", "0", "--metrics-host", " "], "--metrics-host is empty"),
])
def test_metrics_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--ps", "h:1", *argv], {})
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_metrics_off_loads_no_prometheus_client():
    code = ("import sys, psworker, psworker.main, psworker.training, psworker.client, psworker.cluster, "
            "psworker.children, psworker.sdfile\n"
            "print(sorted(m for m in sys.modules if m.startswith('prometheus_client')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# pscluster's side: the children's log lines, the discovery file, the flags.

def test_children_metrics_lines_give_scrape_targets():
    line = "2026-01-01 00:00:00,000 INFO psserver[7] psserver.server: metrics on http://127.0.0.1:9100/metrics"
    assert children.METRICS_LINE.search(line)[1] == "127.0.0.1:9100"
    assert children.METRICS_LINE.search("metrics on http://[::1]:9/metrics")[1] == "[::1]:9"
    assert sdfile.sd_target("0.0.0.0:9100") == "127.0.0.1:9100"  # served on every interface
    assert sdfile.sd_target("[::]:9100") == "[::1]:9100"
    assert sdfile.sd_target("10.0.0.2:9100") == "10.0.0.2:9100"


def test_the_discovery_file_lists_the_latest_address_of_every_child_and_is_emptied(tmp_path):
    path = tmp_path / "sd.json"
    targets = sdfile.MetricsTargets(path, shards=2, workers=1)
    assert json.loads(path.read_text()) == sdfile.sd_groups([], [])
    targets.reported("shard1", "shard", 1, "127.0.0.1:2")
    targets.reported("worker0", "worker", 0, "0.0.0.0:3")
    targets.reported("shard0", "shard", 0, "127.0.0.1:1")
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:1", "127.0.0.1:2"], "labels": {"job": "psserver"}},
        {"targets": ["127.0.0.1:3"], "labels": {"job": "psworker"}},
    ]
    targets.reported("worker0", "worker", 0, "127.0.0.1:4")  # restarted on a new port
    assert json.loads(path.read_text())[1]["targets"] == ["127.0.0.1:4"]
    assert [p.name for p in tmp_path.iterdir()] == ["sd.json"]  # no temporary file left behind
    targets.clear()
    targets.reported("shard0", "shard", 0, "127.0.0.1:5")  # a late line after the stop changes nothing
    assert json.loads(path.read_text()) == sdfile.sd_groups([], [])


def _cluster_args(*argv: str) -> argparse.Namespace:
    return cluster._parse([*argv, "--task", "linreg"])[0]


def test_pscluster_metrics_flags(tmp_path, capsys):
    assert not _cluster_args().metrics
    assert _cluster_args("--metrics").metrics
    args = _cluster_args("--metrics-sd-file", str(tmp_path / "sd.json"))
    assert args.metrics and cluster._metrics_flags(args) == ["--metrics-port", "0"]
    for argv in (["--metrics", "--metrics-port", "9"], ["--metrics", "--shard-arg=--metrics-port=9"],
                 ["--metrics-sd-file", str(tmp_path / "no" / "sd.json")]):
        with pytest.raises(SystemExit) as exit_info:
            _cluster_args(*argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pscluster sets --metrics-port itself" in err and "pscluster sets --metrics-port=9 itself" in err
    assert "its directory does not exist" in err
