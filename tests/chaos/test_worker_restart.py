"""A worker killed with SIGKILL mid-training and started again with the same flags re-registers
under its name, gets back the data position the shards recorded from its pushes, and goes on
from there: it runs exactly its share of steps across both lives, and the job ends with the
accuracy of an uninterrupted one. One started again after its last step runs no more."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, child_env, run_cli, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 800
BATCH = 100  # mnist1d-mlp's default
PER_EPOCH = 20  # batches in a worker's slice: 4000 examples / 2 workers / BATCH
VICTIM = "worker-0"


def _worker(ps: str, index: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psworker", "--ps", ps, "--worker-index", str(index), "--num-workers", "2",
         "--threads", "1", "--progress", "log", "--task", "mnist1d-mlp", "--steps", str(STEPS)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1]), err


def _records(ps: str, name: str) -> list:
    """A worker's record on every shard (its pushes count across its generations)."""
    with PSClient(ps, ClientOptions(timeout=10, connect_timeout=10)) as client:
        return [w for s in client.status() for w in s.workers if w.worker_name == name]


def _victim(ps: str) -> list:
    return _records(ps, VICTIM)


def test_killed_worker_restarted_resumes_its_data_position(shards):
    a, b = shards(2, "--lease-timeout", "10")  # the restarted victim waits for its dead registration's lease
    ps = f"{a.address},{b.address}"
    victim, other = _worker(ps, 0), _worker(ps, 1)
    try:
        # Killed a third of the way in, once it pushed to both shards (each holds some of the model).
        wait_until(lambda: len(v := _victim(ps)) == 2 and min(w.pushes for w in v) >= STEPS // 3,
                    240, victim, f"{VICTIM} to push {STEPS // 3} steps")
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait(timeout=30)
        before = [w.pushes for w in _victim(ps)]  # final: a dead worker pushes no more
        # A push cut off by the kill may have reached one shard and not the other.
        assert max(before) - min(before) <= 1, before
        reached = max(before)
        assert reached < STEPS, "the victim finished before it was killed"

        victim = _worker(ps, 0)  # the same flags, so the same worker name
        wait_until(lambda: all(w.generation == 2 for w in _victim(ps)), 240, victim, "re-registration")
        rejoined = time.monotonic() - killed_at
        result, log = _finish(victim)
        others, _ = _finish(other)
    finally:
        for p in (victim, other):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)

    # It resumed right after the last step the shards recorded, at that step's data position.
    assert result["first_step"] == reached + 1, (result["first_step"], reached)
    # Its cursor after step S: batch S - 1 (from 0) of the epoch-long permutations, consumed.
    epoch, position = (reached - 1) // PER_EPOCH, ((reached - 1) % PER_EPOCH + 1) * BATCH
    match = re.search(r"resumes at step (\d+) of (\d+) \(epoch (\d+), position (\d+)\)", log)
    assert match, log[-3000:]
    assert [int(g) for g in match.groups()] == [reached + 1, STEPS, epoch, position], match.group(0)
    # Its share, no more: this life ran the rest, and the shards got each step once.
    assert result["steps"] == STEPS and result["samples"] == (STEPS - reached) * BATCH
    after = [w.pushes for w in _victim(ps)]
    assert after == [n + STEPS - reached for n in before], (before, after, reached)
    assert others["steps"] == STEPS and others["rejoins"] == 0 and result["rejoins"] == 0

    from psworker.training import evaluate_job

    accuracy = evaluate_job(ps, "mnist1d-mlp")["test_accuracy"]
    print(f"{VICTIM} killed after step {reached}, re-registered {rejoined:.2f}s after SIGKILL "
          f"(restart included), resumed at step {result['first_step']}; final accuracy {accuracy:.3f}")
    assert accuracy >= 0.55, accuracy


def test_worker_restarted_after_its_last_step_finishes_without_training_more(shards):
    """Killed between its last push and its result line, a worker started again finds all its
    steps recorded: it runs none and still reports (no loss of its own: ``final_loss`` is None)."""
    (a,) = shards(1)
    args = ("--ps", a.address, "--task", "linreg", "--steps", "30", "--threads", "1", "--progress", "log",
            "--worker-index", "0")  # the static split: a restarted worker resumes at its recorded step
    first = run_cli("psworker", *args, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_cli("psworker", *args, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads([line for line in again.stdout.splitlines() if line.startswith("{")][-1])
    assert "resumes at step 31 of 30" in again.stderr
    assert result["first_step"] == 31 and result["samples"] == 0 and result["final_loss"] is None
    assert result["test_loss"] < 0.05
    (worker,) = _records(a.address, "worker-0")
    assert worker.pushes == 30
