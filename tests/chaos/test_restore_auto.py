"""``psserver --restore auto``, as a container with a restart policy runs it: real shard
processes restore the newest complete checkpoint when there is one (the same version and
values as before the stop), start empty and serve when there is none (no directory yet, an
empty one, only a first checkpoint cut short, only a job ended by ``psctl end-job``), and exit 1
naming the problem when every complete checkpoint is damaged rather than drop a trained model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import run_cli, start_shard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 30


def _place(i: int = 0, n: int = 1) -> tuple[str, ...]:
    return ("--shard-index", str(i), "--num-shards", str(n))


def _train(ps: str, steps: int = STEPS) -> None:
    done = run_cli("psworker", "--ps", ps, "--task", "linreg", "--steps", str(steps), "--worker-index", "0",
                   "--num-workers", "1", "--progress", "none", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def _status(ps: str) -> list[dict]:
    result = run_cli("psworker.ctl", "status", "--ps", ps, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _checkpoint(ps: str) -> subprocess.CompletedProcess:
    return run_cli("psworker.ctl", "checkpoint", "--ps", ps, timeout=120)


def _export(ps: str, out: Path) -> dict[str, np.ndarray]:
    result = run_cli("psworker.ctl", "export", "--ps", ps, "--out", str(out), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return load_file(out)


def _damage(part: Path) -> None:
    """Flip the last bytes of a part's tensors, keeping the size: only the sha256 tells."""
    path = part / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
    path.write_bytes(bytes(data))


def test_auto_starts_empty_without_a_directory_and_restores_what_its_schedule_wrote(tmp_path):
    ckpt = tmp_path / "volume" / "ckpt"  # not there yet: the first checkpoint creates it
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "1s", *_place(), "--restore", "auto")
    first = start_shard(tmp_path, "first", *flags)
    try:
        assert f"no checkpoint in {ckpt}: it does not exist (yet): starting empty" in first.log(), first.log()
        assert _status(first.address)[0]["state"] == "empty"
        _train(first.address)
        written = _checkpoint(first.address)  # after the last step: the schedule's may predate it
        assert written.returncode == 0 and "complete" in written.stdout, written.stdout + written.stderr
        before = _export(first.address, tmp_path / "before.safetensors")
        version = _status(first.address)[0]["version"]
        assert version == STEPS
    finally:
        first.stop()
    latest = json.loads((ckpt / "LATEST").read_text())["id"]

    second = start_shard(tmp_path, "second", *flags)
    try:
        assert f"restored checkpoint {latest} from {ckpt}" in second.log(), second.log()
        status = _status(second.address)[0]
        assert (status["state"], status["version"]) == ("ready", version)
        after = _export(second.address, tmp_path / "after.safetensors")
        assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    finally:
        second.stop()


def test_auto_with_an_empty_directory_starts_empty_and_serves(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shard = start_shard(tmp_path, "shard", "--checkpoint-dir", str(ckpt), *_place(), "--restore", "auto")
    try:
        assert f"no checkpoint in {ckpt}: starting empty" in shard.log(), shard.log()
        _train(shard.address, steps=5)
        assert _status(shard.address)[0]["version"] == 5
    finally:
        shard.stop()
    # The old spelling still means "must restore": an empty directory is an error.
    failed = run_cli("psserver", "--port", "0", "--checkpoint-dir", str(tmp_path / "other"), *_place(),
                     "--restore", timeout=60)
    assert failed.returncode == 1 and "cannot restore (--restore always): no checkpoint in" in failed.stderr, \
        failed.stderr[-2000:]


def test_auto_with_only_a_first_checkpoint_cut_short_starts_empty(tmp_path):
    ckpt = tmp_path / "ckpt"
    shards = [start_shard(tmp_path, f"shard{i}", "--checkpoint-dir", str(ckpt), *_place(i, 2)) for i in range(2)]
    try:
        _train(",".join(s.address for s in shards))
        # Only shard 0 writes its part: the checkpoint never completes, as when shard 1 dies first.
        partial = _checkpoint(shards[0].address)
        assert partial.returncode == 1 and "INCOMPLETE" in partial.stdout, partial.stdout + partial.stderr
    finally:
        for s in shards:
            s.stop()
    (unfinished,) = [int(p.name.removeprefix("ckpt-")) for p in ckpt.glob("ckpt-*")]
    assert not (ckpt / "LATEST").exists()

    restarted = start_shard(tmp_path, "shard0-again", "--checkpoint-dir", str(ckpt), *_place(0, 2),
                            "--restore", "auto")
    try:
        assert f"WARNING psserver[{restarted.popen.pid}] psserver.server: no complete checkpoint in {ckpt}: skipped " \
               f"unfinished checkpoint(s) {unfinished} (" in restarted.log(), restarted.log()
        assert "was written): starting empty" in restarted.log()
        assert _status(restarted.address)[0]["state"] == "empty"
    finally:
        restarted.stop()


def test_auto_after_end_job_starts_empty_for_a_new_job(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt), *_place(), "--restore", "auto")
    first = start_shard(tmp_path, "first", *flags)
    try:
        _train(first.address)
        ended = run_cli("psworker.ctl", "end-job", "--ps", first.address, "--checkpoint", timeout=120)
        assert ended.returncode == 0 and "final checkpoint" in ended.stdout, ended.stdout + ended.stderr
    finally:
        first.stop()
    assert (ckpt / "ENDED").exists()

    second = start_shard(tmp_path, "second", *flags)
    try:
        assert "belong to job 'task=linreg', ended by psctl end-job: starting empty for a new job" in second.log(), \
            second.log()
        assert _status(second.address)[0]["state"] == "empty"
        _train(second.address, steps=5)  # the next job trains from scratch
        assert _status(second.address)[0]["version"] == 5
    finally:
        second.stop()


def test_auto_falls_back_past_a_damaged_checkpoint_and_fails_when_every_complete_one_is(tmp_path):
    ckpt = tmp_path / "ckpt"
    shard = start_shard(tmp_path, "shard", "--checkpoint-dir", str(ckpt), *_place())
    try:
        _train(shard.address, steps=10)
        assert _checkpoint(shard.address).returncode == 0
        _train(shard.address, steps=20)  # the same worker again: it resumes at step 11
        assert _checkpoint(shard.address).returncode == 0
        assert _status(shard.address)[0]["version"] == 20
    finally:
        shard.stop()
    older, newer = sorted(ckpt.glob("ckpt-*"))
    _damage(newer / "shard-0-of-1")

    fallback = start_shard(tmp_path, "fallback", "--checkpoint-dir", str(ckpt), *_place(), "--restore", "auto")
    try:
        assert f"restored checkpoint {int(older.name.removeprefix('ckpt-'))} from {ckpt}" in fallback.log(), \
            fallback.log()
        assert "does not match its sha256" in fallback.log()
        assert _status(fallback.address)[0]["version"] == 10
    finally:
        fallback.stop()

    _damage(older / "shard-0-of-1")
    failed = run_cli("psserver", "--port", "0", "--checkpoint-dir", str(ckpt), *_place(), "--restore", "auto",
                     timeout=60)
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert "cannot restore (--restore auto): no usable checkpoint for shard 0 of 1" in failed.stderr, failed.stderr
    assert "tensors.safetensors does not match its sha256" in failed.stderr and "listening" not in failed.stderr
