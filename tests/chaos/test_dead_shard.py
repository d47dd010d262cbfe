"""A shard killed with SIGKILL and never restarted: the worker retries it for its retry budget in
attempts a couple of seconds apart (a refused connection fails at once, rather than each attempt
waiting out its deadline), then exits non-zero with an error that names the shard, the reason and
since when; its Leave on the way out does not wait on the dead shard, and the healthy shard never
tells it that it left. (Riding through a shard that comes back is test_shard_restore's.)"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, child_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RETRY = 10.0
"""The worker's --retry-timeout (120 s by default)."""
RPC_TIMEOUT = 30.0
"""The worker's --rpc-timeout (the default): one attempt that waited out its deadline would take
this long, three times the retry budget."""
LOAD_MARGIN = 30.0
"""Added to the worker's time to give up: process exit and a busy machine's scheduling."""


def _versions(ps: str) -> list[int]:
    with PSClient(ps, ClientOptions(timeout=30, connect_timeout=30)) as client:
        return [s.version for s in client.status()]


def test_a_worker_gives_up_on_a_dead_shard_in_its_retry_budget_and_says_why(shards, tmp_path):
    healthy, victim = shards(2)
    ps = f"{healthy.address},{victim.address}"
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "psworker", "--ps", ps, "--task", "linreg", "--worker-index", "0",
             "--num-workers", "1", "--steps", "100000000", "--threads", "1", "--progress", "log",
             "--rpc-timeout", str(RPC_TIMEOUT), "--retry-timeout", str(RETRY)],
            stdout=subprocess.DEVNULL, stderr=log, env=child_env(), cwd=ROOT,
        )
    try:
        wait_until(lambda: min(_versions(ps)) >= 5, 120, worker, "five updates on both shards")
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(timeout=30)
        killed = time.monotonic()
        returncode = worker.wait(timeout=RETRY + RPC_TIMEOUT + LOAD_MARGIN)
        took = time.monotonic() - killed
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
    err = log_path.read_text(errors="replace")
    assert returncode == 1, err[-3000:]
    (final,) = [line for line in err.splitlines() if " ERROR " in line]
    assert f"shard {victim.address} unreachable: connection refused since" in final, final
    # The budget went on attempts a couple of seconds apart, not on one deadline.
    spent = re.search(r"giving up on [a-z ]+ after (\d+)s \((\d+) attempts\)", final)
    assert spent is not None, final
    assert RETRY - 3 <= int(spent[1]) <= RETRY + 1 and int(spent[2]) >= 4, final
    assert took < RETRY + LOAD_MARGIN, (took, err[-3000:])
    assert f"leaving {victim.address}: shard {victim.address} unreachable" in err
    assert "left the job" not in err and "Deadline Exceeded" not in err, err[-3000:]
    print(f"worker exited {took:.1f}s after the shard's SIGKILL: {final}")
