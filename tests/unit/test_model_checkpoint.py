"""The model out of a checkpoint directory with no shard running (``psserver.model`` and
``psworker.load_checkpoint``): row ranges put back together across shards, dtypes kept (bfloat16
too), the optimizer's state on request, and a clear ``CheckpointError`` for a checkpoint that is
missing, incomplete or damaged. The checkpoints are real ones: shard stores, registered with a
placement that splits a variable by rows, write their parts through ``CheckpointStore``."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import psworker
from psserver.checkpoint import CheckpointError, CheckpointStore, ShardPart
from psserver.job import Registration
from psserver.model import layout, read_checkpoint
from psserver.store import ShardStore
from pswire.codec import Part
from pswire.dtypes import BFLOAT16, FLOAT32
from pswire.optim import OptimizerConfig
from pswire.placement import MIN_SPLIT_BYTES, model_spec, place
from psworker.export import save_model

pytestmark = pytest.mark.timeout(120)

ADAM = OptimizerConfig(name="adam", lr=0.1)
SHARDS = 2


class Net(nn.Module):
    """Large enough that placement splits ``wide.weight`` by rows (300 x 256 float32 is above
    ``MIN_SPLIT_BYTES``), with a bfloat16 layer and a 0-d float64 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(256, 300)
        self.head = nn.Linear(300, 10).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16.numpy).copy()
    return t.numpy().copy()


def _write(root: Path, cid: int, model: nn.Module, *, grads: dict[str, np.ndarray] | None = None,
           shards: range | None = None) -> dict[str, np.ndarray]:
    """Every shard's part of checkpoint ``cid`` (or those in ``shards``) of a job holding
    ``model``'s parameters, after one push of ``grads`` when given. Returns the whole variables
    the shards hold (read back from the stores, reassembled by the placement)."""
    values = {name: _numpy(p) for name, p in model.named_parameters()}
    placement = place(model_spec(values.items()), SHARDS)
    held: dict[str, np.ndarray] = {name: np.empty_like(v) for name, v in values.items()}
    for i, parts in enumerate(placement.shards):
        store = ShardStore()
        reg = store.register(Registration(worker_name="w", shard_index=i, num_shards=SHARDS,
                                          placement_digest=placement.digest(), parts=parts, optimizer=ADAM,
                                          job_fingerprint="task=test"))
        rows = [values[p.name] if p.is_whole else values[p.name][p.row_start:p.row_end] for p in parts]
        assert store.initialize(reg.worker_id, reg.generation, [r.copy() for r in rows])[0]
        if grads is not None:
            g = [grads[p.name] if p.is_whole else grads[p.name][p.row_start:p.row_end] for p in parts]
            store.apply_push(reg.worker_id, reg.generation, 1, 0, parts, g, session=reg.session)
        _, tensors, metadata = store.export()
        for p in parts:
            if p.full_shape:
                held[p.name][p.row_start:p.row_end] = tensors[f"var/{p.key}"]
            else:
                held[p.name][...] = tensors[f"var/{p.key}"]
        if shards is None or i in shards:
            CheckpointStore(root).write(cid, i, SHARDS, ShardPart(tensors, metadata))
    return held


def _grads(model: nn.Module) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(p.shape).astype(_numpy(p).dtype) for name, p in model.named_parameters()}


def test_the_variable_is_split_by_rows_across_both_shards():
    values = {name: _numpy(p) for name, p in Net().named_parameters()}
    assert values["wide.weight"].nbytes > MIN_SPLIT_BYTES
    pieces = place(model_spec(values.items()), SHARDS).parts_of("wide.weight")
    assert [i for i, _ in pieces] == [0, 1] or [i for i, _ in pieces] == [1, 0]
    assert [(p.row_start, p.row_end) for _, p in pieces] == [(0, 150), (150, 300)]


def test_read_reassembles_rows_and_keeps_dtypes_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = Net()
    held = _write(tmp_path, 5, model)
    got = read_checkpoint(tmp_path)
    assert (got.checkpoint_id, got.num_shards, got.path) == (5, SHARDS, tmp_path / "ckpt-000000000005")
    assert set(got.variables) == {name for name, _ in model.named_parameters()} == set(model.state_dict())
    for name, p in model.named_parameters():
        assert got.variables[name].dtype == held[name].dtype and got.variables[name].shape == tuple(p.shape)
        assert got.variables[name].tobytes() == _numpy(p).tobytes(), name  # the initial values, untouched
    assert got.variables["head.weight"].dtype == BFLOAT16.numpy and got.variables["scale"].shape == ()
    assert got.optimizer == {}


def test_optimizer_state_is_reassembled_too(tmp_path):
    model = Net()
    grads = _grads(model)
    held = _write(tmp_path, 9, model, grads=grads)
    got = read_checkpoint(tmp_path, optimizer=True)
    for name, value in held.items():
        np.testing.assert_array_equal(got.variables[name], value)
        assert not np.array_equal(value, _numpy(dict(model.named_parameters())[name]))  # the push moved it
    state = got.optimizer["wide.weight"]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].shape == () and int(state["step"]) == 1  # one per piece, the same on both
    np.testing.assert_allclose(state["exp_avg"], 0.1 * grads["wide.weight"], rtol=1e-5)  # (1 - beta1) g
    np.testing.assert_allclose(state["exp_avg_sq"], 0.001 * grads["wide.weight"] ** 2, rtol=1e-4)


