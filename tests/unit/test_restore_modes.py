"""``psserver --restore never|always|auto``: the flag's and PSSERVER_RESTORE's spellings, and
what ``Checkpointer.restore`` does with each state of a checkpoint directory, asserted on the
reason it gives (the line the shard logs): auto starts empty where there is nothing to restore
(no directory, no checkpoint, only unfinished ones, only an ended job's) and fails where
complete checkpoints exist but none is usable; always fails in both."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from psserver.checkpoint import CheckpointError, CheckpointStore, JobEndedError
from psserver.checkpointer import Checkpointer, Restored, parse_schedule
from psserver.config import ServerConfig, parse_args
from psserver.store import ShardStore
from tests.unit.test_shard_metrics import ONES, PART, job

pytestmark = pytest.mark.timeout(60)

SHARD = ["--checkpoint-dir", "/tmp/ckpt", "--shard-index", "0", "--num-shards", "1"]


# -- the flag and the variable ---------------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    ([], "never"),
    (["--restore"], "always"),
    (["--restore", "always"], "always"),
    (["--restore", "auto"], "auto"),
    (["--restore=auto"], "auto"),
    (["--restore", "never"], "never"),
])
def test_restore_flag_spellings(argv, expected):
    assert parse_args([*SHARD, *argv], {}).restore == expected


@pytest.mark.parametrize("value, expected", [
    ("auto", "auto"), ("always", "always"), ("never", "never"), (" auto ", "auto"),
    ("1", "always"), ("true", "always"), ("TRUE", "always"), ("yes", "always"), ("on", "always"),
    ("0", "never"), ("false", "never"), ("No", "never"), ("off", "never"), ("", "never"),
])
def test_restore_variable_spellings(value, expected):
    assert parse_args(SHARD, {"PSSERVER_RESTORE": value}).restore == expected


def test_the_restore_flag_wins_over_the_variable():
    assert parse_args([*SHARD, "--restore", "never"], {"PSSERVER_RESTORE": "auto"}).restore == "never"
    assert parse_args([*SHARD, "--restore"], {"PSSERVER_RESTORE": "auto"}).restore == "always"


@pytest.mark.parametrize("argv, env, message", [
    (["--restore", "sometimes"], {},
     "argument --restore: invalid choice: 'sometimes' (choose from 'never', 'always', 'auto')"),
    ([], {"PSSERVER_RESTORE": "maybe"},
     "PSSERVER_RESTORE='maybe' (--restore) must be one of never, always, auto, or 1/true/yes/on (always) or "
     "0/false/no/off (never)"),
    ([], {"PSSERVER_RESTORE": "AUTO"}, "PSSERVER_RESTORE='AUTO' (--restore) must be one of never, always, auto"),
])
def test_an_invalid_restore_value_names_the_flag_and_the_allowed_values(argv, env, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*SHARD, *argv], env)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, env, message", [
    (["--restore", "auto"], {}, "need --checkpoint-dir"),
    ([], {"PSSERVER_RESTORE": "auto"}, "need --checkpoint-dir"),
    (["--restore", "auto", "--checkpoint-dir", "/tmp/x"], {}, "--restore needs --shard-index"),
    (["--restore", "always", "--checkpoint-dir", "/tmp/x", "--shard-index", "1", "--num-shards", "1"], {},
     "--restore needs --shard-index"),
])
def test_auto_and_always_need_a_directory_and_the_shards_place(argv, env, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, env)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_never_needs_nothing_and_config_objects_take_the_old_booleans():
    assert parse_args(["--restore", "never"], {"PSSERVER_RESTORE": "auto"}).restore == "never"
    assert ServerConfig(restore=True, checkpoint_dir="/d", shard_index=0, num_shards=1).restore == "always"
    assert ServerConfig(restore=False).restore == "never"
    with pytest.raises(ValueError, match="--restore must be one of never, always, auto"):
        ServerConfig(restore="sometimes", checkpoint_dir="/d", shard_index=0, num_shards=1)


# -- what a restore finds --------------------------------------------------------------------


def _trained(versions: int = 1) -> ShardStore:
    store, w = job("a")
    a = w["a"]
    for step in range(versions):
        store.apply_push(a.worker_id, a.generation, step + 1, step, [PART], [ONES], session=a.session)
    return store


def _restore(directory: Path, *, required: bool, schedule: str = "") -> tuple[Restored, ShardStore]:
    fresh = ShardStore()
    restored = Checkpointer(fresh, str(directory), schedule=parse_schedule(schedule)).restore(0, 1, required=required)
    return restored, fresh


def _unfinished(directory: Path, checkpoint_id: int) -> None:
    """Checkpoint ``checkpoint_id`` as a writer killed before its manifest leaves it."""
    def crash(phase: str) -> None:
        if phase == "before_manifest":
            raise OSError("killed")

    with pytest.raises(OSError):
        Checkpointer(_trained(), str(directory), failpoint=crash).checkpoint(checkpoint_id)


def _damage(directory: Path, checkpoint_id: int) -> None:
    """Flip bytes of a part's tensors, keeping its size: only the sha256 tells."""
    path = directory / f"ckpt-{checkpoint_id:012d}" / "shard-0-of-1" / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
    path.write_bytes(bytes(data))


