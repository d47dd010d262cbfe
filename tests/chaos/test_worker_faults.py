"""Worker faults with real processes: a worker killed with SIGKILL is evicted within its lease
and never blocks the others; a worker frozen past its lease is fenced off, re-registers, and its
late gradient is never applied."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, child_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

LEASE = 2.0


def _worker(ps: str, index: int, count: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psworker", "--ps", ps, "--worker-index", str(index), "--num-workers",
         str(count), "--threads", "1", "--progress", "log", "--task", "linreg", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )


def _status(ps: str):
    with PSClient(ps, ClientOptions(timeout=10, connect_timeout=10)) as client:
        return client.status()


def _result(proc: subprocess.Popen, timeout: float = 300) -> dict:
    return _result_and_log(proc, timeout)[0]


def _result_and_log(proc: subprocess.Popen, timeout: float = 300) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1]), err


@pytest.mark.parametrize("mode", [("ssp", "--staleness", "1"), ("sync",)], ids=["ssp", "sync"])
def test_killed_worker_is_evicted_within_the_lease_and_blocks_nobody(shards, mode):
    a, b = shards(2, "--lease-timeout", str(LEASE))
    ps = f"{a.address},{b.address}"
    victim = _worker(ps, 2, 3, "--mode", *mode, "--steps", "100000")
    others = [_worker(ps, i, 3, "--mode", *mode, "--steps", "200") for i in range(2)]
    wait_until(lambda: all(len([w for w in s.workers if w.live and w.pushes >= 1]) == 3 and s.clock >= 3
                            for s in _status(ps)), 120, victim, "three pushing workers at clock 3")
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait(timeout=30)
    wait_until(lambda: all(s.workers_evicted == 1 for s in _status(ps)), 4 * LEASE, others[0], "eviction")
    evict_seconds = time.monotonic() - killed_at
    # Lease plus one reaper period (a quarter lease) plus scheduling slack.
    assert evict_seconds <= LEASE * 1.25 + 1.5, evict_seconds
    results = [_result(p) for p in others]
    assert [r["steps"] for r in results] == [200, 200]
    for s in _status(ps):
        (gone,) = [w for w in s.workers if w.worker_name == "worker-2"]
        assert gone.evicted and not gone.live
    print(f"evicted {evict_seconds:.2f}s after SIGKILL (lease {LEASE}s)")


def test_frozen_worker_is_fenced_rejoins_and_nothing_is_applied_twice(shards):
    (a,) = shards(1, "--lease-timeout", str(LEASE))
    frozen = _worker(a.address, 0, 2, "--steps", "400", "--slowdown", "3")
    other = _worker(a.address, 1, 2, "--steps", "400", "--slowdown", "3")
    wait_until(lambda: all(s.version >= 20 and len([w for w in s.workers if w.pushes >= 1]) == 2
                            for s in _status(a.address)), 120, frozen, "20 updates from both workers")
    frozen.send_signal(signal.SIGSTOP)  # a paused process: no heartbeats, no pushes
    try:
        wait_until(lambda: _status(a.address)[0].workers_evicted == 1, 4 * LEASE, other, "eviction")
    finally:
        frozen.send_signal(signal.SIGCONT)
    (frozen_result, frozen_log), other_result = _result_and_log(frozen), _result(other)
    results = [frozen_result, other_result]
    assert results[0]["rejoins"] >= 1 and results[1]["rejoins"] == 0
    (status,) = _status(a.address)
    (worker,) = [w for w in status.workers if w.worker_name == "worker-0"]
    assert worker.generation >= 2 and not worker.evicted  # it left cleanly at the end
    # The gradient computed across the freeze never lands: the shard refused it (and counted
    # it), or a refused heartbeat told the worker first and it dropped the gradient unsent.
    assert status.pushes_rejected >= 1 or "a heartbeat was refused" in frozen_log, frozen_log[-3000:]
    assert status.pushes_applied == status.version
    assert status.pushes_applied + status.pushes_rejected == status.pushes_received
    assert status.pushes_applied <= 800
