"""The consistency dial with real shard and worker processes: sync equals local training, the
SSP bound holds with a straggler, and a departing worker never blocks the others."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from pswire.v1 import ps_pb2
from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, child_env, run_cli, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _json(out: str) -> dict:
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


def _worker(ps: str, index: int, count: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psworker", "--ps", ps, "--worker-index", str(index), "--num-workers",
         str(count), "--threads", "1", "--progress", "log", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )


def _status(ps: str) -> list[ps_pb2.StatusResponse]:
    with PSClient(ps, ClientOptions(timeout=10, connect_timeout=10)) as client:
        return client.status()


def _wait_exit(proc: subprocess.Popen, timeout: float) -> None:
    """Paces a polling loop: returns when ``proc`` exits or after ``timeout`` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[dict]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        results.append(_json(out))
    return results


@pytest.mark.parametrize("optimizer", [
    ("sgd", "--momentum", "0.9"), ("adam",),
    # The shard's schedule over its updates against --local's over its steps.
    ("adam", "--lr-schedule", "cosine", "--warmup-steps", "20", "--min-lr-ratio", "0.1"),
], ids=["sgd", "adam", "adam-warmup-cosine"])
def test_sync_with_one_worker_matches_local_step_for_step(shards, optimizer):
    (a,) = shards(1)
    args = ("--task", "mnist1d-mlp", "--steps", "200", "--threads", "1", "--record-losses",
            "--optimizer", *optimizer)
    local = _json(run_cli("psworker", "--local", *args).stdout)
    proc = run_cli("psworker", "--ps", a.address, "--mode", "sync", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    synced = _json(proc.stdout)
    assert len(local["losses"]) == len(synced["losses"]) == 200
    for step, (x, y) in enumerate(zip(local["losses"], synced["losses"])):
        assert y == pytest.approx(x, rel=1e-6), f"step {step}"
    (status,) = _status(a.address)
    assert status.consistency.mode == "sync" and status.version == 200 and status.max_staleness == 0


def test_ssp_bound_holds_with_a_five_times_slower_worker(shards):
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    bound = 2
    common = ("--task", "linreg", "--steps", "120", "--mode", "ssp", "--staleness", str(bound))
    procs = [_worker(ps, i, 3, *common, *(("--slowdown", "5") if i == 2 else ())) for i in range(3)]
    # While they run, live workers' clocks never spread further than the bound allows: a worker
    # at clock c reads once all reached c - S, then pushes, reaching c + 1.
    spread_seen = 0
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for shard in _status(ps):
            clocks = [w.clock for w in shard.workers if w.live]
            if len(clocks) == 3:
                spread = max(clocks) - min(clocks)
                assert spread <= bound + 1, [(w.worker_name, w.clock) for w in shard.workers]
                spread_seen = max(spread_seen, spread)
        _wait_exit(procs[0], 0.2)
    results = _finish(procs)
    assert all(r["steps"] == 120 for r in results)
    assert spread_seen >= 1, "fast workers never ran ahead of the straggler"
    statuses = _status(ps)
    for shard in statuses:
        assert shard.consistency.mode == "ssp" and shard.consistency.staleness == bound
        assert shard.max_staleness <= bound
        assert shard.pushes_dropped == 0 and shard.pushes_scaled == 0
        assert sum(b.count for b in shard.staleness_histogram) == shard.pushes_applied
    # The fast workers waited, but not necessarily on every shard: a pull is sent to both at
    # once, and a shard that the straggler's push reached first lets it through (one CI run saw
    # every wait land on shard 0, the other shard holding only the 4-byte bias).
    assert sum(s.pull_wait_seconds for s in statuses) > 0, "fast workers should have waited for the straggler"
    table = run_cli("psworker.ctl", "status", "--ps", ps, timeout=60).stdout
    assert "ssp S=2" in table and "staleness histogram 0:" in table


@pytest.mark.parametrize("mode", [("ssp", "--staleness", "1"), ("sync",)], ids=["ssp", "sync"])
def test_stopping_the_slow_worker_lets_the_others_finish(shards, mode):
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    common = ("--task", "linreg", "--mode", *mode)
    slow = _worker(ps, 2, 3, *common, "--steps", "100000", "--slowdown", "30")
    fast = [_worker(ps, i, 3, *common, "--steps", "150") for i in range(2)]
    deadline = time.monotonic() + 120
    # Wait until the slow worker itself has joined and pushed (it starts slowly under load).
    while not all(
        any(w.worker_name == "worker-2" and w.live and w.pushes >= 1 for w in s.workers) and s.clock >= 3
        for s in _status(ps)
    ):
        assert time.monotonic() < deadline, "the job never got going"
        assert slow.poll() is None and all(p.poll() is None for p in fast)
        _wait_exit(slow, 0.2)
    slow.send_signal(signal.SIGTERM)
    out, err = slow.communicate(timeout=60)
    assert slow.returncode == 130, err[-2000:]
    results = _finish(fast, timeout=300)
    assert [r["steps"] for r in results] == [150, 150]
    for shard in _status(ps):
        (gone,) = [w for w in shard.workers if w.worker_name == "worker-2"]
        assert not gone.live


def test_sync_with_a_backup_worker_drops_the_late_gradient(shards):
    (a,) = shards(1)
    common = ("--task", "linreg", "--steps", "60", "--mode", "sync", "--backup-workers", "1")
    procs = [_worker(a.address, i, 3, *common, *(("--slowdown", "4") if i == 2 else ())) for i in range(3)]
    results = _finish(procs)
    assert all(r["steps"] == 60 for r in results)
    (status,) = _status(a.address)
    # One aggregate per clock from 2 of the 3 gradients; most of the straggler's are dropped.
    assert status.pushes_applied == status.version and status.version >= 60
    assert status.pushes_dropped > 0 and status.max_staleness == 0


def test_a_worker_asking_for_another_mode_gets_a_clear_error(shards):
    (a,) = shards(1)
    first = run_cli("psworker", "--ps", a.address, "--task", "linreg", "--steps", "3", "--mode", "ssp",
                    "--staleness", "2", "--threads", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    other = run_cli("psworker", "--ps", a.address, "--task", "linreg", "--steps", "3", "--threads", "1",
                    "--worker-index", "1", "--num-workers", "2")
    assert other.returncode == 1
    assert "consistency differs from the job's: job runs ssp (S=2" in other.stderr
    assert "worker asked for async" in other.stderr


def test_sync_workers_hold_step_one_until_all_have_joined(shards):
    """Every sync clock averages every worker's gradient from the first: a worker that starts
    early waits for the others (and gives up after --wait-timeout) instead of training alone."""
    (a,) = shards(1)
    common = ("--task", "linreg", "--steps", "20", "--mode", "sync")
    alone = _worker(a.address, 0, 2, *common, "--wait-timeout", "3")
    out, err = alone.communicate(timeout=120)
    assert alone.returncode == 1 and "only 1 of 2 workers joined the sync job within 3s" in err, err[-2000:]
    (status,) = _status(a.address)
    assert status.version == 0 and status.pushes_received == 0

    first = _worker(a.address, 0, 2, *common)
    wait_until(lambda: any(w.live and w.worker_name == "worker-0" for w in _status(a.address)[0].workers),
               120, first, "the first worker's registration")
    second = _worker(a.address, 1, 2, *common)
    assert [r["steps"] for r in _finish([first, second])] == [20, 20]
    (status,) = _status(a.address)
    # 20 clocks of two gradients each: nobody stepped alone before the other joined.
    assert (status.version, status.pushes_received, status.pushes_applied) == (20, 40, 20)


def test_min_workers_holds_dynamic_async_workers_at_step_one_until_enough_have_joined(shards):
    """--min-workers, in any mode and with dynamic data: an early worker trains nothing until
    the others have joined (and gives up after --wait-timeout when they never do)."""
    (a,) = shards(1)

    def dynamic(name: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "psworker", "--ps", a.address, "--task", "linreg", "--steps", "40",
             "--threads", "1", "--progress", "log", "--worker-name", name, "--min-workers", "2", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)

    alone = dynamic("early", "--wait-timeout", "3")
    out, err = alone.communicate(timeout=120)
    assert alone.returncode == 1 and "only 1 of 2 workers joined the async job within 3s" in err, err[-2000:]
    (status,) = _status(a.address)
    assert status.pushes_received == 0  # it trained nothing while it waited

    first = dynamic("first")
    wait_until(lambda: any(w.live and w.worker_name == "first" for w in _status(a.address)[0].workers),
               120, first, "the first worker's registration")
    (status,) = _status(a.address)
    assert status.pushes_received == 0  # registered, and holding step 1
    second = dynamic("second")
    results = _finish([first, second])
    assert sum(r["steps"] for r in results) == 40  # the job's steps, shared
