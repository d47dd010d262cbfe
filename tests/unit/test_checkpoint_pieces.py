"""Shard checkpoints in pieces: tensors named ``rows/{k:05d}/{name}`` go to one safetensors file per
piece, written and read one at a time; the files are in MANIFEST, damage to any is detected, and the
names the writer used come back."""

from __future__ import annotations

import hashlib
import json
import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors import TensorSpec, serialize

from psserver.checkpoint import CheckpointError, CheckpointStore, ShardPart

pytestmark = pytest.mark.timeout(120)

PIECES = ["rows-00000.safetensors", "rows-00001.safetensors", "rows-00002.safetensors"]


def _part(seed: int = 0) -> ShardPart:
    rng = np.random.default_rng(seed)
    tensors = {
        "var/fc.weight": rng.standard_normal((3, 2)).astype(np.float32),
        "var/step": np.array(seed, dtype=np.int64),
        # Piece 0 has no rows at all (an empty table, or one whose rows all live elsewhere).
        "rows/00000/ids": np.zeros(0, dtype=np.int64),
        "rows/00000/values": np.zeros((0, 4), dtype=np.float32),
        "rows/00001/ids": np.array([-(2**62), 0, 7, 2**62], dtype=np.int64),
        "rows/00001/values": rng.standard_normal((4, 4)).astype(np.float32),
        "rows/00001/state/sum": rng.standard_normal((4, 4)).astype(np.float32),
        "rows/00002/ids": np.arange(5, dtype=np.int64) * 3 + seed,
        "rows/00002/values": rng.standard_normal((4, 5)).astype(np.float32).T,  # not contiguous
        "rows/00002/state/sum": rng.standard_normal((5, 4)).astype(np.float32),
    }
    return ShardPart(tensors, {"checkpoint": seed, "tables": {"emb": {"pieces": 3}}})


def _pdir(root: Path, cid: int, i: int = 0, n: int = 1) -> Path:
    return root / f"ckpt-{cid:012d}" / f"shard-{i}-of-{n}"


def _assert_same(got: ShardPart, want: ShardPart) -> None:
    assert got.metadata == want.metadata and set(got.tensors) == set(want.tensors)
    for name, t in want.tensors.items():
        g = got.tensors[name]
        assert (g.dtype, g.shape, g.tobytes()) == (t.dtype, t.shape, t.tobytes()), name
        assert g.flags.c_contiguous and g.flags.writeable, name


def _rewrite_manifest(d: Path, edit) -> None:
    manifest = json.loads((d / "MANIFEST.json").read_text())
    edit(manifest["files"])
    (d / "MANIFEST.json").write_text(json.dumps(manifest, sort_keys=True))


def _entry(data: bytes) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_pieces_round_trip_exactly_each_in_its_own_listed_file(tmp_path):
    want = _part(1)
    store = CheckpointStore(tmp_path)
    d = store.write(1, 0, 1, want)
    assert sorted(p.name for p in d.iterdir()) == sorted(["MANIFEST.json", "metadata.json", "tensors.safetensors",
                                                          *PIECES])
    files = json.loads((d / "MANIFEST.json").read_text())["files"]
    assert sorted(files) == sorted(["metadata.json", "tensors.safetensors", *PIECES])
    for name, entry in files.items():
        assert entry == _entry((d / name).read_bytes()), name
    # Rows stay out of the plain file; a piece file holds its tensors under their own names.
    from psserver.checkpoint import _decode
    assert set(_decode((d / "tensors.safetensors").read_bytes())) == {"var/fc.weight", "var/step"}
    assert set(_decode((d / PIECES[1]).read_bytes())) == {"ids", "values", "state/sum"}
    cid, got = store.load(0, 1)
    assert cid == 1
    _assert_same(got, want)
    cid, parts = store.load_all()
    assert cid == 1 and len(parts) == 1
    _assert_same(parts[0], want)
    assert store.list()[0]["complete"]


