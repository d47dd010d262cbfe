"""``pscluster``: N shards and M workers as separate processes on loopback, for one job.

Shows every process's log lines prefixed with its name, stops everything on Ctrl-C or when any
process fails (exit status 1, or 130 when interrupted), and prints one JSON line at the end: the
workers' totals and the test metrics of the final model held by the shards.

With ``--restart`` a process that dies is started again with the same arguments instead, up to
``--max-restarts`` times each: a shard on the port it had, with ``--restore`` (the shards then
write a checkpoint every ``--checkpoint-every``), and a worker under the same name, so that it
re-registers and resumes from the data position the shards recorded for it. A worker that exits
0 has finished and is left alone; a shard that exits at all while the job runs has died.

``--tls`` runs the shards with mutual TLS, with a throwaway CA and certificates made in the run
directory; ``--auth`` makes them check tokens, fresh ones written there too (workers get theirs
through the environment, never on a command line). The two go together or alone.

``--elastic`` starts the workers as identical dynamic-data workers (no ``--worker-index``; named
worker-0, worker-1 ... so that logs and restarts stay readable): they lease the job's data in
data tasks from shard 0 (``psworker.elastic``), so a fast worker trains more of it than a slow
one, and ``--steps``/``--epochs`` are the job's length across all of them. The summary then
adds the job's data queue as shard 0 reports it at the end (``data``); each worker's steps
(``worker_steps``, in every summary) differ.

The run directory (certificates, tokens, port files, checkpoints) is a temporary one, deleted at
exit, unless ``--run-dir DIR`` names one to keep, with every child's output in ``logs/`` and the
summary in ``summary.json``. The summary is printed last, after every child has stopped.

``--metrics`` starts every shard and worker with ``--metrics-port 0`` and logs the address each
one reports (``metrics on http://HOST:PORT/metrics``); ``--metrics-sd-file F`` (which implies
it) keeps F a Prometheus file-based service discovery file listing them (``docs/metrics.md``),
rewritten atomically whenever a child, restarted, reports a new address, and emptied when the
cluster stops.

``--save FILE`` writes the final model it evaluates to FILE as safetensors named by the model's
``state_dict()`` keys (``psworker.export``), before the shards stop.

The command line (the flags, their checks, and what they make of each child's flags) is
``psworker.clusterflags``; this module runs the job.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pswire.security import TOKEN_ENV, ClientSecurity, make_dev_pki, read_token, write_token_files
from psworker.children import Action, Child, ChildProcess, Recovery, decide_exit
from psworker.clusterflags import _identity_flags, _metrics_flags, _parse, _shard_config
from psworker.sdfile import MetricsTargets

if TYPE_CHECKING:
    from pswire.v1 import ps_pb2
    from psworker.client import ClientOptions

__all__ = ["data_summary", "main"]

log = logging.getLogger("pscluster")

# What a worker logs once it has registered (psworker.training): the step it goes on from.
_WORKER_STARTED = re.compile(r"\b(?:starts|resumes) at step (\d+)")


def _task_options(worker_args: Sequence[str]) -> dict[str, str]:
    """The ``--task-options`` passed through to the workers, for the final evaluation's model."""
    from psworker.config import parse_task_options

    value = ""
    for i, arg in enumerate(worker_args):
        if arg == "--task-options" and i + 1 < len(worker_args):
            value = worker_args[i + 1]
        elif arg.startswith("--task-options="):
            value = arg.partition("=")[2]
    return parse_task_options(value)


@dataclass
class _Credentials:
    """What ``--tls`` and ``--auth`` made for one run: flags for the shards and workers, the
    workers' environment additions, and the final evaluation's client credentials."""

    shard_args: list[str]
    worker_args: list[str]
    worker_env: dict[str, str]
    evaluation: ClientSecurity | None
    worker_token_file: Path | None = None
    """With ``--auth``: the worker token's file (workers on other machines read it, with ``--ray``)."""


