"""The data cache (``psworker.tasks.data_cache_dir``): MNIST-1D generated once and kept, read
back bit for bit, and a damaged, foreign or tampered file ignored and replaced, never trusted
and never unpickled; ``off`` and a directory that cannot be made keep nothing and still train."""

from __future__ import annotations

import io
import logging
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from psworker import tasks
from psworker.tasks import CACHE_ENV, data_cache_dir, load_task
from tests.conftest import _DATA_CACHE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def generated() -> tuple[np.ndarray, ...]:
    """MNIST-1D as mnist1d generates it (once for the module: several seconds)."""
    return tasks._generate_mnist1d()


@pytest.fixture
def cache(tmp_path, monkeypatch, generated) -> Path:
    """A fresh cache directory; generation counted (it returns the real arrays)."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(directory))
    monkeypatch.setattr(tasks, "_generate_mnist1d", _Counting(generated))
    tasks._mnist1d_arrays.cache_clear()
    yield directory
    tasks._mnist1d_arrays.cache_clear()


class _Counting:
    def __init__(self, arrays: tuple[np.ndarray, ...]) -> None:
        self.arrays, self.calls = arrays, 0

    def __call__(self) -> tuple[np.ndarray, ...]:
        self.calls += 1
        return tuple(a.copy() for a in self.arrays)


def _fresh_process_load() -> tuple[np.ndarray, ...]:
    tasks._mnist1d_arrays.cache_clear()  # what a new process starts with
    return tasks._mnist1d_arrays()


def _cache_file(directory: Path) -> Path:
    files = sorted(directory.glob("mnist1d-*.npz"))
    assert len(files) == 1, files
    return files[0]


def test_the_env_name_is_the_tests_own():
    assert CACHE_ENV == _DATA_CACHE


def test_generated_once_then_read_back_bit_for_bit(cache, generated):
    first = _fresh_process_load()
    path = _cache_file(cache)
    assert tasks._generate_mnist1d.calls == 1 and path.name == f"mnist1d-{_release()}.npz"
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    second = _fresh_process_load()
    assert tasks._generate_mnist1d.calls == 1  # read, not generated
    for a, b, c in zip(first, second, generated):
        assert a.dtype == b.dtype == c.dtype and np.array_equal(a, c) and np.array_equal(b, c)
        assert not b.flags.writeable
    # What a task trains on is the same either way.
    task = load_task("mnist1d-cnn")
    assert np.array_equal(task.train[0].numpy(), generated[0]) and np.array_equal(task.test[1].numpy(), generated[3])
    assert tasks._generate_mnist1d.calls == 1


def _release() -> str:
    import importlib.metadata

    return importlib.metadata.version("mnist1d")


def _rewrite(path: Path, **arrays: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.write_bytes(buffer.getvalue())


def _kept(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {key: np.array(data[key]) for key in data.files}


def _tampered(path: Path) -> None:
    arrays = _kept(path)
    arrays["y"][0] = (arrays["y"][0] + 1) % 10  # a label changed, the checksum kept
    _rewrite(path, **arrays)


def _foreign_dtype(path: Path) -> None:
    arrays = _kept(path)
    arrays["x"] = arrays["x"].astype(np.float64)
    _rewrite(path, **arrays)


def _pickled(path: Path) -> None:
    arrays = _kept(path)
    arrays["x"] = np.array([{"not": "data"}], dtype=object)  # np.savez pickles object arrays
    _rewrite(path, **arrays)


def _no_checksum(path: Path) -> None:
    arrays = _kept(path)
    del arrays["sha256"]
    _rewrite(path, **arrays)


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "ignoring the cached MNIST-1D data"),
    (lambda p: p.write_bytes(b"\x00" * 64), "ignoring the cached MNIST-1D data"),
    (lambda p: p.write_bytes(pickle.dumps({"x": 1})), "ignoring the cached MNIST-1D data"),
    (_pickled, "ignoring the cached MNIST-1D data"),
    (_no_checksum, "sha256"),
    (_foreign_dtype, "'x' is float64 of 2 dimension"),
    (_tampered, "its checksum does not match its arrays"),
], ids=["truncated", "zeros", "a-pickle", "object-array", "no-checksum", "float64", "tampered"])
def test_a_damaged_or_foreign_file_is_ignored_named_and_replaced(cache, generated, damage, message, caplog):
    _fresh_process_load()
    path = _cache_file(cache)
    damage(path)
    caplog.set_level(logging.WARNING, logger="psworker.tasks")
    again = _fresh_process_load()
    assert message in caplog.text and str(path) in caplog.text, caplog.text
    assert tasks._generate_mnist1d.calls == 2
    assert all(np.array_equal(a, b) for a, b in zip(again, generated))
    # Replaced by a good file: the next process reads it.
    caplog.clear()
    _fresh_process_load()
    assert tasks._generate_mnist1d.calls == 2 and not caplog.text


def test_off_keeps_nothing(tmp_path, monkeypatch, generated):
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tasks, "_generate_mnist1d", _Counting(generated))
    assert data_cache_dir() is None
    try:
        _fresh_process_load()
        _fresh_process_load()
    finally:
        tasks._mnist1d_arrays.cache_clear()
    assert tasks._generate_mnist1d.calls == 2 and not list(tmp_path.iterdir())


def test_the_default_directory_follows_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_cache_dir() == tmp_path / "xdg" / "psgrpc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_cache_dir() == tmp_path / "home" / ".cache" / "psgrpc"
    monkeypatch.setenv(CACHE_ENV, f" {tmp_path / 'given'} ")
    assert data_cache_dir() == tmp_path / "given"


def test_a_directory_that_cannot_be_made_is_skipped_and_training_goes_on(tmp_path, monkeypatch, generated, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    monkeypatch.setattr(tasks, "_generate_mnist1d", _Counting(generated))
    caplog.set_level(logging.INFO, logger="psworker.tasks")
    try:
        arrays = _fresh_process_load()
    finally:
        tasks._mnist1d_arrays.cache_clear()
    assert all(np.array_equal(a, b) for a, b in zip(arrays, generated))
    assert f"cannot keep MNIST-1D in {blocker / 'cache'}" in caplog.text and f"{CACHE_ENV}=off" in caplog.text


def test_the_kept_file_is_plain_arrays(cache):
    _fresh_process_load()
    with zipfile.ZipFile(_cache_file(cache)) as archive:
        assert sorted(archive.namelist()) == ["sha256.npy", "x.npy", "x_test.npy", "y.npy", "y_test.npy"]
