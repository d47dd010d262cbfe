"""Fixtures that start real ``psserver`` processes on ports chosen at run time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs the property tests on a fixed sequence of examples, so a submission's result does
# not depend on the luck of the draw; local runs keep exploring new examples every time.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent

_DATA_CACHE = "PSGRPC_CACHE_DIR"  # psworker.tasks.CACHE_ENV (a test holds the two equal)
_session_cache: str | None = None


def pytest_configure(config):
    # The session's processes share one data cache of their own (generated MNIST-1D), made by
    # the first that needs it: neither the user's cache nor a generation per worker started.
    global _session_cache
    if _DATA_CACHE not in os.environ:
        _session_cache = tempfile.mkdtemp(prefix="psgrpc-test-cache-")
        os.environ[_DATA_CACHE] = _session_cache


def pytest_unconfigure(config):
    if _session_cache is not None:
        os.environ.pop(_DATA_CACHE, None)
        shutil.rmtree(_session_cache, ignore_errors=True)


SPREAD = {"PSWORKER_PACK_BELOW": "0"}
"""The tests' models are small stand-ins for ones spread over the shards: a model this small
would live whole on shard 0 (``pswire.placement.PACK_BELOW``), leaving the other shards nothing
to lose, restore or apply. Workers the tests start spread them; the tests of packing itself
give ``env=packed_env()``."""


def child_env() -> dict[str, str]:
    # One torch thread per process: the tests run shards and workers side by side on few cores.
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **SPREAD)


def packed_env() -> dict[str, str]:
    """``child_env`` with psworker's default placement: small models whole on shard 0."""
    return {k: v for k, v in child_env().items() if k not in SPREAD}


def terminate(popen: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM ``popen`` and wait for it; SIGKILL it if it has not exited within ``timeout``."""
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=timeout)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (exited, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@dataclass
class ShardProcess:
    popen: subprocess.Popen
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.popen)


def start_shard(directory: Path, name: str, *extra: str, timeout: float = 60.0) -> ShardProcess:
    """Start ``psserver --port 0`` and wait (with a deadline) until it reports its port."""
    port_file = directory / f"{name}.port"
    log_path = directory / f"{name}.log"
    with open(log_path, "w") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "psserver", "--port", "0", "--port-file", str(port_file), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
        )
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        try:
            popen.wait(timeout=0.1)  # returns early only if the shard died
        except subprocess.TimeoutExpired:
            pass
        else:
            raise RuntimeError(f"{name} exited with {popen.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            popen.kill()
            raise TimeoutError(f"{name} did not report a port within {timeout}s:\n{log_path.read_text()}")
    return ShardProcess(popen, int(port_file.read_text()), log_path)


@pytest.fixture
def shards(tmp_path):
    """A factory: ``shards(n, *flags)`` starts n shards; all are stopped after the test."""
    started: list[ShardProcess] = []

    def make(n: int, *extra: str) -> list[ShardProcess]:
        new = [start_shard(tmp_path, f"shard{len(started) + i}", *extra) for i in range(n)]
        started.extend(new)
        return new

    yield make
    for shard in started:
        shard.stop()


def wait_until(predicate, timeout: float, pace: subprocess.Popen, what: str):
    """Poll ``predicate`` until it returns something truthy (returned), failing after
    ``timeout`` seconds; each pause waits on ``pace``, so it ends early if that process exits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        try:
            pace.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass


def run_cli(*argv: str, timeout: float = 300.0, **kw) -> subprocess.CompletedProcess:
    """Run a console entry point module (``psworker``, ``psctl`` ...) to completion."""
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout,
        env=child_env(), cwd=ROOT, **kw,
    )