def _credentials(args: argparse.Namespace, run_dir: Path, hosts: Sequence[str] = ()) -> _Credentials:
    """``hosts``: more names for the shards' certificate (with ``--ray``, the nodes' addresses)."""
    shard_args: list[str] = []
    worker_args: list[str] = []
    worker_env: dict[str, str] = {}
    client: dict[str, str] = {}
    if args.tls:
        pki = make_dev_pki(run_dir / "tls", ["127.0.0.1", "localhost", *([args.host] if args.host else []), *hosts])
        shard_args += pki.shard_flags()
        worker_args += pki.client_flags()
        client = {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}
        log.info("--tls: shards require client certificates signed by the throwaway CA %s", pki.ca)
    if args.auth:
        paths = write_token_files(run_dir)
        shard_args += ["--auth-token-file", str(paths["tokens"])]
        worker_env[TOKEN_ENV] = read_token(str(paths["worker"]))
        client["token"] = read_token(str(paths["reader"]))
        log.info("--auth: shards check tokens from %s; for psctl checkpoint: --token-file %s", paths["tokens"],
                 paths["admin"])
    return _Credentials(shard_args, worker_args, worker_env, ClientSecurity(**client) if client else None,
                        paths["worker"] if args.auth else None)


def _wait_ports(
    shards: list[Child], files: list[Path], timeout: float, interrupted: threading.Event
) -> list[int]:
    deadline = time.monotonic() + timeout
    while not interrupted.is_set():
        for child in shards:
            if child.proc.popen.poll() is not None:
                raise RuntimeError(f"{child.name} exited with status {child.proc.popen.returncode} while starting")
        if all(f.exists() for f in files):
            return [int(f.read_text()) for f in files]
        if time.monotonic() > deadline:
            raise TimeoutError(f"shards did not start listening within {timeout:.0f}s")
        interrupted.wait(timeout=0.1)  # a child process starting up offers no event to wait on
    raise KeyboardInterrupt


