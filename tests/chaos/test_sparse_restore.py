"""A shard holding half of an embedding table is killed with SIGKILL mid-training and restarted
with --restore: its rows are those of the checkpoint it restored, bit for bit (rows never
written at their initial values), and the workers ride through to the end."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pswire.tables import initial_rows
from pswire.v1 import ps_pb2
from pswire.wire import rows_from_proto, rows_to_proto, table_from_proto
from psserver.checkpoint import CheckpointStore
from psworker.client import ClientOptions, PSClient
from psworker.shard import ShardClient
from tests.chaos.sparse_task import ROWS
from tests.conftest import ROOT, child_env, start_shard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 400  # each worker's (a static split)
TASK = "tests.chaos.sparse_task:task"


def _statuses(ps: str) -> list[ps_pb2.StatusResponse]:
    with PSClient(ps, ClientOptions(timeout=10, connect_timeout=10)) as client:
        return client.status()


def _shard_rows(address: str, ids: np.ndarray, dim: int) -> np.ndarray:
    client = ShardClient(address, ClientOptions(timeout=30, connect_timeout=30))
    try:
        out = []
        for start in range(0, ids.size, 4096):  # a reader's reads, in pieces
            reply = client.pull_rows(ps_pb2.PullRowsRequest(clock=-1, rows=[rows_to_proto("emb", ids[start:start + 4096])]),
                                     4096 * dim * 4, may_wait=False)
            got, values = rows_from_proto(reply.rows[0], dim)
            assert np.array_equal(got, ids[start:start + 4096])
            out.append(values)
        return np.concatenate(out)
    finally:
        client.close()


def test_killed_table_shard_restores_its_rows_bit_for_bit_and_training_finishes(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = lambda i: ("--checkpoint-dir", str(ckpt), "--shard-index", str(i), "--num-shards", "2",
                       "--checkpoint-every", "20")
    shards = [start_shard(tmp_path, f"shard{i}", *flags(i)) for i in range(2)]
    workers = []
    try:
        ps = ",".join(s.address for s in shards)
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "psworker", "--ps", ps, "--worker-index", str(i), "--num-workers", "2",
                 "--threads", "1", "--progress", "log", "--task", TASK, "--steps", str(STEPS)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 300
        while min(s.version for s in _statuses(ps)) < 300:
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "training stalled"
            try:
                workers[0].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        # Hold the workers, so that the restored rows are read before anyone pushes again.
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        try:
            before = _statuses(ps)[1].tables[0]
            assert before.rows_written > 0 and before.step >= 100
            victim = shards[1]
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait(timeout=30)
            restored = start_shard(tmp_path, "shard1-restored", "--port", str(victim.port), *flags(1), "--restore")
            shards.append(restored)
            match = re.search(r"restored checkpoint (\d+)", restored.log())
            assert match, restored.log()
            checkpoint_id = int(match.group(1))

            # The checkpoint's part of shard 1, read from disk: its pieces of written rows.
            _, parts = CheckpointStore(ckpt).load_all(checkpoint_id)
            part = parts[1]
            (table_doc,) = part.metadata["tables"]
            assert table_doc["pieces"] >= 1
            ids = np.concatenate([a for k, a in sorted(part.tensors.items()) if k.startswith("rows/") and k.endswith("/ids")])
            values = np.concatenate([a for k, a in sorted(part.tensors.items())
                                     if k.startswith("rows/") and k.endswith("/values")])
            status = _statuses(ps)[1]
            (table,) = status.tables
            spec = table_from_proto(table.spec)
            assert table.step == table_doc["step"] and table.rows_written == ids.size
            assert status.tables[0].step <= before.step  # a checkpoint's, not later

            mine = np.arange(1, ROWS, 2)
            expected = initial_rows(spec, mine)
            expected[ids // 2] = values
            served = _shard_rows(restored.address, mine, spec.dim)
            assert served.dtype == np.float32
            assert np.array_equal(served.view(np.uint32), expected.view(np.uint32)), "restored rows differ"
            print(f"checkpoint {checkpoint_id}: {ids.size} written rows of {mine.size} restored bit for bit, "
                  f"step {table.step} (the shard had reached {before.step})")
        finally:
            for w in workers:
                w.send_signal(signal.SIGCONT)
        results = []
        for w in workers:
            out, err = w.communicate(timeout=400)
            assert w.returncode == 0, err[-4000:]
            results.append(json.loads([l for l in out.splitlines() if l.startswith("{")][-1]))
        assert [r["steps"] for r in results] == [STEPS] * 2
        assert sum(r["rejoins"] for r in results) >= 1, "workers should have re-registered after the restore"
        final = _statuses(ps)
        assert all(s.tables[0].step > 0 for s in final)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        for s in shards:
            s.stop()