def test_a_part_of_only_pieces_and_one_without_pieces(tmp_path):
    store = CheckpointStore(tmp_path)
    only = ShardPart({"rows/00007/ids": np.arange(3, dtype=np.int64)}, {})
    d = store.write(1, 0, 1, only)
    assert sorted(p.name for p in d.iterdir()) == ["MANIFEST.json", "metadata.json", "rows-00007.safetensors",
                                                   "tensors.safetensors"]
    _assert_same(store.load(0, 1)[1], only)
    d = store.write(2, 0, 1, ShardPart({"var/w": np.ones(2, dtype=np.float32)}, {}))
    assert sorted(p.name for p in d.iterdir()) == ["MANIFEST.json", "metadata.json", "tensors.safetensors"]
    assert sorted(json.loads((d / "MANIFEST.json").read_text())["files"]) == ["metadata.json", "tensors.safetensors"]


@pytest.mark.parametrize("bad", ["rows/3/x", "rows/x", "rows/", "rows/00003", "rows/00003/", "rows/000003/x",
                                 "rows/-0003/x", "rows/\u0660\u0660\u0660\u0660\u0663/x", "rows/00003/__metadata__"])
def test_bad_piece_names_are_refused_before_anything_is_written(tmp_path, bad):
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError):
        store.write(1, 0, 1, ShardPart({"rows/00001/ids": np.zeros(1, dtype=np.int64), bad: np.zeros(1)}, {}))
    # A bad dtype in a piece is refused just as early.
    with pytest.raises(ValueError):
        store.write(1, 0, 1, ShardPart({"rows/00001/ids": np.zeros(1, dtype=np.complex64)}, {}))
    assert not list(tmp_path.glob("ckpt-*"))


def test_corrupt_piece_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, _part(1))
    store.write(2, 0, 1, _part(2))
    p = _pdir(tmp_path, 2) / PIECES[1]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: only the sha256 tells
    p.write_bytes(bytes(data))
    assert store.is_complete(2, 1)  # sizes still match
    with caplog.at_level(logging.WARNING, logger="psserver.checkpoint"):
        cid, got = store.load(0, 1)
    assert cid == 1
    _assert_same(got, _part(1))
    assert "checkpoint 2" in caplog.text and "rows-00001.safetensors does not match its sha256" in caplog.text
    assert store.list()[0]["parts"][0]["problem"] is not None


def test_corrupt_piece_of_the_only_checkpoint_raises_naming_the_file(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, _part(1))
    p = _pdir(tmp_path, 1) / PIECES[2]
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x80
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rows-00002.safetensors does not match its sha256"):
        store.load(0, 1)
    with pytest.raises(CheckpointError, match="rows-00002.safetensors"):
        store.load_all()


def test_truncated_or_missing_piece_fails_the_shallow_check(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, _part(1))
    p = _pdir(tmp_path, 1) / PIECES[1]
    p.write_bytes(p.read_bytes()[:-3])
    assert not store.is_complete(1, 1) and store.unfinished(1) == [1]
    with pytest.raises(CheckpointError, match=r"rows-00001.safetensors has \d+ bytes"):
        store.load(0, 1)
    p.unlink()
    assert not store.is_complete(1, 1)
    with pytest.raises(CheckpointError, match="rows-00001.safetensors is missing"):
        store.load(0, 1)


def test_unlisted_piece_file_or_foreign_name_in_the_manifest_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, _part(1))
    d = _pdir(tmp_path, 1)
    # A piece file the manifest does not list (e.g. left by an earlier attempt) makes the part unusable...
    stray = d / "rows-00009.safetensors"
    stray.write_bytes((d / PIECES[1]).read_bytes())
    assert not store.is_complete(1, 1)
    with pytest.raises(CheckpointError, match=r"rows-00009.safetensors.* not in MANIFEST"):
        store.load(0, 1)
    stray.unlink()
    (d / ".rows-00009.safetensors.123.abcd.tmp").write_bytes(b"x")  # a writer's temp file is not a piece
    assert store.is_complete(1, 1)
    # ... and so does a manifest naming a file that is not one of a part's.
    for extra in ("extra.bin", "rows-1.safetensors", "rows-000001.safetensors", "../tensors.safetensors"):
        if "/" not in extra:
            (d / extra).write_bytes(b"x")
        saved = (d / "MANIFEST.json").read_text()
        _rewrite_manifest(d, lambda files: files.__setitem__(extra, _entry(b"x")))
        assert not store.is_complete(1, 1), extra
        with pytest.raises(CheckpointError, match="not part of a checkpoint"):
            store.load(0, 1)
        (d / "MANIFEST.json").write_text(saved)
    assert store.load(0, 1)[0] == 1


