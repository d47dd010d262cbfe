"""Shard checkpoints on disk: round trip, all-or-nothing commit, crashes at every phase, damage
detection with fallback, pruning, a pointer that never moves back, and no unpickling."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import torch  # only to write files as the torch-based shard did, and to forbid torch.load
from safetensors.torch import save as torch_save

from psserver.checkpoint import CheckpointError, CheckpointStore, ShardPart
from pswire.dtypes import BFLOAT16

pytestmark = pytest.mark.timeout(120)

PHASES = ["before_tensors", "tensors_written", "before_metadata", "metadata_written",
          "before_manifest", "manifest_written", "before_pointer", "pointer_written"]


def _part(cid: int, shard: int = 0) -> ShardPart:
    return ShardPart({"var/w": np.full(3, float(cid), dtype=np.float32), "var/b": np.array(shard, dtype=np.int64)},
                     {"checkpoint": cid, "shard": shard})


def _write_all(store: CheckpointStore, cid: int, n: int = 1) -> None:
    for i in range(n):
        store.write(cid, i, n, _part(cid, i))


def _loaded_id(store: CheckpointStore, shard: int = 0, n: int = 1) -> int | None:
    got = store.load(shard, n)
    if got is None:
        return None
    cid, part = got
    assert part.metadata == {"checkpoint": cid, "shard": shard}  # never a mix of checkpoints
    np.testing.assert_array_equal(part.tensors["var/w"], np.full(3, float(cid), dtype=np.float32))
    return cid


def _bits(a: np.ndarray) -> bytes:
    return a.tobytes()  # the raw elements in C order, whatever the strides


def _pdir(root: Path, cid: int, i: int = 0, n: int = 1) -> Path:
    return root / f"ckpt-{cid:012d}" / f"shard-{i}-of-{n}"


def test_round_trip_is_bit_exact(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.standard_normal((4, 6))
    tensors = {
        "var/f32": rng.standard_normal((5, 3)).astype(np.float32),
        "var/f64": base,
        "var/tied": base[1],  # shares memory with var/f64
        "var/strided": base.T,  # not contiguous
        "var/f16": rng.standard_normal(7).astype(np.float16),
        "var/bf16": rng.standard_normal((2, 2)).astype(BFLOAT16.numpy),
        "var/i64": np.array([-(2**62), 0, 2**62], dtype=np.int64),
        "var/i32": np.array([-7, 7], dtype=np.int32),
        "var/i8": np.array([-128, 127], dtype=np.int8),
        "var/u8": np.array([0, 255], dtype=np.uint8),
        "var/scalar": np.array(1.25, dtype=BFLOAT16.numpy),
        "var/empty": np.zeros((0, 3), dtype=np.float32),
        "opt/f32/exp_avg": np.array([float("nan"), float("inf"), -0.0], dtype=np.float32),
    }
    meta = {"versions": {"var/f32": 7}, "clock": 3, "workers": [{"id": "w0", "gen": 2}], "lr": 0.1}
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, ShardPart(tensors, meta))
    cid, part = store.load(0, 1)
    assert cid == 1 and part.metadata == meta and set(part.tensors) == set(tensors)
    for name, t in tensors.items():
        got = part.tensors[name]
        assert (got.dtype, got.shape, _bits(got)) == (t.dtype, t.shape, _bits(t)), name
        assert got.flags.c_contiguous and got.flags.writeable, name
    # Each loaded array has its own memory (a restored shard updates them in place).
    loaded = list(part.tensors.values())
    assert not any(np.shares_memory(a, b) for i, a in enumerate(loaded) for b in loaded[i + 1:])


def test_zero_dimensional_arrays_round_trip_exactly(tmp_path):
    """0-d values (scalar variables, step counters) come back 0-d, not as 1-element vectors."""
    tensors = {"var/bf16": np.array(-3.375, dtype=BFLOAT16.numpy), "var/i64": np.array(-(2**62) - 1, dtype=np.int64)}
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, ShardPart(tensors, {}))
    part = store.load(0, 1)[1]
    for name, t in tensors.items():
        got = part.tensors[name]
        assert (got.dtype, got.shape, _bits(got)) == (t.dtype, (), _bits(t)), name


def _torch_written(torch_tensors: dict[str, torch.Tensor]) -> bytes:
    """What the torch-based shard wrote for these tensors (its _encode: ``safetensors.torch.save``)."""
    return torch_save({k: t.contiguous() for k, t in torch_tensors.items()})


def test_checkpoint_written_by_the_torch_based_shard_loads(tmp_path):
    """Compatibility: a part whose tensors file came from ``safetensors.torch.save`` (how the shard
    wrote checkpoints before it dropped torch) loads into the same values, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    old = {
        "var/f32": torch.randn(5, 3, generator=gen),
        "var/f64": torch.randn(4, dtype=torch.float64, generator=gen),
        "var/f16": torch.randn(7, generator=gen).half(),
        "var/bf16": torch.randn(2, 3, generator=gen).bfloat16(),
        "var/i64": torch.tensor([-(2**62), 0, 2**62]),
        "var/i32": torch.tensor([-7, 7], dtype=torch.int32),
        "var/u8": torch.tensor([0, 255], dtype=torch.uint8),
        "var/step": torch.tensor(42, dtype=torch.int64),
        "var/scalar": torch.tensor(1.25, dtype=torch.bfloat16),
        "var/empty": torch.zeros(0, 3),
        "opt/f32/exp_avg": torch.tensor([float("nan"), float("inf"), -0.0]),
    }
    meta = {"clock": 3}
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, ShardPart({}, meta))
    d = _pdir(tmp_path, 1)
    blob = _torch_written(old)
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["files"]["tensors.safetensors"] = {"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    (d / "tensors.safetensors").write_bytes(blob)
    (d / "MANIFEST.json").write_text(json.dumps(manifest, sort_keys=True))
    cid, part = CheckpointStore(tmp_path).load(0, 1)
    assert cid == 1 and part.metadata == meta and set(part.tensors) == set(old)
    for name, t in old.items():
        got = part.tensors[name]
        want = t.view(torch.int16).numpy().view(BFLOAT16.numpy) if t.dtype == torch.bfloat16 else t.numpy()
        assert (got.dtype, got.shape, _bits(got)) == (want.dtype, want.shape, _bits(want)), name
    # The same values written now give the very same file: the format did not change, and the
    # manifest's sha256 (which a re-write of an existing part compares) still matches.
    store.write(2, 0, 1, ShardPart(part.tensors, meta))
    assert (_pdir(tmp_path, 2) / "tensors.safetensors").read_bytes() == blob


def test_empty_tensors_and_metadata_round_trip(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(0, 0, 1, ShardPart({}, {}))
    assert store.load(0, 1) == (0, ShardPart({}, {}))


def test_nothing_at_all_loads_none(tmp_path):
    assert CheckpointStore(tmp_path / "absent").load(0, 1) is None
    assert CheckpointStore(tmp_path).load(0, 1) is None
    assert CheckpointStore(tmp_path).list() == []


def test_pointer_moves_only_when_every_part_is_complete(tmp_path):
    store = CheckpointStore(tmp_path)
    _write_all(store, 1, n=2)
    store.write(2, 0, 2, _part(2, 0))
    assert [_loaded_id(store, i, 2) for i in (0, 1)] == [1, 1]
    assert json.loads((tmp_path / "LATEST").read_text()) == {"id": 1, "num_shards": 2}
    store.write(2, 1, 2, _part(2, 1))
    assert [_loaded_id(store, i, 2) for i in (0, 1)] == [2, 2]
    assert [(c["id"], c["complete"], c["latest"]) for c in store.list()] == [(2, True, True), (1, True, False)]


class Crash(Exception):
    pass


@pytest.mark.parametrize("phase", PHASES)
def test_crash_at_every_phase_keeps_previous_checkpoint(tmp_path, phase):
    armed = []

    def failpoint(name):
        if armed and name == phase:
            raise Crash(name)

    store = CheckpointStore(tmp_path, failpoint=failpoint)
    _write_all(store, 1, n=2)
    store.write(2, 0, 2, _part(2, 0))
    armed.append(True)
    with pytest.raises(Crash):
        store.write(2, 1, 2, _part(2, 1))  # the last part: it would commit checkpoint 2
    armed.clear()
    # LATEST is the commit point: only a crash after it was replaced leaves checkpoint 2 loaded.
    want = 2 if phase == "pointer_written" else 1
    fresh = CheckpointStore(tmp_path)  # as a restarted process would see it
    assert [_loaded_id(fresh, i, 2) for i in (0, 1)] == [want, want]
    assert not list(tmp_path.rglob("*.tmp"))
    store.write(2, 1, 2, _part(2, 1))  # the retried write completes and commits
    assert _loaded_id(fresh, 1, 2) == 2
    _write_all(store, 3, n=2)
    assert [_loaded_id(fresh, i, 2) for i in (0, 1)] == [3, 3]


def test_crash_during_the_first_checkpoint_loads_none(tmp_path):
    def failpoint(name):
        if name == "before_manifest":
            raise Crash(name)

    with pytest.raises(Crash):
        CheckpointStore(tmp_path, failpoint=failpoint).write(1, 0, 1, _part(1))
    assert CheckpointStore(tmp_path).load(0, 1) is None


def _flip_last_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01
    p.write_bytes(bytes(data))


DAMAGE = {
    "flip tensors": (lambda d: _flip_last_byte(d / "tensors.safetensors"), "sha256"),
    "flip metadata": (lambda d: _flip_last_byte(d / "metadata.json"), "sha256"),
    "truncate tensors": (lambda d: (d / "tensors.safetensors").write_bytes(
        (d / "tensors.safetensors").read_bytes()[:-5]), "bytes"),
    "delete tensors": (lambda d: (d / "tensors.safetensors").unlink(), "missing"),
    "delete metadata": (lambda d: (d / "metadata.json").unlink(), "missing"),
    "delete manifest": (lambda d: (d / "MANIFEST.json").unlink(), "MANIFEST"),
    "garble manifest": (lambda d: (d / "MANIFEST.json").write_text("{not json"), "MANIFEST"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_falls_back_to_previous(tmp_path, caplog, damage):
    store = CheckpointStore(tmp_path)
    _write_all(store, 1, n=2)
    _write_all(store, 2, n=2)
    DAMAGE[damage][0](_pdir(tmp_path, 2, 1, 2))  # part 1 only: part 0 must not load it either
    with caplog.at_level(logging.WARNING, logger="psserver.checkpoint"):
        assert [_loaded_id(store, i, 2) for i in (0, 1)] == [1, 1]
    assert "checkpoint 2" in caplog.text and DAMAGE[damage][1] in caplog.text


@pytest.mark.parametrize("damage", DAMAGE)
def test_only_checkpoint_damaged_raises(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    _write_all(store, 1)
    DAMAGE[damage][0](_pdir(tmp_path, 1))
    with pytest.raises(CheckpointError, match=DAMAGE[damage][1]):
        store.load(0, 1)


def test_unparseable_safetensors_with_matching_manifest_is_rejected(tmp_path):
    store = CheckpointStore(tmp_path)
    _write_all(store, 1)
    _write_all(store, 2)
    d = _pdir(tmp_path, 2)
    garbage = b"\xff" * 64
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["files"]["tensors.safetensors"] = {"sha256": hashlib.sha256(garbage).hexdigest(), "size": 64}
    (d / "tensors.safetensors").write_bytes(garbage)
    (d / "MANIFEST.json").write_text(json.dumps(manifest))
    assert _loaded_id(store) == 1


@pytest.mark.parametrize("pointer", ["", "{garbage", "[]", '{"id": -1, "num_shards": 1}',
                                     '{"id": "2", "num_shards": 1}', '{"id": 99, "num_shards": 1}'])
def test_bad_pointer_falls_back_to_scanning(tmp_path, caplog, pointer):
    store = CheckpointStore(tmp_path)
    _write_all(store, 1)
    _write_all(store, 2)
    (tmp_path / "LATEST").write_text(pointer)
    with caplog.at_level(logging.WARNING, logger="psserver.checkpoint"):
        assert _loaded_id(store) == 2
    assert "LATEST" in caplog.text or "checkpoint 99" in caplog.text


def test_keep_prunes_to_k_complete_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    _write_all(store, 1, n=2)
    _write_all(store, 2, n=2)
    store.write(3, 0, 2, _part(3, 0))  # never finished
    _write_all(store, 4, n=2)
    _write_all(store, 5, n=2)
    store.write(6, 0, 2, _part(6, 0))  # in progress: newer than every complete one, so kept
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [f"ckpt-{c:012d}" for c in (4, 5, 6)]
    assert not list(tmp_path.glob(".deleting-*"))
    assert _loaded_id(store, 1, 2) == 5


def test_prune_never_deletes_the_pointed_checkpoint(tmp_path):
    def failpoint(name):
        if name == "before_pointer" and crash:
            raise Crash(name)

    crash = False
    store = CheckpointStore(tmp_path, keep=1, failpoint=failpoint)
    _write_all(store, 1)
    crash = True
    with pytest.raises(Crash):
        _write_all(store, 2)  # complete, never committed
    crash = False
    _write_all(store, 0)  # older: no commit, but it prunes
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [f"ckpt-{c:012d}" for c in (1, 2)]
    assert _loaded_id(store) == 1


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path, keep=0)


def test_pointer_never_moves_backwards(tmp_path):
    store = CheckpointStore(tmp_path)
    _write_all(store, 5)
    _write_all(store, 3)
    assert json.loads((tmp_path / "LATEST").read_text())["id"] == 5
    assert _loaded_id(store) == 5


def _shard_writer(root: str, shard: int, n: int, ids: list[int], failpoint=None) -> None:
    # As a shard does: its own part of every checkpoint, in increasing id order.
    store = CheckpointStore(root, keep=2, failpoint=failpoint)
    for cid in ids:
        store.write(cid, shard, n, _part(cid, shard))


def test_concurrent_writers_keep_the_pointer_monotonic(tmp_path):
    seen: list[int] = []

    # Each write opens .lock anew, and flock treats separate open()s like separate processes, so
    # threads exercise the same exclusion as shard processes (which take seconds each to start).
    def failpoint(name):  # runs under the lock, right after LATEST was replaced
        if name == "pointer_written":
            seen.append(json.loads((tmp_path / "LATEST").read_text())["id"])

    threads = [threading.Thread(target=_shard_writer, args=(tmp_path, k, 4, list(range(12)), failpoint))
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen == sorted(set(seen)) and seen[-1] == 11
    assert [_loaded_id(CheckpointStore(tmp_path), i, 4) for i in range(4)] == [11] * 4
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [f"ckpt-{c:012d}" for c in (10, 11)]


def test_older_write_pruned_meanwhile_is_reported(tmp_path):
    def failpoint(name):  # while this part is half written, the other shards finish checkpoint 5
        if name == "tensors_written":
            _write_all(CheckpointStore(tmp_path), 5, n=2)

    _write_all(CheckpointStore(tmp_path), 1, n=2)
    CheckpointStore(tmp_path).write(3, 1, 2, _part(3, 1))
    with pytest.raises(CheckpointError, match="checkpoint 3 .* pruned while being written"):
        CheckpointStore(tmp_path, failpoint=failpoint).write(3, 0, 2, _part(3, 0))
    assert _loaded_id(CheckpointStore(tmp_path), 0, 2) == 5


def test_different_shard_count_is_refused(tmp_path):
    _write_all(CheckpointStore(tmp_path), 12, n=3)
    with pytest.raises(CheckpointError, match=r"checkpoint 12 in .* was made for 3 shards, this job has 2"):
        CheckpointStore(tmp_path).load(0, 2)


def test_rewrite_is_idempotent_and_conflicts_are_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    first = store.write(1, 0, 1, _part(1))
    before = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert store.write(1, 0, 1, _part(1)) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == before
    with pytest.raises(CheckpointError, match="different content"):
        store.write(1, 0, 1, _part(7))
    assert _loaded_id(store) == 1


def test_incomplete_part_is_replaced_by_different_content(tmp_path):
    store = CheckpointStore(tmp_path)
    _write_all(store, 1)
    (_pdir(tmp_path, 1) / "MANIFEST.json").unlink()  # as after a crash before the manifest
    store.write(1, 0, 1, ShardPart({"var/w": np.full(3, 1.0, dtype=np.float32), "var/b": np.array(9)},
                                   {"checkpoint": 1, "shard": 0}))
    assert store.load(0, 1)[1].tensors["var/b"].item() == 9


def test_bad_arguments_raise_value_error(tmp_path):
    store = CheckpointStore(tmp_path)
    for bad in ({"x": np.zeros(1)}, {"x": float("nan")}):
        with pytest.raises(ValueError):
            store.write(1, 0, 1, ShardPart({}, bad))
    # Values must be arrays of a dtype the shard holds (a torch tensor is not one).
    for bad in ({"var/x": torch.zeros(1)}, {"var/x": np.zeros(1, dtype=np.complex64)}, {"__metadata__": np.zeros(1)}):
        with pytest.raises(ValueError):
            store.write(1, 0, 1, ShardPart(bad, {}))
    with pytest.raises(ValueError):
        store.write(1, 2, 2, _part(1))
    with pytest.raises(ValueError):
        store.load(0, 0)
    assert not list(tmp_path.glob("ckpt-*"))


def test_loading_never_unpickles(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    _write_all(store, 1, n=2)

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling is forbidden")

    # The shard no longer imports torch, but torch.load stays forbidden too: it is the unpickler a
    # regression to torch-based loading would reach for (torch is imported here anyway, above).
    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, forbidden)
    assert [_loaded_id(store, i, 2) for i in (0, 1)] == [1, 1]
    _write_all(store, 2, n=2)
    assert store.list()[0]["complete"]
