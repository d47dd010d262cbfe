"""Child processes of a benchmark run: started with ``subprocess.Popen`` (gRPC does not survive
``fork``), their output kept in log files, and every one of them stopped when the run ends.

A server child reports the port it bound (port 0: chosen at run time) by writing a port file,
the way ``psserver --port-file`` does.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Child", "ChildError", "Children", "child_env", "read_proc_cpu_seconds", "read_proc_status_bytes"]

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.05


class ChildError(RuntimeError):
    """A child process failed to start, exited badly or ran past its deadline. The message
    carries the tail of its log."""


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: one compute thread per process, since shards, workers and
    this process share a few cores, and more threads than cores make throughput collapse."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(extra or {})
    return env


def read_proc_status_bytes(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``VmHWM``, ``VmRSS``) in bytes. Raises ``OSError``
    when the process is gone or the platform has no ``/proc``, ``KeyError`` for an unknown field."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == field:
                number, _, unit = value.strip().partition(" ")
                if unit != "kB":
                    raise ValueError(f"/proc/{pid}/status {field} has unit {unit!r}, expected kB")
                return int(number) * 1024
    raise KeyError(f"/proc/{pid}/status has no {field}")


def read_proc_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process has used (``/proc/PID/stat``), all threads.
    Raises ``OSError`` when the process is gone or the platform has no ``/proc``."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        text = f.read()
    # The command name (field 2) may hold spaces; the fields after its closing parenthesis do not.
    fields = text[text.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


class Child:
    """One child process with its output in ``log_path``."""

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str], cwd: Path,
        *, stdout_path: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.stdout_path = stdout_path
        """Where stdout goes when kept apart from the log (results printed as one line)."""
        with open(log_path, "wb") as log_file, open(stdout_path or os.devnull, "wb") as out:
            self.popen = subprocess.Popen(
                self.argv, stdout=out if stdout_path else log_file, stderr=log_file,
                stdin=subprocess.DEVNULL, env=dict(env), cwd=cwd,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-chars:]

    def failure(self, what: str) -> ChildError:
        return ChildError(f"{self.name} {what}; the end of its log ({self.log_path}):\n{self.log_tail()}")

    def wait(self, timeout: float) -> int:
        """Wait for the child to exit; raises ``ChildError`` (after killing it) past ``timeout``."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise self.failure(f"did not finish within {timeout:.0f}s") from None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``. Idempotent."""
        if self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop in %.0fs; killing it", self.name, self.pid, timeout)
            self.popen.kill()
            self.popen.wait(timeout=timeout)

    def peak_rss_bytes(self) -> int:
        """The child's peak resident memory so far (``VmHWM``). Raises ``OSError`` once it exited."""
        return read_proc_status_bytes(self.pid, "VmHWM")

    def cpu_seconds(self) -> float:
        """CPU seconds the child has used so far. Raises ``OSError`` once it exited."""
        return read_proc_cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        """The child's resident memory now (``VmRSS``). Raises ``OSError`` once it exited."""
        return read_proc_status_bytes(self.pid, "VmRSS")


class Children:
    """Starts children in ``workdir`` and stops every one of them on ``close`` (or leaving a
    ``with`` block), newest first, whatever happened in between."""

    def __init__(self, workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.env = child_env(env)
        self._started: list[Child] = []
        self._count = 0

    def start(self, name: str, argv: Sequence[str], *, separate_stdout: bool = False) -> Child:
        """Start ``argv``; its output goes to a log file in ``workdir`` (stdout to a file of its
        own with ``separate_stdout``)."""
        self._count += 1
        stem = self.workdir / f"{self._count:03d}-{name}"
        child = Child(name, argv, stem.with_suffix(".log"), self.env, cwd=self.workdir,
                      stdout_path=stem.with_suffix(".out") if separate_stdout else None)
        self._started.append(child)
        return child

    def start_module(self, name: str, module: str, *args: str, separate_stdout: bool = False) -> Child:
        """``python -m module args...`` with this interpreter."""
        return self.start(name, [sys.executable, "-m", module, *args], separate_stdout=separate_stdout)

    def launch_server(self, name: str, module: str, *args: str) -> tuple[Child, Path]:
        """Start a server child with ``--port 0 --port-file F``; returns it and ``F``. Several
        servers start faster launched together, then waited for with :meth:`wait_port`."""
        port_file = self.workdir / f"{self._count + 1:03d}-{name}.port"
        child = self.start_module(name, module, *args, "--port", "0", "--port-file", str(port_file))
        return child, port_file

    def start_server(self, name: str, module: str, *args: str, timeout: float = 120.0) -> tuple[Child, int]:
        """:meth:`launch_server`, then :meth:`wait_port`."""
        child, port_file = self.launch_server(name, module, *args)
        return child, self.wait_port(child, port_file, timeout)

    @staticmethod
    def wait_port(child: Child, port_file: Path, timeout: float = 120.0) -> int:
        """Wait until ``child`` wrote its port to ``port_file``. Raises ``ChildError`` if it exits
        first or does not report a port within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            text = port_file.read_text().strip() if port_file.exists() else ""
            if text.isdigit():
                return int(text)
            try:
                # Returns early only if the child exited: a starting process offers no event.
                code = child.popen.wait(timeout=_POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            else:
                raise child.failure(f"exited with status {code} before reporting its port")
            if time.monotonic() > deadline:
                child.stop()
                raise child.failure(f"did not report a port within {timeout:.0f}s")

    def stop(self, child: Child) -> None:
        child.stop()
        self._started.remove(child)

    def close(self) -> None:
        errors = []
        while self._started:
            child = self._started.pop()
            try:
                child.stop()
            except Exception as exc:  # keep stopping the others
                errors.append(f"{child.name}: {exc}")
        if errors:
            log.error("could not stop every child: %s", "; ".join(errors))

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
