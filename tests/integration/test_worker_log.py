"""A worker's log carries the worker's news only: importing mnist1d makes matplotlib build its
font cache in a fresh MPLCONFIGDIR, which it announces at INFO, and that line must not show.
(The worker generates MNIST-1D here, data cache off: one that reads the cache imports neither.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_a_worker_with_a_fresh_matplotlib_cache_logs_nothing_of_matplotlib(tmp_path):
    config_dir = tmp_path / "mpl"
    proc = subprocess.run(
        [sys.executable, "-m", "psworker", "--local", "--task", "mnist1d-mlp", "--steps", "20", "--progress", "log"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env=dict(child_env(), MPLCONFIGDIR=str(config_dir), PSGRPC_CACHE_DIR="off"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(config_dir.glob("fontlist-*.json")), "matplotlib built no font cache: the case was not exercised"
    noise = [line for line in proc.stderr.splitlines() if "fontmanager" in line.lower() or "matplotlib" in line.lower()]
    assert not noise, proc.stderr
    assert "worker-0 step 20/20" in proc.stderr  # the worker's own INFO lines still show
