"""Tables leave with the model: the streaming safetensors writer (header from the shapes first,
a table filled chunk by chunk) writes what safetensors reads back exactly, a dense-only file is
still ``save_file``'s byte for byte, and a checkpoint's table (written rows in pieces, the rest
initial values) comes back as the shards held it, through ``read_checkpoint``, ``psctl export
--checkpoint``'s :func:`export` and :func:`load_checkpoint`."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import psserver.tables
import psworker.export as export_module
from psserver.checkpoint import CheckpointError, CheckpointStore, ShardPart
from psserver.job import Registration
from psserver.model import read_checkpoint
from psserver.store import ShardStore
from pswire.optim import OptimizerConfig
from pswire.placement import model_spec, place
from pswire.tables import TableSpec, initial_rows
from psworker.export import StreamedTensor, export, load_checkpoint, save_model

pytestmark = pytest.mark.timeout(120)

SHARDS = 2
ADAGRAD = OptimizerConfig(name="adagrad", lr=0.1)
TABLES = (
    TableSpec(name="emb", num_rows=1000, dim=4, optimizer=ADAGRAD, init_scale=0.1, seed=3),
    TableSpec(name="side.emb", num_rows=257, dim=3, optimizer=OptimizerConfig(name="adam", lr=0.01), init="uniform"),
)


def _dense() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g)
    return {
        "fc.weight": w,
        "tied.weight": w,  # shares memory: written whole under both keys
        "fc.bias": torch.randn(5, generator=g).to(torch.float64),
        "half": torch.randn(3, 2, generator=g).to(torch.bfloat16),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
        "bytes": torch.arange(5, dtype=torch.uint8),
    }


def test_streamed_file_reads_back_exactly(tmp_path):
    table = torch.randn(103, 6, generator=torch.Generator().manual_seed(1))
    asked = []

    def read(start: int, stop: int) -> np.ndarray:
        asked.append((start, stop))
        return table[start:stop].numpy().copy()

    tensors = {**_dense(), "emb.weight": StreamedTensor((103, 6), read, chunk_rows=10),
               "other": StreamedTensor((4, 2, 3), lambda a, b: torch.full((b - a, 2, 3), float(a)), chunk_rows=3)}
    path = save_model(tensors, tmp_path / "m.safetensors", metadata={"task": "t", "source": "x"})
    assert asked == [(s, min(s + 10, 103)) for s in range(0, 103, 10)]  # in order, at most chunk_rows each
    got = load_file(path)
    other = torch.tensor([0.0, 0.0, 0.0, 3.0]).reshape(4, 1, 1).expand(4, 2, 3)  # each chunk filled with its start
    want = {**_dense(), "emb.weight": table, "other": other}
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "task": "t", "source": "x"}
    # The layout safetensors writes: header padded to 8 bytes, every tensor aligned to its elements.
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    assert length % 8 == 0 and raw[8 + length - 1:8 + length] in (b" ", b"}")
    sizes = {"F64": 8, "I64": 8, "F32": 4, "BF16": 2, "U8": 1, "BOOL": 1}
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - length
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(v["data_offsets"][0] % sizes[v["dtype"]] == 0 for k, v in header.items() if k != "__metadata__")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_dense_only_file_is_save_files_byte_for_byte(tmp_path):
    dense = _dense()
    del dense["tied.weight"]  # save_file itself refuses shared memory
    save_model(dense, tmp_path / "ours.safetensors")
    save_file({k: v.contiguous() for k, v in dense.items()}, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_a_chunk_that_does_not_fit_leaves_no_file(tmp_path):
    old = save_model({"x": torch.ones(2)}, tmp_path / "m.safetensors")
    before = old.read_bytes()
    bad = StreamedTensor((10, 2), lambda a, b: np.zeros((b - a, 3), dtype=np.float32), chunk_rows=4)
    with pytest.raises(ValueError, match=r"rows \[0, 4\) came as float32\[4, 3\], expected float32\[4, 2\]"):
        save_model({"x": torch.ones(2), "t": bad}, tmp_path / "m.safetensors")
    wrong_dtype = StreamedTensor((3, 2), lambda a, b: np.zeros((b - a, 2)))
    with pytest.raises(ValueError, match="came as float64"):
        save_model({"t": wrong_dtype}, tmp_path / "m.safetensors")

    def fails(a: int, b: int) -> np.ndarray:
        raise OSError("shard gone")

    with pytest.raises(OSError, match="shard gone"):
        save_model({"t": StreamedTensor((3, 2), fails)}, tmp_path / "m.safetensors")
    assert old.read_bytes() == before  # the old file stays whole
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def _job(tmp_path, monkeypatch, cid: int = 4):
    """Two shard stores of a job with a dense layer and TABLES, trained by three pushes of rows,
    checkpointed through CheckpointStore. Returns (stores, dense values)."""
    monkeypatch.setattr(psserver.tables, "PIECE_BYTES", 600)  # several pieces per table and shard
    dense = {"top.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "top.bias": np.zeros(3, dtype=np.float32)}
    placement = place(model_spec(dense.items()), SHARDS)
    rng = np.random.default_rng(0)
    stores = []
    for i, parts in enumerate(placement.shards):
        store = ShardStore()
        reg = store.register(Registration(worker_name="w", shard_index=i, num_shards=SHARDS,
                                          placement_digest=placement.digest(), parts=parts, optimizer=ADAGRAD,
                                          job_fingerprint="task=test", tables=TABLES))
        rows = [dense[p.name] if p.is_whole else dense[p.name][p.row_start:p.row_end] for p in parts]
        # The dense layer is small enough to live whole on shard 0: shard 1 holds only table rows
        # and is ready without an upload.
        assert store.initialize(reg.worker_id, reg.generation, [r.copy() for r in rows])[0] == bool(parts)
        for step in range(3):
            pushed = []
            for spec in TABLES:
                ids = np.unique(rng.integers(0, spec.num_rows, 120))
                ids = ids[ids % SHARDS == i]
                pushed.append((spec.name, ids, rng.standard_normal((ids.size, spec.dim)).astype(np.float32)))
            grads = [np.ones(p.shape, dtype=np.float32) for p in parts]
            store.apply_push(reg.worker_id, reg.generation, step + 1, step, parts, grads, session=reg.session,
                             rows=pushed)
        _, tensors, metadata = store.export()
        assert sum(d["pieces"] for d in metadata["tables"]) > len(TABLES)
        CheckpointStore(tmp_path / "ckpt").write(cid, i, SHARDS, ShardPart(tensors, metadata))
        stores.append(store)
    return stores


def _held(stores, spec: TableSpec) -> np.ndarray:
    """The whole table as the shards serve it (written rows, initial values elsewhere)."""
    out = np.empty((spec.num_rows, spec.dim), dtype=np.float32)
    for i, store in enumerate(stores):
        ids = np.arange(i, spec.num_rows, SHARDS, dtype=np.int64)
        _, _, [(_, _, values)] = store.pull_rows([(spec.name, ids)], timeout=5)
        out[ids] = values
    return out


def test_checkpoint_tables_come_back_as_the_shards_hold_them(tmp_path, monkeypatch):
    stores = _job(tmp_path, monkeypatch)
    model = read_checkpoint(tmp_path / "ckpt")
    assert list(model.tables) == [t.name for t in TABLES]
    for spec in TABLES:
        table = model.tables[spec.name]
        want = _held(stores, spec)
        assert table.spec == spec and table.shape == (spec.num_rows, spec.dim)
        written = sum(int(s._tables[spec.name].written.sum()) for s in stores)
        assert 0 < table.rows_written == written < spec.num_rows
        np.testing.assert_array_equal(table.array(chunk_rows=37), want)
        np.testing.assert_array_equal(table.rows(5, 6), want[5:6])
        assert table.rows(9, 9).shape == (0, spec.dim)
        fresh = np.flatnonzero((want != initial_rows(spec, np.arange(spec.num_rows))).any(axis=1))
        assert fresh.size == written  # exactly the written rows differ from their initial values

    # psctl export --checkpoint: each table streamed in chunks of 97 rows beside the dense variables.
    monkeypatch.setattr(export_module, "TABLE_CHUNK_ROWS", 97)
    said = export(tmp_path / "out.safetensors", checkpoint=tmp_path / "ckpt")
    assert said.startswith("wrote 2 variables and 2 table(s) (") and "from checkpoint 4 (2 part(s)" in said
    got = load_file(tmp_path / "out.safetensors")
    assert set(got) == {"top.weight", "top.bias", "emb.weight", "side.emb.weight"}
    for spec in TABLES:
        assert got[f"{spec.name}.weight"].dtype == torch.float32
        assert torch.equal(got[f"{spec.name}.weight"], torch.from_numpy(_held(stores, spec)))
    dense = {name: torch.from_numpy(v) for name, v in read_checkpoint(tmp_path / "ckpt").variables.items()}
    assert all(torch.equal(got[k], v) for k, v in dense.items())
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "source": "checkpoint", "checkpoint_id": "4",
                                "tables": json.dumps(["emb", "side.emb"])}

    # The in-process API gives the same, whole.
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert set(loaded) == set(got) and all(torch.equal(loaded[k], got[k]) for k in got)


def test_a_damaged_piece_is_named(tmp_path, monkeypatch):
    stores = _job(tmp_path, monkeypatch, cid=2)
    # Rewrite part 1 with a row that lives on shard 0, and part 0 with a row in two pieces.
    _, tensors, metadata = stores[1].export()
    tensors["rows/00000/ids"] = tensors["rows/00000/ids"].copy()
    tensors["rows/00000/ids"][0] = 0
    CheckpointStore(tmp_path / "bad").write(3, 1, SHARDS, ShardPart(tensors, metadata))
    _, tensors, metadata = stores[0].export()
    CheckpointStore(tmp_path / "bad").write(3, 0, SHARDS, ShardPart(tensors, metadata))
    with pytest.raises(CheckpointError, match="row id 0 lives on shard 0, not on shard 1"):
        read_checkpoint(tmp_path / "bad")
    _, tensors, metadata = stores[1].export()
    tensors["rows/00001/ids"] = tensors["rows/00000/ids"].copy()
    CheckpointStore(tmp_path / "twice").write(3, 1, SHARDS, ShardPart(tensors, metadata))
    _, tensors, metadata = stores[0].export()
    CheckpointStore(tmp_path / "twice").write(3, 0, SHARDS, ShardPart(tensors, metadata))
    with pytest.raises(CheckpointError, match="table 'emb': row .* is in two pieces"):
        read_checkpoint(tmp_path / "twice")
