"""A shard killed with SIGKILL mid-training and restarted with --restore serves again; the
workers ride through without a restart (they re-register and pull the restored weights) and the
run ends with the accuracy of an uninterrupted one. Async mode; sync mode across a restore is
not covered yet."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, child_env, start_shard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 1000


def _workers(ps: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "psworker", "--ps", ps, "--worker-index", str(i), "--num-workers", "2",
             "--threads", "1", "--progress", "log", "--task", "mnist1d-mlp", "--steps", str(STEPS)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
        )
        for i in range(2)
    ]


def _finish(procs) -> list[dict]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads([l for l in out.splitlines() if l.startswith("{")][-1]))
    return results


def _versions(ps: str) -> list[int]:
    with PSClient(ps, ClientOptions(timeout=10, connect_timeout=10)) as client:
        return [s.version for s in client.status()]


def _accuracy(ps: str) -> float:
    from psworker.training import evaluate_job

    return evaluate_job(ps, "mnist1d-mlp")["test_accuracy"]


def test_killed_shard_restores_and_training_rides_through(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = lambda i: ("--checkpoint-dir", str(ckpt), "--shard-index", str(i), "--num-shards", "2",
                       "--checkpoint-every", "100")
    shards = [start_shard(tmp_path, f"shard{i}", *flags(i)) for i in range(2)]
    try:
        ps = ",".join(s.address for s in shards)
        workers = _workers(ps)
        deadline = time.monotonic() + 300
        while min(_versions(ps)) < 500:
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers)
            try:
                workers[0].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        victim = shards[1]
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(timeout=30)
        killed = time.monotonic()
        restarted = start_shard(tmp_path, "shard1-restored", "--port", str(victim.port), *flags(1), "--restore")
        shards.append(restarted)
        recovered = time.monotonic() - killed
        log = restarted.log()
        assert "restored checkpoint" in log, log
        results = _finish(workers)
        assert [r["steps"] for r in results] == [STEPS, STEPS]
        assert sum(r["rejoins"] for r in results) >= 1, "workers should have re-registered after the restore"
        interrupted = _accuracy(ps)
    finally:
        for s in shards:
            s.stop()

    print(f"shard back {recovered:.2f}s after SIGKILL; final accuracy {interrupted:.3f}")
    # Uninterrupted runs of this job end at 0.62-0.69 (async interleavings differ run to run).
    assert interrupted >= 0.58, interrupted