def test_nothing_to_restore_starts_empty_under_auto_and_fails_under_always(tmp_path):
    missing = tmp_path / "not-yet"
    restored, store = _restore(missing, required=False)
    assert restored == Restored(None, f"no checkpoint in {missing}: it does not exist (yet): starting empty")
    assert store.status()["state"] == "empty" and not missing.exists()
    with pytest.raises(CheckpointError, match="does not exist .yet.: nothing to restore .--restore auto would"):
        _restore(missing, required=True)
    (tmp_path / "empty").mkdir()
    restored, _ = _restore(tmp_path / "empty", required=False)
    assert restored == Restored(None, f"no checkpoint in {tmp_path / 'empty'}: starting empty", logging.INFO)


def test_only_unfinished_checkpoints_start_empty_with_a_warning_naming_them(tmp_path):
    _unfinished(tmp_path, 5)
    _unfinished(tmp_path, 9)
    restored, store = _restore(tmp_path, required=False)
    assert restored.checkpoint_id is None and restored.level == logging.WARNING
    assert restored.reason == (f"no complete checkpoint in {tmp_path}: skipped unfinished checkpoint(s) 9, 5 (their "
                               "writers stopped before every part was written): starting empty")
    assert store.status()["state"] == "empty"
    with pytest.raises(CheckpointError, match="skipped unfinished checkpoint.s. 9, 5"):
        _restore(tmp_path, required=True)


@pytest.mark.parametrize("required", [False, True])
def test_a_complete_checkpoint_is_restored_whatever_the_mode(tmp_path, required):
    Checkpointer(_trained(3), str(tmp_path)).checkpoint(4)
    _unfinished(tmp_path, 6)  # newer, but unfinished: the complete one is used
    restored, store = _restore(tmp_path, required=required)
    assert restored == Restored(4, f"restored checkpoint 4 from {tmp_path}")
    assert store.status()["version"] == 3
    assert np.array_equal(store.export()[1]["var/w"], np.full(2, -3.0))


def test_a_damaged_checkpoint_falls_back_to_an_older_complete_one(tmp_path):
    trained = Checkpointer(_trained(2), str(tmp_path))
    trained.checkpoint(1)
    trained.checkpoint(2)
    _damage(tmp_path, 2)
    restored, store = _restore(tmp_path, required=False)
    assert restored.checkpoint_id == 1 and store.status()["version"] == 2


def test_auto_fails_when_every_complete_checkpoint_is_damaged(tmp_path):
    trained = Checkpointer(_trained(2), str(tmp_path))
    trained.checkpoint(1)
    trained.checkpoint(2)
    _damage(tmp_path, 1)
    _damage(tmp_path, 2)
    with pytest.raises(CheckpointError, match="no usable checkpoint .*checkpoint 2 part 0/1: tensors.safetensors "
                                              "does not match its sha256"):
        _restore(tmp_path, required=False)


def test_auto_fails_on_another_shard_counts_checkpoints_and_an_unreadable_directory(tmp_path):
    from psserver.checkpoint import ShardPart

    CheckpointStore(tmp_path / "two").write(3, 0, 2, ShardPart({"var/w": np.ones(2)}, {}))
    CheckpointStore(tmp_path / "two").write(3, 1, 2, ShardPart({"var/w": np.ones(2)}, {}))
    with pytest.raises(CheckpointError, match="checkpoint 3 in .* was made for 2 shards, this job has 1"):
        _restore(tmp_path / "two", required=False)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot read the checkpoints in"):
        _restore(tmp_path / "file", required=False)


def test_an_ended_jobs_checkpoints_start_a_new_job_empty_under_auto(tmp_path, caplog):
    Checkpointer(_trained(), str(tmp_path)).checkpoint(7)
    CheckpointStore(tmp_path).mark_ended("task=old")
    restored, store = _restore(tmp_path, required=False)
    assert restored == Restored(None, f"the checkpoints in {tmp_path} (up to 7) belong to job 'task=old', ended by "
                                      "psctl end-job: starting empty for a new job")
    assert store.status()["state"] == "empty"
    with pytest.raises(JobEndedError, match="ended by psctl end-job"):
        _restore(tmp_path, required=True)
    # A steps schedule numbers the new job's checkpoints below the ended one's: said at start.
    with caplog.at_level(logging.WARNING, logger="psserver.checkpointer"):
        _restore(tmp_path, required=False, schedule="500")
    assert "are never restored from" in caplog.text and "below checkpoint 7" in caplog.text


def test_an_ended_job_then_an_unfinished_first_checkpoint_of_the_next_starts_empty(tmp_path):
    Checkpointer(_trained(), str(tmp_path)).checkpoint(7)
    CheckpointStore(tmp_path).mark_ended("task=old")
    _unfinished(tmp_path, 8)  # LATEST still names the ended job's 7
    restored, _ = _restore(tmp_path, required=False)
    assert restored.checkpoint_id is None and restored.level == logging.WARNING
    assert "skipped unfinished checkpoint(s) 8" in restored.reason
    assert "(the older ones belong to job 'task=old', ended by psctl end-job): starting empty" in restored.reason
    Checkpointer(_trained(2), str(tmp_path)).checkpoint(9)  # the next job's first complete one
    restored, store = _restore(tmp_path, required=False)
    assert restored.checkpoint_id == 9 and store.status()["version"] == 2
