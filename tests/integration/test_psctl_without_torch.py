"""psctl where torch is not installed, as in the server image (psserver and psctl, no torch):
health, status (also --watch), checkpoint and end-job work against a real shard, and export,
the one command that needs torch, says so in one line instead of a traceback.

The psctl processes run behind an import hook that fails every import of the worker-only
packages as a missing one would, so an import of torch anywhere on their path fails the test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_HOOK = """
import sys

class NotInstalled:
    # What the server image lacks (docker/requirements-worker.txt beyond the server's).
    missing = {"torch", "mnist1d", "tqdm"}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in cls.missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled)
"""
_WITHOUT_TORCH = _HOOK + "from psworker.ctl import main\nsys.exit(main(sys.argv[1:]))\n"


def _psctl(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], capture_output=True, text=True,
                          timeout=120, env=child_env(), cwd=ROOT)


def test_the_hook_stands_in_for_a_missing_torch():
    done = subprocess.run([sys.executable, "-c", _HOOK + "import torch\n"],
                          capture_output=True, text=True, timeout=60, env=child_env(), cwd=ROOT)
    assert done.returncode == 1 and "ModuleNotFoundError: No module named 'torch'" in done.stderr, done.stderr


def test_operator_commands_run_without_torch(shards, tmp_path):
    ckpt = tmp_path / "ckpt"
    (shard,) = shards(1, "--checkpoint-dir", str(ckpt))
    ps = shard.address

    health = _psctl("health", "--ps", ps)
    assert health.returncode == 0 and health.stdout == f"{ps}: SERVING\n", health.stdout + health.stderr
    empty = _psctl("status", "--ps", ps, "--json")
    assert empty.returncode == 0 and json.loads(empty.stdout)[0]["state"] == "empty", empty.stderr

    # A job to operate on, from a worker that has torch.
    trained = run_cli("psworker", "--ps", ps, "--task", "linreg", "--steps", "5", "--worker-name", "w",
                      "--worker-index", "0", "--num-workers", "1", "--progress", "none", timeout=240)
    assert trained.returncode == 0, trained.stderr[-3000:]

    table = _psctl("status", "--ps", ps)
    assert table.returncode == 0 and "ready" in table.stdout and "w(gen 1" in table.stdout, table.stdout + table.stderr
    (status,) = json.loads(_psctl("status", "--ps", ps, "--json").stdout)
    assert status["state"] == "ready" and status["version"] >= 5 and status["job_fingerprint"] == "task=linreg"

    watch = subprocess.Popen([sys.executable, "-c", _WITHOUT_TORCH, "status", "--ps", ps, "--watch", "0.2", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    try:
        first = json.loads(watch.stdout.readline())
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert first["shards"][0]["state"] == "ready" and watch.returncode == 0, err

    checkpoint = _psctl("checkpoint", "--ps", ps, "--id", "7")
    assert checkpoint.returncode == 0, checkpoint.stdout + checkpoint.stderr
    assert "checkpoint 7 complete on 1 shard(s)" in checkpoint.stdout

    for source in (["--ps", ps], ["--checkpoint", str(ckpt)]):
        export = _psctl("export", *source, "--out", str(tmp_path / "model.safetensors"))
        assert export.returncode == 1 and export.stdout == "", export.stdout + export.stderr
        assert export.stderr.startswith("psctl: export needs torch") and "worker image" in export.stderr
        assert len(export.stderr.splitlines()) == 1, export.stderr  # no traceback
        assert not (tmp_path / "model.safetensors").exists()

    ended = _psctl("end-job", "--ps", ps)
    assert ended.returncode == 0, ended.stdout + ended.stderr
    assert f"{ps}: ended job 'task=linreg'" in ended.stdout and "they accept a new job" in ended.stdout
    health = _psctl("health", "--ps", ps, "--json")
    assert health.returncode == 0 and json.loads(health.stdout)[0]["serving"] is True, health.stdout + health.stderr
