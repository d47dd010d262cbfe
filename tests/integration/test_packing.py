"""A model small enough to live whole on shard 0 (``pswire.placement.PACK_BELOW``; psworker's
default): two workers train it on two shards with one call per step, shard 1 holding nothing
and hearing no step; a worker that spreads it is refused, naming the flag; and the model comes
out of the shards and of a checkpoint whole, to readers that were never told the layout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from psworker.tasks import load_task
from psworker.training import pull_task
from tests.conftest import ROOT, packed_env, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 700


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def _ctl(*argv: str) -> subprocess.CompletedProcess:
    return run_cli("psworker.ctl", *argv, timeout=120)


def test_a_small_model_lives_whole_on_shard_0(shards, tmp_path):
    ckpt = tmp_path / "checkpoints"
    a, b = shards(2, "--checkpoint-dir", str(ckpt))
    ps = f"{a.address},{b.address}"
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "psworker", "--ps", ps, "--task", "mnist1d-mlp", "--worker-index", str(i),
             "--num-workers", "2", "--steps", str(STEPS), "--threads", "1", "--progress", "log"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=packed_env(),
        )
        for i in range(2)
    ]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=400)
        results.append(_result(subprocess.CompletedProcess(w.args, w.returncode, out, err)))
    assert all(r["steps"] == STEPS for r in results)
    assert max(r["test_accuracy"] for r in results) >= 0.55, results

    first, second = json.loads(_ctl("status", "--ps", ps, "--json").stdout)
    model = load_task("mnist1d-mlp").model
    assert [(p["name"], p["row_start"], p["row_end"]) for p in first["parts"]] == [
        (name, 0, p.shape[0]) for name, p in model.named_parameters()]
    assert (first["pushes_applied"], first["version"]) == (2 * STEPS, 2 * STEPS)
    # Shard 1 holds nothing: both workers joined it (leases, the job's membership) but no step
    # called it.
    assert (second["state"], second["parts"], second["bytes_held"]) == ("ready", [], 0)
    assert (second["pushes_applied"], second["version"]) == (0, 0)
    assert sorted(w["worker_name"] for w in second["workers"]) == ["worker-0", "worker-1"]

    # A worker that spreads the model disagrees with the job's placement, and is told why.
    spread = run_cli("psworker", "--ps", ps, "--task", "mnist1d-mlp", "--steps", "5", "--threads", "1",
                     "--pack-below", "0")
    assert spread.returncode == 1 and "--pack-below" in spread.stderr, spread.stderr[-2000:]

    # Readers learn the layout from the shards: pull_task (pscluster's evaluation), export from
    # the running shards and from a checkpoint give the same weights.
    pulled = pull_task(ps, "mnist1d-mlp").model.state_dict()
    exported = _ctl("export", "--ps", ps, "--out", str(tmp_path / "shards.safetensors"))
    assert exported.returncode == 0 and "from 2 shard(s)" in exported.stdout, exported.stderr[-3000:]
    from_shards = load_file(tmp_path / "shards.safetensors")
    assert from_shards.keys() == pulled.keys() and all(torch.equal(from_shards[k], pulled[k]) for k in pulled)
    done = _ctl("checkpoint", "--ps", ps, "--id", "7")
    assert done.returncode == 0 and "complete" in done.stdout, done.stderr
    a.stop()
    b.stop()
    from_ckpt = _ctl("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "ckpt.safetensors"))
    assert from_ckpt.returncode == 0, from_ckpt.stderr[-3000:]
    restored = load_file(tmp_path / "ckpt.safetensors")
    assert restored.keys() == pulled.keys() and all(torch.equal(restored[k], pulled[k]) for k in pulled)