class _Cluster:
    """Starts, watches and restarts the children of one run."""

    def __init__(self, args: argparse.Namespace, worker_args: list[str], run_dir: Path) -> None:
        self.args, self.worker_args, self.run_dir = args, worker_args, run_dir
        self.env, shard = _shard_config(args, run_dir)
        self.credentials = _credentials(args, run_dir)
        self.worker_env = dict(self.env, **self.credentials.worker_env)
        self.checkpoint_dir = Path(shard.checkpoint_dir) if shard.checkpoint_dir else None
        self.threads = max(1, (os.cpu_count() or 1) // args.workers)
        self.port_files = [run_dir / f"shard-{i}.port" for i in range(args.shards)]
        self.ports: list[int] = [0] * args.shards
        self.shards: list[Child] = []
        self.workers: list[Child] = []
        self.recoveries: list[Recovery] = []
        self.ps = ""
        self.metrics: MetricsTargets | None = None
        if args.metrics:
            sd_file = Path(args.metrics_sd_file).resolve() if args.metrics_sd_file else None
            self.metrics = MetricsTargets(sd_file, args.shards, args.workers)

    @property
    def children(self) -> list[Child]:
        return self.shards + self.workers

    def _shard_argv(self, i: int, restore: bool) -> list[str]:
        return [sys.executable, "-m", "psserver", "--host", self.args.host, "--port", str(self.ports[i]),
                "--port-file", str(self.port_files[i]), "--shard-index", str(i),
                "--num-shards", str(self.args.shards), *self.credentials.shard_args, *self.args.shard_arg,
                *_metrics_flags(self.args), *(["--restore"] if restore else [])]

    def _worker_argv(self, i: int) -> list[str]:
        return [sys.executable, "-m", "psworker", "--ps", self.ps, "--task", self.args.task,
                *_identity_flags(self.args, i), "--progress", "log", "--threads", str(self.threads),
                *self.credentials.worker_args, *_metrics_flags(self.args), *self.worker_args]

    def _proc(self, role: str, index: int, argv: list[str], env: dict[str, str],
              ready: re.Pattern | None = None) -> ChildProcess:
        name = f"{role}{index}"
        targets = self.metrics
        on_metrics = (lambda address: targets.reported(name, role, index, address)) if targets is not None else None
        logs = self.run_dir / "logs" if self.args.run_dir is not None else None
        if logs is not None:
            logs.mkdir(exist_ok=True)
        return ChildProcess(name, argv, env, ready, on_metrics, logs / f"{name}.log" if logs is not None else None)

    def start(self, interrupted: threading.Event) -> None:
        if self.args.restart:
            log.info("--restart: shards checkpoint to %s; a shard that dies restarts from there",
                     self.checkpoint_dir)
        self.shards = [Child(f"shard{i}", "shard", i, self._proc("shard", i, self._shard_argv(i, False), self.env))
                       for i in range(self.args.shards)]
        self.ports = _wait_ports(self.shards, self.port_files, self.args.start_timeout, interrupted)
        self.ps = ",".join(f"{self.args.host}:{p}" for p in self.ports)
        log.info("%d shard(s) listening: %s", self.args.shards, self.ps)
        self.workers = [
            Child(f"worker{i}", "worker", i,
                   self._proc("worker", i, self._worker_argv(i), self.worker_env, _WORKER_STARTED))
            for i in range(self.args.workers)
        ]

    def _can_restore(self) -> bool:
        # LATEST is the checkpoint store's commit point: it exists once a checkpoint is complete.
        return self.checkpoint_dir is not None and (self.checkpoint_dir / "LATEST").exists()

    def _restart(self, child: Child, reason: str, died_at: float) -> None:
        child.restarts += 1
        old_pid = child.proc.popen.pid
        child.proc.join_output(timeout=2.0)  # the dead process's last lines come first
        if child.role == "shard":
            restore = self._can_restore()
            how = (f"on port {self.ports[child.index]} with --restore from {self.checkpoint_dir}" if restore else
                   f"on port {self.ports[child.index]} EMPTY, as there is no complete checkpoint yet: if the "
                   "job was initialised, its variables are lost, the workers fail on it and, restarted, "
                   "initialise it anew")
            self.port_files[child.index].unlink(missing_ok=True)
            log.warning("%s (pid %d) died: %s; restarting it (restart %d of %d) %s", child.name, old_pid, reason,
                        child.restarts, self.args.max_restarts, how)
            child.proc = self._proc("shard", child.index, self._shard_argv(child.index, restore), self.env)
        else:
            how = ("the data tasks it held went back to the queue, and it leases tasks again" if self.args.elastic
                   else "resumes from the data position the shards recorded")
            log.warning("%s (pid %d) died: %s; restarting it (restart %d of %d) with the same flags: it "
                        "re-registers and %s", child.name, old_pid, reason, child.restarts,
                        self.args.max_restarts, how)
            child.proc = self._proc("worker", child.index, self._worker_argv(child.index), self.worker_env,
                                    _WORKER_STARTED)
        child.recovering = Recovery(child.name, reason, old_pid, child.proc.popen.pid, died_at)
        self.recoveries.append(child.recovering)

    def _check_recovered(self, child: Child, now: float) -> None:
        recovery = child.recovering
        if recovery is None:
            return
        if child.role == "shard":
            if not self.port_files[child.index].exists():
                if now - recovery.died_at > self.args.start_timeout:
                    raise TimeoutError(f"{child.name} did not serve again within {self.args.start_timeout:.0f}s "
                                       "of its restart")
                return
            recovery.recovered_seconds = round(now - recovery.died_at, 3)
            log.warning("%s recovered in %.2fs: serving again on port %d (pid %d)", child.name,
                        recovery.recovered_seconds, self.ports[child.index], recovery.new_pid)
        else:
            match, ready_at = child.proc.ready_match, child.proc.ready_at
            if match is None or ready_at is None:
                return
            recovery.recovered_seconds = round(ready_at - recovery.died_at, 3)
            if self.args.elastic:  # it starts at step 1 of whatever tasks it leases now
                log.warning("%s recovered in %.2fs: re-registered and leases data tasks again (pid %d)",
                            child.name, recovery.recovered_seconds, recovery.new_pid)
            else:
                recovery.resumed_at_step = int(match.group(1))
                log.warning("%s recovered in %.2fs: re-registered and goes on at step %d (pid %d)", child.name,
                            recovery.recovered_seconds, recovery.resumed_at_step, recovery.new_pid)
        child.recovering = None

    def watch(self, interrupted: threading.Event) -> bool:
        """Supervise until every worker has finished (True) or until interrupted (False).
        Raises ``RuntimeError`` when a child dies for good."""
        while not interrupted.is_set():
            now = time.monotonic()
            for child in self.children:
                if child.finished:
                    continue
                self._check_recovered(child, now)
                returncode = child.proc.popen.poll()
                if returncode is None:
                    continue
                action, reason = decide_exit(child.role, returncode, child.restarts,
                                             restart=self.args.restart, max_restarts=self.args.max_restarts)
                if action is Action.DONE:
                    child.finished = True
                elif action is Action.FAIL:
                    raise RuntimeError(f"{child.name} failed with {reason}; stopping the cluster")
                else:
                    self._restart(child, reason, now)
            if all(w.finished for w in self.workers):
                return True
            interrupted.wait(timeout=0.2)
        return False

    def stop(self) -> None:
        for child in reversed(self.children):
            child.proc.stop()
        for child in self.children:  # their last lines (shards' shutdown) are relayed by now
            child.proc.join_output(timeout=5.0)
        if self.metrics is not None:
            self.metrics.clear()


def _queue(ps: str, options: ClientOptions) -> ps_pb2.DataQueueStatus:
    """The job's data queue as shard 0 holds it."""
    from psworker.client import PSClient

    with PSClient(ps, options) as client:
        client.wait_connected()
        return client.status()[0].data


def data_summary(results: Sequence[dict], queue: ps_pb2.DataQueueStatus) -> dict:
    """What the summary says of an ``--elastic`` job's data: the queue's own count, which holds
    every task reported (by workers that died and were restarted, too), beside the sums of the
    workers' result lines, which count each last run of a worker only."""
    data = [r.get("data") or {} for r in results]
    return {
        "mode": "dynamic",
        "job": {"examples": queue.plan.examples, "task_size": queue.plan.task_size, "seed": queue.plan.seed,
                "total": queue.plan.total},
        "finished": queue.finished,
        "examples_done": queue.examples_done,
        "tasks_done": queue.tasks_done,
        "tasks_requeued": queue.tasks_requeued,
        "examples": sum(d.get("examples", 0) for d in data),
        "tasks": sum(d.get("tasks", 0) for d in data),
        "wait_seconds": round(sum(d.get("wait_seconds", 0.0) for d in data), 3),
        "worker_examples": [d.get("examples", 0) for d in data],
    }


def _log_data(data: dict, names: Sequence[str]) -> None:
    shares = ", ".join(f"{name} {n}" for name, n in zip(names, data["worker_examples"]))
    how = log.info if data["finished"] and data["examples_done"] == data["job"]["total"] else log.warning
    how("the job's data: %d of %d examples trained in %d tasks (%s finished); by worker: %s",
        data["examples_done"], data["job"]["total"], data["tasks_done"],
        "queue" if data["finished"] else "queue NOT", shares)


def final_summary(args: argparse.Namespace, worker_args: Sequence[str], ps: str, security: ClientSecurity | None,
                  results: Sequence[dict], seconds: float, restarts: list[dict]) -> dict:
    """The JSON summary of a finished job: the workers' totals, and the test metrics of the final
    model the shards hold (saved to ``--save`` first, when asked). Raises ``RuntimeError`` when
    the model cannot be saved."""
    from psworker.client import ClientOptions
    from psworker.tasks import evaluate
    from psworker.training import pull_task  # imports torch: only once training is done

    options = ClientOptions(security=security)
    task = pull_task(ps, args.task, seed=args.seed, options=options, task_options=_task_options(worker_args))
    final = evaluate(task.model, task)
    if args.save is not None:
        from psworker.embedding import table_client
        from psworker.export import save_model_with_tables

        try:
            save_model_with_tables(task.model, table_client(task.model), args.save,
                                   metadata={"task": args.task, "source": "pscluster"})
        except OSError as exc:
            raise RuntimeError(f"cannot save the model to {args.save}: {exc}") from exc
        log.info("saved the final model to %s", args.save)
    losses = [r["final_loss"] for r in results if r["final_loss"] is not None]
    summary = {
        "task": args.task,
        "mode": results[0]["mode"],
        "shards": args.shards,
        "workers": len(results),
        # The job's steps; each worker's are in worker_steps (with --elastic they differ).
        "steps": sum(r["steps"] for r in results),
        "worker_steps": [r["steps"] for r in results],
        "samples": sum(r["samples"] for r in results),
        "seconds": round(seconds, 3),
        "samples_per_second": round(sum(r["samples"] for r in results) / seconds, 1),
        "final_loss": sum(losses) / len(losses) if losses else None,
        **final,
        **({"data": data_summary(results, _queue(ps, options))} if args.elastic else {}),
        **({"model_file": args.save} if args.save is not None else {}),
        "restarts": restarts,
        "per_worker": results,
    }
    if args.elastic:
        _log_data(summary["data"], [r["worker"] for r in results])
    return summary


def _run_here(args: argparse.Namespace, worker_args: list[str], run_dir: Path,
              interrupted: threading.Event) -> tuple[int, dict | None]:
    """The job on this machine: (exit status, summary once it finished)."""
    cluster = _Cluster(args, worker_args, run_dir)
    started = time.monotonic()
    try:
        cluster.start(interrupted)
        if not cluster.watch(interrupted):
            log.warning("interrupted; stopping the cluster")
            return 130, None
        seconds = time.monotonic() - started
        for w in cluster.workers:
            w.proc.join_output()
        results = [w.proc.result for w in cluster.workers]
        if any(r is None for r in results):
            log.error("a worker exited without printing its result")
            return 1, None
        return 0, final_summary(args, worker_args, cluster.ps, cluster.credentials.evaluation, results, seconds,
                                [r.record() for r in cluster.recoveries])
    except KeyboardInterrupt:
        log.warning("interrupted; stopping the cluster")
        return 130, None
    except (RuntimeError, TimeoutError) as exc:
        log.error("%s", exc)
        return 1, None
    finally:
        cluster.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args, worker_args = _parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s pscluster: %(message)s")
    if args.set_workers is not None:
        from psworker.ray import set_workers_cli

        return set_workers_cli(args)
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    signal.signal(signal.SIGTERM, lambda *_: interrupted.set())
    if args.run_dir is not None:
        run_dir, tmp = Path(args.run_dir).resolve(), None
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / "pscluster.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s pscluster: %(message)s"))
        logging.getLogger().addHandler(handler)
        log.info("run directory %s (kept)", run_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pscluster-")
        run_dir = Path(tmp.name)
    try:
        if args.ray is not None:
            from psworker.ray import run_on_ray

            code, summary = run_on_ray(args, worker_args, run_dir, interrupted)
        else:
            code, summary = _run_here(args, worker_args, run_dir, interrupted)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if code:
        return code
    # Last, once every child has stopped and its last lines are relayed: the summary is the
    # final line on a terminal too.
    line = json.dumps(summary)
    if args.run_dir is not None:
        (run_dir / "summary.json").write_text(line + "\n")
    print(line, flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
