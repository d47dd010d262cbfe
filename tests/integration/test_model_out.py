"""The trained model comes out (DESIGN §9) as safetensors named by the model's ``state_dict()``
keys, and a freshly built task model that loads it scores what the run reported: from
``pscluster --save``, from each worker (``psworker --save``), from the running shards (``psctl
export --ps``, with a reader's token) and from a checkpoint directory with no shard running
(``psctl export --checkpoint``, ``psworker.load_checkpoint``). The second job's first layer is
split by rows across its two shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import psworker
from pswire.security import ClientSecurity, write_private_file
from psworker.client import ClientOptions
from psworker.tasks import evaluate, load_task
from psworker.training import pull_task
from tests.conftest import ROOT, child_env, run_cli
from tests.integration.wide_task import WIDTH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WIDE = "tests.integration.wide_task:wide_mlp"


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def _scores(task_spec: str, state: dict[str, torch.Tensor]) -> dict:
    """The test metrics of a freshly built task model that loads ``state`` (strictly: every
    key of its state_dict, and nothing else)."""
    task = load_task(task_spec)
    task.model.load_state_dict(state)
    return evaluate(task.model, task)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_pscluster_save_writes_the_model_it_evaluated(tmp_path):
    out = tmp_path / "model.safetensors"
    summary = _result(run_cli("psworker.cluster", "--shards", "2", "--workers", "2", "--task", "mnist1d-mlp",
                              "--steps", "40", "--save", str(out), timeout=400))
    assert summary["model_file"] == str(out)
    state = load_file(out)
    assert set(state) == set(load_task("mnist1d-mlp").model.state_dict())
    assert not _equal(state, load_task("mnist1d-mlp").model.state_dict())  # trained, not the initial weights
    scores = _scores("mnist1d-mlp", state)
    assert scores["test_accuracy"] == summary["test_accuracy"]
    assert scores["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    bad = run_cli("psworker.cluster", "--save", str(tmp_path / "nosuch" / "m.safetensors"), timeout=60)
    assert bad.returncode == 2 and "give a file in an existing directory" in bad.stderr


def _ctl(*argv: str) -> subprocess.CompletedProcess:
    return run_cli("psworker.ctl", *argv, timeout=120)


def test_worker_shards_and_checkpoint_give_the_same_row_split_model(shards, tmp_path):
    tokens = {"worker": "worker-token-0123456789", "reader": "reader-token-0123456789",
              "admin": "admin-token-01234567890"}
    write_private_file(tmp_path / "tokens", "".join(f"{r} {t}\n" for r, t in tokens.items()).encode())
    for role in ("reader", "admin"):
        write_private_file(tmp_path / f"{role}.token", tokens[role].encode())
    reader = ("--token-file", str(tmp_path / "reader.token"))
    ckpt = tmp_path / "checkpoints"
    a, b = shards(2, "--auth-token-file", str(tmp_path / "tokens"), "--checkpoint-dir", str(ckpt))
    ps = f"{a.address},{b.address}"

    empty = _ctl("export", "--ps", ps, "--out", str(tmp_path / "none.safetensors"), *reader)
    assert empty.returncode == 1 and "holds no model to read (state empty)" in empty.stderr

    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "psworker", "--ps", ps, "--task", WIDE, "--worker-index", str(i),
             "--num-workers", "2", "--steps", "40", "--threads", "1", "--progress", "log",
             "--save", str(tmp_path / f"worker{i}.safetensors")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=dict(child_env(), PSGRPC_TOKEN=tokens["worker"]),
        )
        for i in range(2)
    ]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=400)
        results.append(_result(subprocess.CompletedProcess(w.args, w.returncode, out, err)))
    for i, r in enumerate(results):  # each worker's own file is the model it evaluated at its end
        assert r["model_file"] == str(tmp_path / f"worker{i}.safetensors")
        scores = _scores(WIDE, load_file(r["model_file"]))
        assert scores["test_accuracy"] == r["test_accuracy"] and scores["test_loss"] == pytest.approx(r["test_loss"])

    status = json.loads(_ctl("status", "--ps", ps, "--json", *reader).stdout)
    split = [(p["row_start"], p["row_end"]) for s in status for p in s["parts"] if p["name"] == "0.weight"]
    assert sorted(split) == [(0, WIDTH // 2), (WIDTH // 2, WIDTH)], split  # one range on each shard

    # From the running shards (the workers are done; the shards stay up), with a reader's token.
    refused = _ctl("export", "--ps", ps, "--out", str(tmp_path / "x.safetensors"))
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    misordered = _ctl("export", "--ps", f"{b.address},{a.address}", "--out", str(tmp_path / "x.safetensors"), *reader)
    assert misordered.returncode == 1 and "give every shard of the job, in shard order" in misordered.stderr
    assert not (tmp_path / "x.safetensors").exists()
    exported = _ctl("export", "--ps", ps, "--out", str(tmp_path / "shards.safetensors"), *reader)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "wrote 4 variables" in exported.stdout and "from 2 shard(s)" in exported.stdout
    from_shards = load_file(tmp_path / "shards.safetensors")
    task = pull_task(ps, WIDE, options=ClientOptions(security=ClientSecurity(token=tokens["reader"])))
    assert _equal(from_shards, task.model.state_dict())  # what pscluster's evaluation reads, bit for bit
    final = evaluate(task.model, task)
    assert _scores(WIDE, from_shards) == final

    # From a checkpoint, with no shard running.
    done = _ctl("checkpoint", "--ps", ps, "--id", "100", "--token-file", str(tmp_path / "admin.token"))
    assert done.returncode == 0 and "complete" in done.stdout, done.stderr
    a.stop()
    b.stop()
    from_ckpt = _ctl("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "ckpt.safetensors"))
    assert from_ckpt.returncode == 0 and "from checkpoint 100 (2 part(s)" in from_ckpt.stdout, from_ckpt.stderr
    assert _equal(load_file(tmp_path / "ckpt.safetensors"), from_shards)
    assert _equal(psworker.load_checkpoint(ckpt), from_shards)
    assert _scores(WIDE, psworker.load_checkpoint(ckpt / "ckpt-000000000100")) == final
    missing = _ctl("export", "--checkpoint", str(tmp_path / "nosuch"), "--out", str(tmp_path / "y.safetensors"))
    assert missing.returncode == 1 and "no such checkpoint directory" in missing.stderr
    os.remove(ckpt / "ckpt-000000000100" / "shard-1-of-2" / "MANIFEST.json")
    incomplete = _ctl("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "y.safetensors"))
    assert incomplete.returncode == 1 and "part 1/2: MANIFEST.json is missing" in incomplete.stderr
    assert not Path(tmp_path / "y.safetensors").exists()
