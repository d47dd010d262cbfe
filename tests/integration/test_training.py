"""Real processes on loopback: shards and workers train together; the CLIs behave."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[-1])


def _start_worker(ps: str, index: int, count: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psworker", "--ps", ps, "--worker-index", str(index),
         "--num-workers", str(count), "--threads", "1", "--progress", "log", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )


def test_two_shards_two_async_workers_train_mnist1d_mlp(shards):
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    steps = 700
    workers = [_start_worker(ps, i, 2, "--task", "mnist1d-mlp", "--steps", str(steps)) for i in range(2)]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=400)
        results.append(_result(subprocess.CompletedProcess(w.args, w.returncode, out, err)))
    for i, r in enumerate(results):
        assert r["steps"] == steps and r["samples"] == steps * 100 and r["worker_index"] == i
        assert r["samples_per_second"] > 0 and r["seconds"] > 0
    # The last worker to finish evaluated the final model; the MLP reaches ~0.6 this early.
    assert max(r["test_accuracy"] for r in results) >= 0.55, results

    status = json.loads(_result_text(run_cli("psworker.ctl", "status", "--ps", ps, "--json", timeout=60)))
    assert [s["shard_index"] for s in status] == [0, 1]
    for s in status:
        assert s["state"] == "ready"
        assert s["pushes_applied"] == 2 * steps and s["pushes_rejected"] == 0
        assert s["version"] == 2 * steps
        assert sorted(w["worker_name"] for w in s["workers"]) == ["worker-0", "worker-1"]
    assert sum(s["bytes_held"] for s in status) == (40 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10) * 4
    table = run_cli("psworker.ctl", "status", "--ps", ps, timeout=60)
    assert table.returncode == 0 and "ready" in table.stdout and "worker-1" in table.stdout


def _result_text(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_worker_with_different_settings_gets_a_clear_error(shards):
    (a,) = shards(1)
    first = run_cli("psworker", "--ps", a.address, "--task", "linreg", "--steps", "5", "--threads", "1")
    _result(first)
    other = run_cli("psworker", "--ps", a.address, "--task", "linreg", "--steps", "5", "--lr", "0.3",
                    "--worker-index", "1", "--num-workers", "2", "--threads", "1")
    assert other.returncode == 1
    assert "optimizer settings differ" in other.stderr and "lr: job has 0.05, worker asked for 0.3" in other.stderr
    wrong_model = run_cli("psworker", "--ps", a.address, "--task", "mnist1d-mlp", "--steps", "5", "--threads", "1")
    assert wrong_model.returncode == 1 and "is not in the job's model" in wrong_model.stderr


def test_worker_reports_unreachable_shard_clearly():
    proc = run_cli("psworker", "--ps", "127.0.0.1:1", "--task", "linreg", "--connect-timeout", "2", timeout=60)
    assert proc.returncode == 1 and "did not accept a connection" in proc.stderr


def test_pscluster_runs_and_summarises():
    proc = run_cli("psworker.cluster", "--shards", "2", "--workers", "2", "--task", "linreg", "--steps", "150")
    summary = _result(proc)
    assert summary["shards"] == 2 and summary["workers"] == 2 and summary["steps"] == 300
    assert len(summary["per_worker"]) == 2 and summary["test_loss"] < 0.05


def test_pscluster_stops_everything_when_a_worker_fails():
    proc = run_cli("psworker.cluster", "--shards", "1", "--workers", "2", "--task", "nosuch.module:fn",
                   timeout=120)
    assert proc.returncode == 1
    assert "failed with exit status" in proc.stderr and "shutting down" in proc.stderr


def test_cli_usage_errors_name_the_problem():
    proc = run_cli("psworker", "--task", "linreg", timeout=60)
    assert proc.returncode == 2 and "--ps HOST:PORT" in proc.stderr
    proc = run_cli("psworker", "--ps", "nohost", "--task", "linreg", timeout=60)
    assert proc.returncode == 1 and "expected HOST:PORT" in proc.stderr
    proc = run_cli("psworker.cluster", "--workers", "0", timeout=60)
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr


def test_local_mode_matches_a_single_async_worker_exactly(shards):
    (a,) = shards(1)
    args = ("--task", "mnist1d-mlp", "--steps", "50", "--threads", "1", "--optimizer", "sgd",
            "--lr", "0.05", "--momentum", "0.9")
    local = _result(run_cli("psworker", "--local", *args))
    remote = _result(run_cli("psworker", "--ps", a.address, *args))
    assert local["final_loss"] == pytest.approx(remote["final_loss"], rel=1e-6)
    assert local["test_accuracy"] == remote["test_accuracy"]
