"""Worker faults with real processes: a worker killed with SIGKILL is evicted within its lease
and never blocks the others; a worker frozen past its lease is fenced off, re-registers, and its
late gradient is never applied.

These run beside the rest of the suite on two busy cores, so nothing here assumes an idle
machine: waits end on the condition (the named worker evicted), with deadlines of the lease plus
``LOAD_MARGIN``, and how soon an eviction came is read from the shard's own account ("no
heartbeat for 4.6s") rather than timed from outside through status polls, each a connection of
its own that a loaded machine can hold up for seconds."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, ShardProcess, child_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

LEASE = 4.0
"""The shards' lease. A worker heartbeats three times per lease, so a healthy worker descheduled
for a second or two on a loaded machine still renews in time (with 2 s, a full-suite run could
evict a healthy worker, which these tests would take for the victim)."""
LOAD_MARGIN = 60.0
"""Added to every wait for what the lease promises. A wait ends as soon as its condition holds,
so the margin costs nothing when the machine is idle."""
REAPER_SLACK = 3.0
"""How much longer than the lease plus one reaper period (a quarter lease) a worker may stay
silent before the shard evicts it: the reaper's thread waiting for a core."""


def _worker(ps: str, index: int, count: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psworker", "--ps", ps, "--worker-index", str(index), "--num-workers",
         str(count), "--threads", "1", "--progress", "log", "--task", "linreg", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )


def _status(ps: str):
    with PSClient(ps, ClientOptions(timeout=30, connect_timeout=30)) as client:
        return client.status()


def _entry(status, name: str):
    (entry,) = [w for w in status.workers if w.worker_name == name]
    return entry


def _evicted(ps: str, name: str) -> bool:
    """Whether every shard has evicted ``name`` (by name: under load another worker could be
    evicted too, and a count would take it for this one)."""
    return all(any(w.worker_name == name and w.evicted for w in s.workers) for s in _status(ps))


def _silences(shards: list[ShardProcess], name: str) -> list[float] | None:
    """How long ``name`` had been silent when each shard evicted it, as the shards logged it
    (None until every shard has)."""
    pattern = rf"evicted {re.escape(name)} \(generation \d+, clock \d+\): no heartbeat for ([\d.]+)s"
    found = [re.findall(pattern, shard.log()) for shard in shards]
    return [float(f[0]) for f in found] if all(found) else None


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
                            for s in _status(ps)), 120 + LOAD_MARGIN, victim, "three pushing workers at clock 3")
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait(timeout=30)
    wait_until(lambda: _evicted(ps, "worker-2"), LEASE * 1.25 + LOAD_MARGIN, others[0], "worker-2's eviction")
    seen_after = time.monotonic() - killed_at
    silences = wait_until(lambda: _silences([a, b], "worker-2"), LOAD_MARGIN, others[0], "the shards' eviction lines")
    # Never before the lease ran out; then within one reaper period (a quarter lease), give or
    # take the reaper waiting for a core.
    assert all(LEASE <= silence <= LEASE * 1.25 + REAPER_SLACK for silence in silences), silences
    results = [_result(p) for p in others]
    assert [r["steps"] for r in results] == [200, 200]
    for s in _status(ps):
        gone = _entry(s, "worker-2")
        assert gone.evicted and not gone.live
    print(f"evicted after {max(silences):.2f}s of silence (lease {LEASE}s); seen {seen_after:.2f}s after SIGKILL")


def test_frozen_worker_is_fenced_rejoins_and_nothing_is_applied_twice(shards):
    (a,) = shards(1, "--lease-timeout", str(LEASE))
    frozen = _worker(a.address, 0, 2, "--steps", "400", "--slowdown", "3")
    other = _worker(a.address, 1, 2, "--steps", "400", "--slowdown", "3")
    wait_until(lambda: all(s.version >= 20 and len([w for w in s.workers if w.pushes >= 1]) == 2
                            for s in _status(a.address)), 120 + LOAD_MARGIN, frozen, "20 updates from both workers")
    frozen.send_signal(signal.SIGSTOP)  # a paused process: no heartbeats, no pushes
    try:
        wait_until(lambda: _evicted(a.address, "worker-0"), LEASE * 1.25 + LOAD_MARGIN, other, "worker-0's eviction")
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
