"""What runs on the Ray nodes for ``psworker.ray``: ``ShardActor`` and ``WorkerActor``, each the
supervisor of one ``psserver`` or ``psworker`` child, and ``JobControl``, the job's named actor.

Apart from the driver because Ray ships an actor class by reference to its module: every node
imports this module to run one, so it holds what the actors need and nothing of the driver's
(no Ray at import time, no placement or scaling). A child is tied to its actor's process
(``PR_SET_PDEATHSIG``), so that no shard or worker outlives the actor Ray supervises it through,
and a shard whose child dies ends its own process so that Ray restarts it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path

from pswire.files import write_atomically
from psworker.children import METRICS_LINE, exit_reason, result_line
from psworker.clusterflags import RAY_RUN_MARK

__all__ = ["JobControl", "ShardActor", "WorkerActor"]

_PR_SET_PDEATHSIG = 1
_RESTORED = re.compile(r"\brestored checkpoint (\d+)\b")


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the actor's process dies, so that a killed or
    lost actor never leaves a shard or worker running unsupervised."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Child:
    """An actor's child process: its lines go to the actor's stderr (which Ray streams to the
    driver) prefixed with the child's name; stdout's last JSON line is its result."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.result: dict | None = None
        self.metrics: str | None = None
        self.restored: int | None = None
        self.tail: deque[str] = deque(maxlen=30)
        # The actor's methods and __init__ run on its process's main thread, which lives as
        # long as the process: the death signal is tied to that thread.
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      preexec_fn=_die_with_parent)
        self._threads = [threading.Thread(target=self._relay, args=(s, s is self.popen.stdout), daemon=True)
                         for s in (self.popen.stdout, self.popen.stderr)]
        for t in self._threads:
            t.start()

    def _relay(self, stream, is_stdout: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if is_stdout and (result := result_line(line)) is not None:
                self.result = result
                continue
            self.tail.append(line)
            if match := METRICS_LINE.search(line):
                self.metrics = match[1]
            if match := _RESTORED.search(line):
                self.restored = int(match[1])
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def finished(self, timeout: float = 10.0) -> int | None:
        """The exit status once the child has exited and its output is read, else None."""
        returncode = self.popen.poll()
        if returncode is not None:
            for t in self._threads:
                t.join(timeout=timeout)
        return returncode

    def stop(self, timeout: float) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                return self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait()


def _env(extra: dict[str, str]) -> dict[str, str]:
    """A child's environment: the actor's own (this node's), with the job's additions."""
    return dict(os.environ, **extra, PYTHONUNBUFFERED="1")


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _check_run_dir(run_dir: Path, job_id: str, host: str) -> None:
    mark = run_dir / RAY_RUN_MARK
    try:
        seen = mark.read_text().strip()
    except OSError:
        seen = None
    if seen != job_id:
        raise RuntimeError(f"the run directory {run_dir} is not the job's on node {host} ({mark} "
                           f"{'is missing' if seen is None else 'belongs to another job'}): give --run-dir a path "
                           "every node of the Ray cluster sees, as the same directory (NFS, a shared volume)")


class ShardActor:
    """One shard: ``psserver`` on this node's address, restored from the job's checkpoints when
    there are any. Made a Ray actor by ``run_on_ray`` (``ray.remote(ShardActor)``)."""

    def __init__(self, index: int, num_shards: int, run_dir: str, job_id: str, argv: list[str],
                 env: dict[str, str], start_timeout: float) -> None:
        self.index, self.host = index, _node_address()
        run = Path(run_dir)
        _check_run_dir(run, job_id, self.host)
        self.state = run / "shards" / f"shard-{index}.json"
        self.state.parent.mkdir(exist_ok=True)
        port = 0
        try:
            before = json.loads(self.state.read_text())
            if before.get("host") == self.host:  # restarted on its node: serve where the workers look
                port = int(before["port"])
        except (OSError, ValueError, KeyError):
            pass
        self.stopping = False
        self.child, self.port = self._serve(port, argv, env, start_timeout)
        write_atomically(self.state, json.dumps({"host": self.host, "port": self.port, "pid": os.getpid()}))
        threading.Thread(target=self._watch, daemon=True).start()

    def _serve(self, port: int, argv: list[str], env: dict[str, str], timeout: float) -> tuple[_Child, int]:
        local = Path(tempfile.mkdtemp(prefix=f"psshard{self.index}-"))
        deadline = time.monotonic() + timeout
        while True:
            port_file = local / f"port-{uuid.uuid4().hex}"
            child = _Child(f"shard{self.index}", [
                sys.executable, "-m", "psserver", "--host", self.host, "--port", str(port),
                "--port-file", str(port_file), *argv], _env(env))
            while not port_file.exists() and child.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # a starting process offers nothing to wait on
            if port_file.exists():
                return child, int(port_file.read_text())
            returncode = child.finished()
            if returncode is None:
                child.stop(10.0)
                raise RuntimeError(f"shard{self.index} did not start listening on {self.host} within {timeout:.0f}s")
            # The port it had may still be held by its predecessor's dying process for a moment.
            if port and time.monotonic() < deadline and any("in use" in line for line in child.tail):
                time.sleep(0.5)
                continue
            raise RuntimeError(f"shard{self.index} exited with {exit_reason(returncode)} while starting on "
                               f"{self.host}: " + " | ".join(list(child.tail)[-5:]))

    def _watch(self) -> None:
        returncode = self.child.popen.wait()
        if not self.stopping:
            print(f"[shard{self.index}] psserver ended with {exit_reason(returncode)}; ending its actor so that "
                  "Ray restarts it", file=sys.stderr, flush=True)
            os._exit(1)

    def info(self) -> dict:
        return {"address": f"{self.host}:{self.port}", "host": self.host, "pid": os.getpid(),
                "server_pid": self.child.popen.pid, "metrics": self.child.metrics, "restored": self.child.restored}

    def stop(self, timeout: float = 20.0) -> int:
        self.stopping = True
        return self.child.stop(timeout)


class WorkerActor:
    """One elastic ``psworker``. Made a Ray actor by ``run_on_ray``."""

    def __init__(self, name: str, run_dir: str, job_id: str, argv: list[str], env: dict[str, str]) -> None:
        self.host = _node_address()
        _check_run_dir(Path(run_dir), job_id, self.host)
        # Metrics on the node's address, where Prometheus on another machine reaches them.
        metrics_host = ["--metrics-host", self.host] if "--metrics-port" in argv else []
        self.child = _Child(name, [sys.executable, "-m", "psworker", *argv, *metrics_host], _env(env))

    def info(self) -> dict:
        return {"host": self.host, "pid": os.getpid(), "worker_pid": self.child.popen.pid,
                "metrics": self.child.metrics}

    def poll(self) -> dict:
        returncode = self.child.finished()
        return {"returncode": returncode, "result": self.child.result if returncode is not None else None,
                "tail": list(self.child.tail)[-5:], "metrics": self.child.metrics}

    def stop(self) -> None:
        """SIGTERM: the worker stops after its step and hands back the data it holds."""
        if self.child.popen.poll() is None:
            self.child.popen.send_signal(signal.SIGTERM)


class JobControl:
    """The running job's named actor: ``--set-workers`` writes the number of workers wanted,
    the driver reads it, and publishes what runs."""

    def __init__(self, workers: int) -> None:
        self.wanted = workers
        self.state: dict = {}

    def set_workers(self, n: int) -> dict:
        self.wanted = n
        return self.state

    def workers_wanted(self) -> int:
        return self.wanted

    def publish(self, state: dict) -> None:
        self.state = state