def test_piece_whose_names_do_not_map_back_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, _part(1))
    d = _pdir(tmp_path, 1)
    a = np.arange(2, dtype=np.int64)
    blob = bytes(serialize({"": TensorSpec(dtype="int64", shape=[2], data_ptr=a.ctypes.data, data_len=a.nbytes)}))
    (d / PIECES[1]).write_bytes(blob)
    _rewrite_manifest(d, lambda files: files.__setitem__(PIECES[1], _entry(blob)))
    assert store.is_complete(1, 1)
    with pytest.raises(CheckpointError, match="do not map back"):
        store.load(0, 1)
    assert store.list()[0]["parts"][0]["problem"] is not None


def test_rewrite_with_pieces_is_a_no_op_and_conflicts_are_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    d = store.write(1, 0, 1, _part(1))
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert store.write(1, 0, 1, _part(1)) == d
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    changed = dict(_part(1).tensors)
    changed["rows/00002/ids"] = changed["rows/00002/ids"] + 1  # one piece differs, the rest the same
    fewer = {k: v for k, v in _part(1).tensors.items() if not k.startswith("rows/00002/")}
    more = {**_part(1).tensors, "rows/00003/ids": np.zeros(1, dtype=np.int64)}
    for tensors in (changed, fewer, more):
        with pytest.raises(CheckpointError, match="different content"):
            store.write(1, 0, 1, ShardPart(tensors, _part(1).metadata))
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    _assert_same(store.load(0, 1)[1], _part(1))


class Crash(Exception):
    pass


def test_crash_between_pieces_keeps_the_previous_checkpoint_and_a_retry_cleans_up(tmp_path):
    calls = []

    def failpoint(name):
        calls.append(name)
        if name == "piece_written" and calls.count(name) == 2:
            raise Crash(name)

    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, _part(1))
    with pytest.raises(Crash):
        CheckpointStore(tmp_path, failpoint=failpoint).write(2, 0, 1, _part(2))
    assert calls[:6] == ["before_tensors", "tensors_written", "before_piece", "piece_written", "before_piece",
                         "piece_written"]
    assert store.load(0, 1)[0] == 1 and store.unfinished(1) == [2]
    # The retry has different content with fewer pieces: the earlier attempt's extra pieces go.
    retry = ShardPart({"rows/00000/ids": np.arange(2, dtype=np.int64)}, {"checkpoint": 2})
    d = store.write(2, 0, 1, retry)
    assert sorted(p.name for p in d.glob("rows-*")) == ["rows-00000.safetensors"]
    cid, got = store.load(0, 1)
    assert cid == 2
    _assert_same(got, retry)


def test_pieces_are_encoded_and_read_one_at_a_time(tmp_path):
    """Python-side allocations (numpy's and the encoded/read bytes are traced) stay near one
    piece's size, where one buffer for the whole state would need all of it at once."""
    mib, k = 1 << 20, 4
    part = ShardPart({f"rows/{i:05d}/values": np.full(2 * mib, i, dtype=np.float32) for i in range(k)}, {})
    store = CheckpointStore(tmp_path)
    tracemalloc.start()
    try:
        store.write(1, 0, 1, part)  # also re-reads and verifies every piece to commit
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = store.load(0, 1)[1]
        held, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    piece = 8 * mib
    assert write_peak < 2.5 * piece, write_peak / mib  # a whole-state buffer alone is 4 pieces
    assert held >= k * piece and load_peak - held < 2.5 * piece, (held / mib, load_peak / mib)
    _assert_same(got, part)
