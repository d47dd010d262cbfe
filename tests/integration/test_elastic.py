"""Dynamic data through the real CLI: identical ``psworker`` processes without indices share the
job's data exactly, in every consistency mode, hand back what they hold on SIGTERM, and a
worker whose plan disagrees with the job's is told why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, child_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BATCH = 64
TASK = 128
STEPS = 120
"""The shared job's length: the slow worker (20 times slower) takes several seconds alone, so
the fast one joins while it runs."""


def _worker(ps: str, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psworker", "--ps", ps, "--task", "linreg", "--worker-name", name,
         "--batch-size", str(BATCH), "--data-task-size", str(TASK), "--threads", "1", "--progress", "log",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return {**json.loads(lines[0]), "log": err}


def _queue(ps: str):
    with PSClient(ps, ClientOptions(timeout=10, connect_timeout=30)) as client:
        return client.status()[0].data


@pytest.mark.parametrize("mode", [
    pytest.param(("async",), id="async"),
    pytest.param(("ssp", "--staleness", "2"), id="ssp"),
    pytest.param(("sync",), id="sync"),
])
def test_identical_workers_share_the_job_exactly(shards, mode):
    """Two workers, one 20 times slower, train one job of 120 steps' examples, the fast one
    joining mid-epoch: together they train every example once, the fast one more of them in
    async; in ssp/sync the worker that runs out first, finding
    nothing free at the end, leaves the membership while it waits instead of holding the slow
    one back, and both exit 0 with the job's data done."""
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    flags = ("--mode", *mode[0:1], *mode[1:], "--steps", str(STEPS))
    slow = _worker(ps, "slow", *flags, "--slowdown", "20")
    # The fast one joins a running job (mid-epoch), so both are members until the data runs out.
    wait_until(lambda: (q := _queue(ps)) is not None and q.examples_done >= TASK, 120, slow,
               "the slow worker to finish a task")
    fast = _worker(ps, "fast", *flags)
    results = [_finish(fast), _finish(slow)]
    total = STEPS * BATCH
    assert sum(r["data"]["examples"] for r in results) == total, results
    assert all(r["data"]["job"]["total"] == total and not r["data"]["stopped"] for r in results)
    # At least one exchange each made by the training loop itself: the one that learned the job was done.
    assert all(r["data"]["stalls"] >= 1 and r["data"]["stall_seconds"] >= 0 for r in results), results
    # The prefetching exchanges rode on steps' push-and-pulls to shard 0, which holds the whole small model.
    assert all(r["data"]["rides"] >= 1 for r in results), results
    assert sum(r["samples"] for r in results) == total
    queue = _queue(ps)
    assert queue.finished and queue.examples_done == total and queue.tasks_leased == 0
    assert queue.tasks_done == sum(r["data"]["tasks"] for r in results) == total // TASK
    assert results[0]["test_loss"] < 1.0  # linreg's targets have unit variance: it learned
    if mode[0] == "async":
        assert results[0]["data"]["examples"] > results[1]["data"]["examples"], results
    else:  # the last task was the other's: the one without waited outside the membership
        assert any(f"leaving the {mode[0]} membership while it waits" in r["log"] for r in results), \
            [r["log"][-2000:] for r in results]


def test_sigterm_hands_back_the_rest_and_exits_zero(shards):
    """A worker stopped by SIGTERM mid-task reports what it trained and gives the rest back:
    nothing it held is lost, and a second worker finishes the job with exactly the rest."""
    (a,) = shards(1)
    first = _worker(a.address, "first", "--steps", "60", "--slowdown", "4")
    wait_until(lambda: (q := _queue(a.address)) is not None and q.examples_done >= 2 * TASK, 120, first,
               "the first worker to finish two tasks")
    first.send_signal(signal.SIGTERM)
    stopped = _finish(first, timeout=60)
    assert stopped["data"]["stopped"] is True
    queue = _queue(a.address)
    assert queue.examples_done == stopped["data"]["examples"] and queue.tasks_leased == 0, queue
    assert not queue.finished and queue.tasks_requeued >= 1  # its prefetched task (and remainder) went back
    second = _finish(_worker(a.address, "second", "--steps", "60"))
    assert stopped["data"]["examples"] + second["data"]["examples"] == 60 * BATCH
    assert _queue(a.address).finished


def test_a_worker_with_another_plan_is_told_which(shards):
    (a,) = shards(1)
    first = _finish(_worker(a.address, "first", "--steps", "4"))
    assert first["data"]["examples"] == 4 * BATCH
    other = _worker(a.address, "other", "--steps", "8")
    out, err = other.communicate(timeout=120)
    assert other.returncode == 1, err[-3000:]
    assert "the job's data plan is 256 examples" in err and "asks for 512 examples" in err, err[-3000:]