def test_load_checkpoint_gives_a_state_dict_a_fresh_model_loads(tmp_path):
    torch.manual_seed(1)
    trained = Net()
    grads = _grads(trained)
    held = _write(tmp_path, 3, trained, grads=grads)
    fresh = Net()
    fresh.load_state_dict(psworker.load_checkpoint(tmp_path))  # strict: every key, nothing else
    for name, p in fresh.named_parameters():
        assert _numpy(p).tobytes() == held[name].tobytes(), name
    assert fresh.head.weight.dtype == torch.bfloat16
    with_state = psworker.load_checkpoint(tmp_path, optimizer=True)
    assert with_state["opt/wide.weight/exp_avg"].shape == (300, 256)
    assert with_state["opt/scale/step"].dtype == torch.int64
    # The same through a file: what psctl export --checkpoint writes.
    out = save_model(psworker.load_checkpoint(tmp_path), tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    again = Net()
    again.load_state_dict(load_file(out))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), fresh.parameters()))


def test_newest_by_default_or_the_one_asked_for(tmp_path):
    first, second = Net(), Net()
    _write(tmp_path, 5, first)
    _write(tmp_path, 7, second)
    assert read_checkpoint(tmp_path).checkpoint_id == 7
    older = read_checkpoint(tmp_path, checkpoint_id=5)
    assert older.checkpoint_id == 5
    np.testing.assert_array_equal(older.variables["wide.bias"], _numpy(first.wide.bias))
    assert read_checkpoint(tmp_path / "ckpt-000000000005").checkpoint_id == 5
    with pytest.raises(ValueError, match="is checkpoint 5, not 7"):
        read_checkpoint(tmp_path / "ckpt-000000000005", checkpoint_id=7)
    with pytest.raises(CheckpointError, match=r"checkpoint 6 is not in .* \(newest there: 7, 5\)"):
        read_checkpoint(tmp_path, checkpoint_id=6)


def test_missing_or_empty_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="nosuch: no such checkpoint directory"):
        psworker.load_checkpoint(tmp_path / "nosuch")
    with pytest.raises(CheckpointError, match="no usable checkpoint in .*: there is none"):
        read_checkpoint(tmp_path)


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    _write(tmp_path, 4, Net(), shards=range(1))  # shard 1 never wrote its part
    with pytest.raises(CheckpointError, match=r"checkpoint 4 part 1/2: MANIFEST.json is missing \(unfinished"):
        read_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="part 1/2"):
        read_checkpoint(tmp_path, checkpoint_id=4)


def test_a_damaged_checkpoint_is_refused_and_an_older_complete_one_used(tmp_path, caplog):
    _write(tmp_path, 5, Net())
    _write(tmp_path, 6, Net())
    tensors = tmp_path / "ckpt-000000000006" / "shard-1-of-2" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    tensors.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checkpoint 6 part 1/2: tensors.safetensors does not match its sha256"):
        read_checkpoint(tmp_path, checkpoint_id=6)
    with caplog.at_level(logging.WARNING):
        assert read_checkpoint(tmp_path).checkpoint_id == 5  # LATEST's is damaged: the previous complete one
    assert "checkpoint 6" in caplog.text and "sha256" in caplog.text
    (tmp_path / "ckpt-000000000005" / "shard-0-of-2" / "metadata.json").write_text("{}")  # truncated too
    with pytest.raises(CheckpointError, match="no usable checkpoint .*sha256.*checkpoint 5 part 0/2: metadata.json has 2"):
        psworker.load_checkpoint(tmp_path)


def test_layout_refuses_pieces_that_do_not_cover_a_variable():
    a = Part("w", (4, 2), FLOAT32, 0, 2)
    assert [i for i, _ in layout([[Part("w", (4, 2), FLOAT32, 2, 4)], [a]])["w"]] == [1, 0]
    with pytest.raises(ValueError, match=r"rows up to 2 of its 4"):
        layout([[a]])
    with pytest.raises(ValueError, match=r"shard 1 holds rows \[1, 4\), expected a range from row 2"):
        layout([[a], [Part("w", (4, 2), FLOAT32, 1, 4)]])
    with pytest.raises(ValueError, match=r"float32\[4, 2\] on shard 0 but bfloat16\[4, 2\] on shard 1"):
        layout([[a], [Part("w", (4, 2), BFLOAT16, 2, 4)]])


def test_save_model_writes_whole_tied_weights_atomically(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.embed.weight  # one parameter, two state_dict keys
            self.register_buffer("seen", torch.arange(3))

    model = Tied()
    path = save_model(model.state_dict(), tmp_path / "tied.safetensors", metadata={"task": "t"})
    from safetensors import safe_open
    from safetensors.torch import load_file

    fresh = Tied()
    fresh.load_state_dict(load_file(path))  # strict: both keys of the tied weight, and the buffer
    assert torch.equal(fresh.out.weight, model.embed.weight) and torch.equal(fresh.seen, model.seen)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "task": "t"}
    assert [p.name for p in tmp_path.iterdir()] == ["tied.safetensors"]  # no temporary file left
    with pytest.raises(FileNotFoundError, match="no directory .*nosuch.* to write the model in"):
        save_model(model.state_dict(), tmp_path / "nosuch" / "m.safetensors")
    with pytest.raises(ValueError, match=r"'x' is not a tensor \(int\)"):
        save_model({"x": 1}, tmp_path / "m.safetensors")
