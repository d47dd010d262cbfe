"""``pscluster --elastic``: identical dynamic-data workers (no indices) train one job, whose
examples the workers' result lines and shard 0's data queue both add up to exactly; a worker
killed mid-run is restarted under its name and the job still trains every example once; the
flags that would split the data statically are usage errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from psworker.client import ClientOptions, PSClient
from psworker.cluster import data_summary
from pswire.v1 import ps_pb2
from tests.conftest import ROOT, child_env, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _summary(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


def test_identical_workers_train_the_job_exactly_once():
    steps, batch, task = 240, 32, 64
    proc = run_cli("psworker.cluster", "--elastic", "--shards", "2", "--workers", "3", "--task", "linreg",
                   "--steps", str(steps), "--batch-size", str(batch), "--data-task-size", str(task), timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = _summary(proc.stdout)
    total = steps * batch
    workers = summary["per_worker"]
    # Every worker finished (exit 0 with its result line), under its own name, with no index.
    assert [w["worker"] for w in workers] == ["worker-0", "worker-1", "worker-2"]
    assert all(w["worker_index"] is None and w["data"]["mode"] == "dynamic" and not w["data"]["stopped"]
               for w in workers), workers
    assert len(re.findall(r"\[worker\d\] .* worker-\d starts at step 1$", proc.stderr, re.M)) == 3
    assert "died" not in proc.stderr and summary["restarts"] == []

    # The job's length is the job's: the workers' shares, however they fell, add up to it.
    data = summary["data"]
    assert data["job"]["total"] == total and data["job"]["task_size"] == task
    assert data["finished"] and data["examples_done"] == total and data["tasks_requeued"] == 0
    assert data["examples"] == sum(w["data"]["examples"] for w in workers) == total
    assert data["worker_examples"] == [w["data"]["examples"] for w in workers]
    assert data["tasks"] == data["tasks_done"] == total // task
    assert summary["samples"] == total and summary["steps"] == sum(summary["worker_steps"]) == steps
    assert summary["test_loss"] < 0.05  # linreg learned
    assert f"the job's data: {total} of {total} examples trained" in proc.stderr


def test_elastic_and_static_flags_are_usage_errors():
    proc = run_cli("psworker.cluster", "--elastic", "--task", "linreg", "--worker-index", "0", timeout=60)
    assert proc.returncode == 2 and "--elastic workers have no static split: leave out --worker-index" in proc.stderr
    # A dynamic-data flag without --elastic fails here, not in every worker.
    proc = run_cli("psworker.cluster", "--task", "linreg", "--data-task-size", "64", timeout=60)
    assert proc.returncode == 2 and "--data-task-size must be >= 1, and is for dynamic data" in proc.stderr


def test_data_summary_counts_the_queue_and_the_workers_last_runs():
    queue = ps_pb2.DataQueueStatus(active=True, finished=True, examples_done=1000, examples_total=1000,
                                   tasks_done=10, tasks_requeued=2,
                                   plan=ps_pb2.DataPlan(examples=400, task_size=100, seed=3, total=1000))
    # worker-1 was restarted: its first run's reported tasks are in the queue, not in its last result.
    results = [{"data": {"examples": 700, "tasks": 7, "wait_seconds": 0.25}},
               {"data": {"examples": 100, "tasks": 1, "wait_seconds": 0.5}}]
    assert data_summary(results, queue) == {
        "mode": "dynamic", "job": {"examples": 400, "task_size": 100, "seed": 3, "total": 1000},
        "finished": True, "examples_done": 1000, "tasks_done": 10, "tasks_requeued": 2,
        "examples": 800, "tasks": 8, "wait_seconds": 0.75, "worker_examples": [700, 100],
    }


def _examples_done_and_holders(ps: str) -> tuple[int, set[str]]:
    with PSClient(ps, ClientOptions(timeout=10, connect_timeout=10)) as client:
        data = client.status()[0].data
        return data.examples_done, {holder.worker_name for holder in data.holders}


@pytest.mark.timeout(400)
def test_a_killed_worker_is_restarted_and_the_job_still_trains_every_example_once():
    steps, batch = 2000, 100  # mnist1d-mlp's batch; about 20 s of training on two cores
    popen = subprocess.Popen(
        [sys.executable, "-m", "psworker.cluster", "--elastic", "--restart", "--shards", "1", "--workers", "2",
         "--task", "mnist1d-mlp", "--steps", str(steps), "--shard-arg=--lease-timeout=10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )
    lines: list[str] = []
    out: list[str] = []
    readers = [threading.Thread(target=lambda: lines.extend(popen.stderr), daemon=True),
               threading.Thread(target=lambda: out.append(popen.stdout.read()), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 240

        def pause() -> None:
            assert time.monotonic() < deadline and popen.poll() is None, "".join(lines[-60:])
            try:
                popen.wait(timeout=0.2)  # paces the loop; returns early if pscluster ends
            except subprocess.TimeoutExpired:
                pass

        while not (found := re.search(r"shard\(s\) listening: (\S+)", "".join(lines))):
            pause()
        ps = found[1]
        # A quarter of the job trained, and worker-0 holding tasks: on busy cores it may start so late
        # that worker-1 trained the quarter alone, and a worker killed before it leased has nothing to give back.
        while True:
            done, holders = _examples_done_and_holders(ps)
            if done >= steps * batch // 4 and "worker-0" in holders:
                break
            pause()
        pid = int(re.search(r"started worker0, pid (\d+)", "".join(lines))[1])
        os.kill(pid, signal.SIGKILL)
        # The restarted worker waits for the dead one's lease to expire (10 s here) before it re-registers.
        popen.wait(timeout=300)
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)  # pscluster stops its children in order
            popen.wait(timeout=60)
    for reader in readers:
        reader.join(timeout=10)
    log = "".join(lines)
    assert popen.returncode == 0, log[-5000:]
    assert f"worker0 (pid {pid}) died: exit status -9 (killed by SIGKILL); restarting it" in log
    assert "worker0 recovered in" in log and "leases data tasks again" in log

    summary = _summary("".join(out))
    (restart,) = summary["restarts"]
    assert restart["process"] == "worker0" and "resumed_at_step" not in restart
    data = summary["data"]
    # The tasks the dead worker held went back to the queue, and every example was trained once:
    # the queue counts the first run's reported tasks, which its last result line does not.
    assert data["finished"] and data["examples_done"] == data["job"]["total"] == steps * batch
    assert data["tasks_requeued"] >= 1
    assert data["examples"] < steps * batch
