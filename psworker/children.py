"""A cluster's child processes (``pscluster``, ``psworker.ray``): a shard or worker process whose
output is relayed with its name, what to do when one exits, and the record of a restart."""

from __future__ import annotations

import enum
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["METRICS_LINE", "Action", "Child", "ChildProcess", "Recovery", "decide_exit", "exit_reason", "result_line"]

log = logging.getLogger("pscluster")

METRICS_LINE = re.compile(r"\bmetrics on http://(\S+?)/metrics\b")
"""What a shard or worker logs once its metrics endpoint is up (docs/metrics.md); group 1 is
its ``HOST:PORT``."""


def result_line(line: str) -> dict | None:
    """A child's result, when ``line`` of its stdout is one: a JSON object."""
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class ChildProcess:
    """One run of a child process whose output lines are relayed with a prefix; the last line of
    stdout that parses as JSON is kept as its result, and the first line that matches ``ready``
    (with the time it came) as its sign of readiness."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ready: re.Pattern | None = None,
                 on_metrics: Callable[[str], None] | None = None, log_file: Path | None = None) -> None:
        self.name = name
        # Every line, as the child wrote it, also to ``log_file`` (appended: a restart adds to it).
        self._log = open(log_file, "a", buffering=1) if log_file is not None else None
        self.result: dict | None = None
        self.ready = ready
        self.on_metrics = on_metrics
        """Called (from a relay thread) with the ``HOST:PORT`` of the child's metrics endpoint."""
        self.ready_match: re.Match | None = None
        self.ready_at: float | None = None
        self.popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,  # Ctrl-C reaches pscluster only; it stops children in order
        )
        log.info("started %s, pid %d", name, self.popen.pid)
        self._threads = [
            threading.Thread(target=self._relay, args=(self.popen.stdout, True), daemon=True),
            threading.Thread(target=self._relay, args=(self.popen.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _relay(self, stream, is_stdout: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if self._log is not None:
                self._log.write(line + "\n")
            if is_stdout and (result := result_line(line)) is not None:
                self.result = result
                continue
            if self.ready is not None and self.ready_match is None:
                match = self.ready.search(line)
                if match:
                    self.ready_at, self.ready_match = time.monotonic(), match
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            if self.on_metrics is not None and (match := METRICS_LINE.search(line)):
                self.on_metrics(match[1])

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
                self.popen.kill()
                self.popen.wait(timeout=timeout)

    def join_output(self, timeout: float = 10.0) -> None:
        for t in self._threads:
            t.join(timeout=timeout)
        if self._log is not None and not any(t.is_alive() for t in self._threads):
            self._log.close()


class Action(enum.Enum):
    DONE = "done"
    RESTART = "restart"
    FAIL = "fail"


def exit_reason(returncode: int) -> str:
    """``exit status 1``, or ``exit status -9 (killed by SIGKILL)`` for a signal."""
    if returncode < 0:
        try:
            return f"exit status {returncode} (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            return f"exit status {returncode} (killed by signal {-returncode})"
    return f"exit status {returncode}"


def decide_exit(
    role: str, returncode: int, restarts: int, *, restart: bool, max_restarts: int
) -> tuple[Action, str]:
    """What to do about a child that exited while the job runs, and why: a worker that exits 0
    has finished; any other exit of a worker, and any exit of a shard, is a death, answered by
    a restart while ``restart`` is on and the child has had fewer than ``max_restarts``."""
    how = exit_reason(returncode)
    if role == "worker" and returncode == 0:
        return Action.DONE, "finished"
    if not restart:
        return Action.FAIL, how
    if restarts >= max_restarts:
        return Action.FAIL, f"{how} after {restarts} restart(s) (--max-restarts {max_restarts})"
    return Action.RESTART, how


@dataclass
class Recovery:
    """One restart, from the death of a child to its replacement being back at work."""

    process: str
    reason: str
    pid: int
    new_pid: int
    died_at: float
    recovered_seconds: float | None = None
    resumed_at_step: int | None = None

    def record(self) -> dict:
        out = {"process": self.process, "reason": self.reason, "pid": self.pid, "new_pid": self.new_pid,
               "recovered_seconds": self.recovered_seconds}
        if self.resumed_at_step is not None:
            out["resumed_at_step"] = self.resumed_at_step
        return out


@dataclass
class Child:
    """A shard or worker slot of the cluster: its current process and its restart history."""

    name: str
    role: str  # "shard" or "worker"
    index: int
    proc: ChildProcess
    restarts: int = 0
    finished: bool = False
    recovering: Recovery | None = None

