"""The model parameter servers exist for: a 10-million-row x 64 float32 embedding table (2.4
GiB, plus Adagrad's sums) trained by 2 workers on 2 shards. Neither worker ever holds the table
(each stays far below 1.5 GiB resident), and the DLRM-like task reaches 0.95 of its planted
teacher's AUC."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from psworker.client import ClientOptions, PSClient
from tests.conftest import ROOT, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROWS = 10_000_000
LIMIT = 1536 << 20


def _peak_rss(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), in bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_ten_million_row_table_trains_on_two_shards_with_small_workers(shards):
    a, b = shards(2)
    ps = f"{a.address},{b.address}"
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "psworker", "--ps", ps, "--task", "dlrm-synth", "--task-options", f"rows={ROWS}",
             "--worker-index", str(i), "--num-workers", "2", "--threads", "1", "--progress", "log"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
        )
        for i in range(2)
    ]
    peaks = [0, 0]
    outputs = [None, None]
    deadline = time.monotonic() + 500
    try:
        # Read each worker's peak while it runs (VmHWM only grows), and its output at the end.
        while any(w.poll() is None for w in workers):
            assert time.monotonic() < deadline, "training did not finish"
            for i, w in enumerate(workers):
                peaks[i] = max(peaks[i], _peak_rss(w.pid))
            try:
                workers[0].wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
        for i, w in enumerate(workers):
            outputs[i] = w.communicate(timeout=60)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    results = []
    for w, (out, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-4000:]
        results.append(json.loads([l for l in out.splitlines() if l.startswith("{")][-1]))
    with PSClient(ps, ClientOptions(timeout=10)) as client:
        statuses = client.status()
    tables = [s.tables[0] for s in statuses]
    assert [t.spec.num_rows for t in tables] == [ROWS, ROWS] and sum(t.rows_held for t in tables) == ROWS
    written = sum(t.rows_written for t in tables)
    print(f"peak worker RSS {[round(p / 2**20) for p in peaks]} MiB; AUC "
          f"{[round(r['test_auc'], 4) for r in results]} vs teacher {results[0]['teacher_auc']:.4f}; "
          f"{written} of {ROWS} rows written; {[r['samples_per_second'] for r in results]} samples/s")
    assert all(0 < p < LIMIT for p in peaks), peaks
    assert 0 < written < ROWS
    for r in results:
        assert r["test_auc"] >= 0.95 * r["teacher_auc"], r
        # Well above what the dense features alone reach: the table learned.
        assert r["test_auc"] > r["teacher_dense_auc"] + 0.01, r
