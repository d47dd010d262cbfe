"""Trained embedding tables leave with the model: ``psctl export --ps`` (the running shards),
``psctl export --checkpoint`` (no shard running) and the worker's own file
(``save_model_with_tables``) each write a table as ``"{path}.weight"`` beside the dense
variables, so that ``localize(Model())`` loads the file strictly and computes what the sharded
model computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import psworker
import psworker.export as export_module
from pswire.optim import OptimizerConfig
from pswire.tables import initial_rows
from psworker.client import ClientOptions
from psworker.embedding import ShardedEmbedding, localize
from psworker.export import export, save_model_with_tables
from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROWS, DIM, FEATURES = 5000, 8, 3


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(ROWS, DIM, init_scale=0.1, seed=7)
        self.top = nn.Linear(DIM * FEATURES, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(self.emb(ids).flatten(1))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _local(state: dict[str, torch.Tensor]) -> nn.Module:
    model = localize(_Model())
    model.load_state_dict(state)  # strict: every key of the local model, nothing else
    return model.eval()


def test_tables_leave_with_the_model(shards, tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    a, b = shards(2, "--checkpoint-dir", str(ckpt))
    ps = f"{a.address},{b.address}"
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    session = psworker.connect(ps, worker_name="w0", options=ClientOptions(timeout=30))
    try:
        model, optimizer = session.prepare(_Model(), OptimizerConfig(name="adagrad", lr=0.05))
        for _ in range(8):
            ids = (torch.rand(32, FEATURES, generator=g) ** 3 * ROWS).long()
            optimizer.zero_grad()
            nn.functional.mse_loss(model(ids), torch.randn(32, 1, generator=g)).backward()
            optimizer.step()
        # Rows trained and rows never written (initial values) both come into the outputs.
        probe = torch.cat([(torch.rand(48, FEATURES, generator=g) ** 3 * ROWS).long(),
                           torch.randint(0, ROWS, (16, FEATURES), generator=g)])
        model.eval()
        with torch.no_grad():
            want = model(probe)
        monkeypatch.setattr(export_module, "TABLE_CHUNK_ROWS", 777)  # several chunks per table in-process
        save_model_with_tables(model, session.client, tmp_path / "worker.safetensors", metadata={"worker": "w0"})
    finally:
        session.close()

    exported = run_cli("psworker.ctl", "export", "--ps", ps, "--out", str(tmp_path / "shards.safetensors"), timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "wrote 2 variables and 1 table(s)" in exported.stdout and "from 2 shard(s)" in exported.stdout
    from_shards = load_file(tmp_path / "shards.safetensors")
    assert set(from_shards) == set(localize(_Model()).state_dict()) == {"emb.weight", "top.weight", "top.bias"}
    table = from_shards["emb.weight"]
    assert table.dtype == torch.float32 and table.shape == (ROWS, DIM)
    spec = _Model().emb.spec_for(OptimizerConfig(name="adagrad", lr=0.05), "emb")
    changed = (table != torch.from_numpy(initial_rows(spec, np.arange(ROWS)))).any(dim=1)
    assert 0 < int(changed.sum()) < ROWS  # trained rows, and untouched ones at their initial values
    with torch.no_grad():
        assert torch.equal(_local(from_shards)(probe), want)

    # The worker's own file, and the shards read in chunks in-process, are the same model.
    assert _same(load_file(tmp_path / "worker.safetensors"), from_shards)
    said = export(tmp_path / "chunked.safetensors", ps=ps, options=ClientOptions(timeout=30))
    assert said.startswith("wrote 2 variables and 1 table(s)")
    assert _same(load_file(tmp_path / "chunked.safetensors"), from_shards)

    # From a checkpoint, with no shard running.
    done = run_cli("psworker.ctl", "checkpoint", "--ps", ps, "--id", "100", timeout=120)
    assert done.returncode == 0 and "complete" in done.stdout, done.stderr[-3000:]
    a.stop()
    b.stop()
    from_ckpt = run_cli("psworker.ctl", "export", "--checkpoint", str(ckpt), "--out",
                        str(tmp_path / "ckpt.safetensors"), timeout=120)
    assert from_ckpt.returncode == 0, from_ckpt.stderr[-3000:]
    assert "wrote 2 variables and 1 table(s)" in from_ckpt.stdout and "from checkpoint 100" in from_ckpt.stdout
    state = load_file(tmp_path / "ckpt.safetensors")
    assert _same(state, from_shards)
    with torch.no_grad():
        assert torch.equal(_local(state)(probe), want)
    assert _same(psworker.load_checkpoint(ckpt), from_shards)
