"""pscluster's summary is the last line even with its children's logs on the same stream (as on
a terminal), and ``--run-dir`` keeps the run's files: every child's log, pscluster's own and
the summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_summary_is_the_last_line_and_the_run_directory_is_kept(tmp_path):
    run_dir = tmp_path / "run"
    merged = subprocess.run(
        [sys.executable, "-m", "psworker.cluster", "--shards", "2", "--workers", "1", "--task", "mnist1d-mlp",
         "--steps", "40", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=ROOT, timeout=240,
    )
    assert merged.returncode == 0, merged.stdout[-3000:]
    last = merged.stdout.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["steps"] == 40
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    logs = {p.name: p.read_text() for p in (run_dir / "logs").iterdir()}
    assert set(logs) == {"shard0.log", "shard1.log", "worker0.log"}
    assert '"steps": 40' in logs["worker0.log"]  # the worker's own JSON line, as it wrote it
    assert all("shutting down" in logs[f"shard{i}.log"] for i in (0, 1)), logs  # relayed before the summary
    assert "run directory" in (run_dir / "pscluster.log").read_text()

    again = run_cli("psworker.cluster", "--shards", "1", "--workers", "1", "--task", "mnist1d-mlp", "--steps", "5",
                    "--run-dir", str(run_dir), timeout=60)
    assert again.returncode == 2 and "new or empty directory" in again.stderr, again.stderr
