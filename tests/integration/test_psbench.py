"""``psbench --quick`` runs every section against real processes, prints the table and writes a
JSON document whose every figure is a positive finite number (CPU times may round to zero; a
difference of means may have either sign). Timings are not asserted: this machine's load
decides them."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SECTIONS = ("baselines", "goodput", "latency", "training", "memory", "tls", "metrics", "elastic", "sparse", "scale")


def _numbers(value, path: str):
    """Every number under ``value`` (booleans are not figures) with its path."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}[{index}]")


def _plausible(path: str, n: float) -> bool:
    """Positive and finite; CPU times come in clock ticks (10 ms), so a quick run's few small
    calls may round to 0, and a server may not grow while 16 MiB stream through it."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf == "difference_points":
        return math.isfinite(n)
    if leaf == "difference_stderr_points":  # 0 when every run of both setups reached the same accuracy
        return math.isfinite(n) and n >= 0
    if leaf == "seed":  # a name, not a figure
        return n >= 0
    if leaf == "external_cores":  # the load of other processes: none on a quiet machine
        return math.isfinite(n) and n >= 0
    # A dynamic-data worker of a quick run's short job may find every task taken, or none
    # to wait for; and a run's workers may start in the same millisecond.
    idle = re.search(r"(worker_examples|dynamic_data_tasks|dynamic_wait_seconds|skew_seconds)\[", path)
    return math.isfinite(n) and (n > 0 or (n == 0 and ("cpu" in leaf or "growth" in leaf or idle is not None)))


@pytest.mark.timeout(480)
def test_quick_run_reports_every_section(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("psbench", "--quick", "--out", str(out), "--keep-logs", str(tmp_path / "logs"), timeout=460)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    doc = json.loads(out.read_text())
    assert "errors" not in doc, doc["errors"]
    for section in SECTIONS:
        assert doc.get(section), f"section {section} is missing or empty"
        numbers = list(_numbers(doc[section], section))
        assert numbers, f"section {section} holds no figures"
        bad = [(path, n) for path, n in numbers if not _plausible(path, n)]
        assert not bad, f"figures that are not positive and finite: {bad}"

    assert {g["shards"] for g in doc["goodput"]} == {1, 2}
    assert {g["transport"] for g in doc["goodput"]} == {"lanes", "grpc"}  # the lanes and gRPC alone
    assert all(g["ratio_to_tcp"] > 0 for g in doc["goodput"])
    # Every repetition is kept: the rounds, their push and pull, and the paired TCP transfers.
    reps = doc["plan"]["transfer_reps"]
    for g in doc["goodput"]:
        assert len(g["round_seconds"]) == len(g["push_seconds"]) == len(g["pull_seconds"]) == reps
        assert len(g["paired_tcp_seconds"]) == reps
        assert g["round_seconds"] == pytest.approx([a + b for a, b in zip(g["push_seconds"], g["pull_seconds"])],
                                                   abs=2e-6)
    assert doc["latency"]["pull"]["p50_ratio_to_echo"] > 0
    assert doc["training"][0]["cluster_samples_per_second"] > 0
    # Held: the variables, plus SGD's few bytes of step counters.
    assert 0 <= doc["memory"]["held_bytes"] - (doc["memory"]["size_mib"] << 20) < 4096
    # With Adam: the variables and their two moments (and step counters), on a shard of its own.
    assert 0 <= doc["memory"]["adam"]["held_bytes"] - 3 * (doc["memory"]["size_mib"] << 20) < 4096
    assert doc["memory"]["adam"]["peak_rss_bytes"] > doc["memory"]["adam"]["held_bytes"]

    # The same rounds and training with mutual TLS (gRPC and lanes) and in plaintext.
    tls = doc["tls"]
    assert (tls["goodput"]["plain"]["tls"], tls["goodput"]["tls"]["tls"]) == (False, True)
    assert tls["goodput"]["plain"]["transport"] == tls["goodput"]["tls"]["transport"] == "lanes"
    assert len(tls["training"]["plain_reps"]) == len(tls["training"]["tls_reps"]) == 1

    # The same training with every process's metrics on and scraped, and with none.
    metrics = doc["metrics"]["training"]
    assert [m["parameters"] for m in metrics] == [15_210] and len(metrics[0]["on_reps"]) == 1
    assert metrics[0]["scrapes"]["shard"] >= 2 and metrics[0]["scrapes"]["worker"] >= 2
    assert not metrics[0]["failures"]

    # Dynamic data against the static split: the same examples trained, whoever trained them.
    elastic = doc["elastic"]
    throughput = elastic["throughput"]
    assert throughput["parameters"] == 15_210 and len(throughput["dynamic_reps"]) == 1
    job = doc["plan"]["elastic_job"]
    accuracy = elastic["accuracy"]
    runs = accuracy["static_runs"] + accuracy["dynamic_runs"] + elastic["scaling"]["more_runs"]
    for run in runs + elastic["scaling"]["fewer_runs"]:
        assert sum(run["worker_examples"]) == job["steps"] * 100 and len(run["worker_examples"]) == run["workers"]
    assert elastic["accuracy"]["static"]["std"] is None  # one run each
    # The accuracy runs emulate accelerators (a sleep in each training step); the scaling runs do not.
    assert accuracy["compute_ms"] == job["compute_ms"] > 0 and accuracy["static_seconds"] > 0
    assert elastic["scaling"]["runs"] == job["scaling_runs"] == 1
    assert (elastic["scaling"]["workers"], elastic["scaling"]["fewer"]) == (job["workers"], job["fewer"])
    emulated = elastic["emulated"]  # the same job by workers whose steps a sleep stretches
    assert (emulated["workers"], emulated["fewer"], emulated["runs"]) == (job["workers"], job["fewer"], 1)
    for run in emulated["more_runs"] + emulated["fewer_runs"]:
        assert sum(run["worker_examples"]) == job["steps"] * 100 and run["seconds"] > 0

    # Embedding tables: the same batches against a 100K- and a 10M-row table; dlrm-synth (1M
    # rows) in a cluster and locally; the cluster's rows against the goodput section's dense path.
    sparse = doc["sparse"]
    assert [t["rows"] for t in sparse["steps"]["tables"]] == [100_000, 10_000_000]
    assert all(t["step_seconds"] > 0 and t["rows_written"] > 0 for t in sparse["steps"]["tables"])
    assert sparse["dlrm"]["rows"] == 1_000_000 and len(sparse["dlrm"]["cluster_reps"][0]) == 2
    assert 0.5 < sparse["dlrm"]["cluster_test_auc"] <= 1 and 0.5 < sparse["dlrm"]["teacher_auc"] <= 1
    # Each step pulls its distinct rows and pushes them: the evaluation's reads set aside, equal.
    assert sparse["rows"]["rows_pushed_reps"] == sparse["rows"]["rows_pulled_reps"]
    assert sparse["rows"]["dense_source"] == "goodput section" and sparse["rows"]["ratio_to_dense"] > 0

    # Scaling: the quick grid is the 1.1M MLP on 2 shards, 1 and 2 workers of emulated compute.
    scale = doc["scale"]
    (run,) = scale["runs"]
    assert (run["parameters"], run["shards"], run["model_bytes"]) == (1_101_834, 2, 4 * 1_101_834)
    assert [p["workers"] for p in run["points"]] == [1, 2] and run["points"][0]["efficiency"] == 1.0
    for point in run["points"]:
        assert [len(w) for w in point["worker_steps_reps"]] == [point["workers"]]
        assert len(point["shard_updates_reps"][0]) == 2  # each shard's pushes applied in the window
    assert scale["cpu_fit"] is None  # one model and shard count: no fit to make

    checks = {c["id"]: c for c in doc["checks"]}
    assert set(checks) == {"1", "2", "2b", "3", "3b", "3c", "4", "5", "6", "7", "8", "8b", "8d", "9", "9b", "10"}
    assert all(isinstance(c["passed"], bool) for c in checks.values()), checks

    env = doc["environment"]
    for key in ("python", "torch", "grpcio", "protobuf", "numpy", "psgrpc", "cpu_model", "usable_cores"):
        assert env[key], key

    for heading in ("Baselines", "PS goodput", "Small operations", "Training", "Shard memory", "The cost of TLS",
                    "The cost of metrics", "Dynamic data (elastic workers)", "Sparse rows", "Scaling", "Checks"):
        assert heading in proc.stdout, f"table lacks {heading!r}:\n{proc.stdout}"


def test_only_runs_the_sections_asked_and_their_baselines(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("psbench", "--quick", "--only", "latency", "--out", str(out), timeout=200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    doc = json.loads(out.read_text())
    assert doc["plan"]["sections"] == ["baselines", "latency"]
    assert "goodput" not in doc and "training" not in doc
    checks = {c["id"]: c["passed"] for c in doc["checks"]}
    assert checks["4"] in (True, False) and checks["1"] is None


def test_bad_flags_are_usage_errors():
    proc = run_cli("psbench", "--only", "goodput,nonsense", timeout=60)
    assert proc.returncode == 2
    assert "nonsense" in proc.stderr


def test_the_benchmark_cnn_is_psworkers_mnist1d_cnn():
    """The elastic section trains ``psbench.tasks:mnist1d_cnn`` so that its workers need not
    generate MNIST-1D: it must be the built-in task, weights, data and defaults alike."""
    import torch

    from psworker.tasks import load_task

    builtin, bench = load_task("mnist1d-cnn", seed=3), load_task("psbench.tasks:mnist1d_cnn", seed=3)
    assert bench.defaults == builtin.defaults and bench.name == builtin.name
    assert [(n, p.shape) for n, p in bench.model.named_parameters()] == \
        [(n, p.shape) for n, p in builtin.model.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(bench.model.parameters(), builtin.model.parameters()))
    for split in ("train", "test"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(bench, split), getattr(builtin, split)))


# The elastic section's pure parts (no processes): they would sit with tests/unit/test_psbench.py.

def test_elastic_figures_from_result_lines(tmp_path):
    from psbench.elastic import job_seconds, spread, started_at

    static = {"steps": 100, "samples": 6400, "seconds": 2.0}
    dynamic = {"steps": 100, "samples": 6400, "seconds": 2.5, "data": {"wait_seconds": 0.5}}
    # The job runs from the first worker's first step to the last one's last task; a worker that
    # started when every task was taken is no part of it.
    idle = {"samples": 0, "seconds": 0.01, "data": {"wait_seconds": 0.0}}
    assert job_seconds([100.0, 100.5, 109.0], [dynamic, static, idle]) == pytest.approx(2.5)
    assert spread([0.9, 0.92, 0.94]) == pytest.approx({"mean": 0.92, "std": 0.02, "min": 0.9, "max": 0.94})
    assert spread([0.5])["std"] is None
    logs = {name: tmp_path / f"{name}.log" for name in ("first", "second", "none")}
    logs["first"].write_text("2026-01-02 03:04:05,250 INFO psworker[7] w: task x on cpu\n"
                             "2026-01-02 03:04:06,500 INFO psworker[7] w starts at step 1\n")
    logs["second"].write_text("2026-01-02 03:04:08,000 INFO psworker[8] v starts at step 1\n")
    logs["none"].write_text("2026-01-02 03:04:08,000 INFO psworker[9] u: no data task free\n")
    assert started_at(logs["second"]) - started_at(logs["first"]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="starts at step 1"):
        started_at(logs["none"])


def test_side_by_side_rates_use_the_window_both_setups_share():
    from psbench.elastic import window_cpu, window_rates

    # (time, static steps, dynamic steps) of a 1,000-step job: the window opens at the first
    # reading where both passed 100 steps and closes at the last reading.
    readings = [(0.0, 0, 0), (1.0, 150, 20), (2.0, 300, 120), (3.0, 450, 240), (4.0, 600, 360), (5.0, 900, 480)]
    static, dynamic, seconds = window_rates(readings, 1000)
    assert (static, dynamic, seconds) == (pytest.approx(200.0), pytest.approx(120.0), 3.0)
    for short in ([], [(0.0, 0, 0), (1.0, 950, 50)], [(0.0, 0, 0), (1.0, 950, 150)]):
        with pytest.raises(ValueError, match="no window where both setups"):
            window_rates(short, 1000)
    # With each setup's CPU seconds so far: CPU per step over the same window, in ms.
    timed = [(*r, 0.5 * i, 0.4 * i) for i, r in enumerate(readings)]
    assert window_cpu(timed, 1000) == (pytest.approx(1e3 * 1.5 / 600), pytest.approx(1e3 * 1.2 / 360))


@pytest.mark.parametrize(("ratio", "difference", "scaling", "passed"), [
    (1.01, -0.4, 0.8, (True, True, True)),
    (0.95, 2.0, 1.0, (False, False, False)),
])
def test_elastic_checks(ratio, difference, scaling, passed):
    from psbench.checks import compute_checks
    from psbench.report import _elastic

    side = {"mean": 0.92, "std": 0.01, "min": 0.91, "max": 0.93}
    elastic = {
        "throughput": {"width": 100, "parameters": 15_210, "shards": 2, "workers": 2, "ratio": ratio,
                       "static_steps_per_second": 100.0, "dynamic_steps_per_second": 100.0 * ratio,
                       "static_samples_per_second": 6400.0, "dynamic_samples_per_second": 6400.0 * ratio},
        "accuracy": {"task": "mnist1d-cnn", "shards": 1, "workers": 4, "job_steps": 2400, "runs": 3,
                     "static": side, "dynamic": side, "difference_points": difference,
                     "difference_stderr_points": 0.82, "compute_ms": 30.0, "static_seconds": 22.0,
                     "dynamic_seconds": 22.0},
        "scaling": {"workers": 4, "fewer": 2, "job_steps": 2400, "seconds": 10.0 * scaling, "fewer_seconds": 10.0,
                    "ratio": scaling, "wall_ratio": 1.1},
        "emulated": {"workers": 4, "fewer": 2, "job_steps": 2400, "slowdown": 4.0, "seconds": 20.0 * scaling,
                     "fewer_seconds": 20.0, "ratio": scaling},
    }
    checks = {c.id: c for c in compute_checks({"elastic": elastic})}
    assert (checks["8"].passed, checks["8b"].passed, checks["8d"].passed) == passed
    assert "8c" not in checks  # CPU-bound on 2 cores, the scaling figure is reported, not checked
    assert "emulated accelerators" in checks["8d"].name and "x4 by a sleep" in checks["8d"].detail
    assert checks["8b"].value == abs(difference) and checks["8d"].comparison == "<"
    assert "4 dynamic vs 4 static" in checks["8b"].name and "4 dynamic workers < 1 x 2" in checks["8d"].name
    table = "\n".join(_elastic(elastic))
    assert f"{difference:+.2f} points (+- 0.82)" in table and "4 / 2 =" in table and "emulated accelerators" in table
    assert "30 ms emulated compute a step" in table
    assert "standard error of the difference 0.82 points" in checks["8b"].detail
    assert "2400-step job at 30 ms of emulated compute a step" in checks["8b"].detail
    assert all(c.passed is None for c in compute_checks({}) if c.id.startswith("8"))
