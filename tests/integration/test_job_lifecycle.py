"""Jobs have a lifecycle: ``psctl end-job`` ends the job on every shard (after a final
checkpoint, when asked), its workers stop with a clear error instead of hanging or starting
the old model again, and a different model then trains on the same shards; a worker that joins
a running job says so; ``psctl status --watch`` refreshes until Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, child_env, run_cli, wait_until

pytestmark = pytest.mark.timeout(300)


def _status(ps: str) -> list[dict]:
    result = run_cli("psworker.ctl", "status", "--ps", ps, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _worker(ps: str, tmp_path, name: str, *flags: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "psworker", "--ps", ps, "--worker-name", name, "--progress", "log", *flags],
        stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT, text=True,
    )


def test_end_job_with_a_final_checkpoint_then_a_different_model_trains_on_the_same_shards(shards, tmp_path):
    ckpt = tmp_path / "ckpt"
    s = shards(2, "--checkpoint-dir", str(ckpt))
    ps = ",".join(x.address for x in s)
    old = _worker(ps, tmp_path, "old", "--task", "mnist1d-mlp", "--steps", "1000000",
                  "--worker-index", "0", "--num-workers", "1")
    try:
        wait_until(lambda: all(x["version"] >= 20 for x in _status(ps)), 120, old, "the first job to train")
        ended = run_cli("psworker.ctl", "end-job", "--ps", ps, "--checkpoint", timeout=120)
        assert ended.returncode == 0, ended.stdout + ended.stderr
        assert "ended job 'task=mnist1d-mlp'" in ended.stdout and "final checkpoint" in ended.stdout
        assert "complete" in ended.stdout and "INCOMPLETE" not in ended.stdout
        # The ended job's worker is told, and stops: no hang, no re-registration as a new job.
        old.wait(timeout=60)
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()
    log = (tmp_path / "old.log").read_text()
    assert old.returncode != 0 and "was ended on this shard" in log, log[-3000:]
    after = _status(ps)
    assert [x["state"] for x in after] == ["empty", "empty"] and all(not x["workers"] for x in after)
    latest = json.loads((ckpt / "LATEST").read_text())
    assert latest["num_shards"] == 2 and (ckpt / f"ckpt-{latest['id']:012d}").is_dir()
    # A shard restored from there after the end does not bring the ended job back.
    restored = run_cli("psserver", "--port", "0", "--checkpoint-dir", str(ckpt), "--restore", "--shard-index", "0",
                       "--num-shards", "2", timeout=60)
    assert restored.returncode != 0 and "ended by psctl end-job" in restored.stderr, restored.stderr[-2000:]

    # A different model on the same shards: it defines a new job, and the next worker joins it.
    new = run_cli("psworker", "--ps", ps, "--task", "mnist1d-cnn", "--steps", "20", "--worker-name", "new",
                  "--worker-index", "0", "--num-workers", "1", "--progress", "log", timeout=240)
    assert new.returncode == 0, new.stderr[-3000:]
    assert "joining job" not in new.stderr
    assert {x["job_fingerprint"] for x in _status(ps)} == {"task=mnist1d-cnn"}
    again = run_cli("psworker", "--ps", ps, "--task", "mnist1d-cnn", "--steps", "5", "--worker-name", "again",
                    "--worker-index", "0", "--num-workers", "1", "--progress", "log", timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "joining job 'task=mnist1d-cnn' at version" in again.stderr, again.stderr[-3000:]


def test_end_job_on_empty_shards_and_a_different_job_guard(shards):
    s = shards(1)
    result = run_cli("psworker.ctl", "end-job", "--ps", s[0].address, timeout=60)
    assert result.returncode == 0 and "no job to end" in result.stdout, result.stdout + result.stderr
    result = run_cli("psworker.ctl", "end-job", "--ps", s[0].address, "--checkpoint", timeout=60)
    assert result.returncode == 0 and "no job to end" in result.stdout, result.stdout + result.stderr


def test_a_final_checkpoint_without_a_checkpoint_dir_is_refused_and_the_job_goes_on(shards, tmp_path):
    s = shards(1)
    ps = s[0].address
    done = run_cli("psworker", "--ps", ps, "--task", "mnist1d-mlp", "--steps", "5", "--worker-name", "a",
                   "--worker-index", "0", "--num-workers", "1", "--progress", "none", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = run_cli("psworker.ctl", "end-job", "--ps", ps, "--checkpoint", timeout=60)
    assert result.returncode == 1 and "no --checkpoint-dir" in result.stderr, result.stdout + result.stderr
    assert _status(ps)[0]["state"] == "ready"


def test_status_watch_refreshes_until_interrupted(shards):
    s = shards(1)
    watch = subprocess.Popen(
        [sys.executable, "-m", "psworker.ctl", "status", "--ps", s[0].address, "--watch", "0.3", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), cwd=ROOT, text=True,
    )
    try:
        lines = [watch.stdout.readline() for _ in range(3)]
        records = [json.loads(line) for line in lines]
        assert all(r["shards"][0]["state"] == "empty" for r in records)
        assert records[0]["time"] < records[1]["time"] < records[2]["time"]
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0, watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_status_watch_table_shows_rates(shards):
    s = shards(1)
    started = time.monotonic()
    watch = subprocess.Popen(
        [sys.executable, "-m", "psworker.ctl", "status", "--ps", s[0].address, "--watch", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), cwd=ROOT, text=True,
    )
    try:
        seen: list[str] = []
        while sum("rates:" in line for line in seen) < 2:
            line = watch.stdout.readline()
            assert line and time.monotonic() - started < 60, "".join(seen) + watch.stderr.read()
            seen.append(line)
        text = "".join(seen)
        assert "(first sample)" in text and "pushes applied/s" in text and "Ctrl-C to stop" in text
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
