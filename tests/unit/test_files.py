"""pswire.files: a watched file is replaced whole, and a failed write leaves nothing behind."""

from __future__ import annotations

import pytest

from pswire.files import write_atomically

pytestmark = pytest.mark.timeout(30)


def test_text_and_bytes_replace_the_file_whole(tmp_path):
    path = tmp_path / "targets.json"
    write_atomically(path, "[]\n")
    assert path.read_text() == "[]\n"
    write_atomically(str(path), b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["targets.json"]


def test_a_failed_rename_leaves_the_target_and_no_temporary_file(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("kept")
    with pytest.raises(OSError):
        write_atomically(target, "x")  # a directory cannot be replaced by a file
    assert (target / "inside").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_missing_directory_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        write_atomically(tmp_path / "missing" / "file", "x")
