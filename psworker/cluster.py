"""``pscluster``: N shards and M workers as separate processes on loopback, for one job.

Shows every process's log lines prefixed with its name, stops everything on Ctrl-C or when any
process fails (exit status 1, or 130 when interrupted), and prints one JSON line at the end: the
workers' totals and the test metrics of the final model held by the shards.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from psworker.config import build_parser

__all__ = ["main"]

log = logging.getLogger("pscluster")


class _Proc:
    """A child process whose output lines are relayed with a prefix; the last line of stdout
    that parses as JSON is kept as its result."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.result: dict | None = None
        self.popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,  # Ctrl-C reaches pscluster only; it stops children in order
        )
        self._threads = [
            threading.Thread(target=self._relay, args=(self.popen.stdout, True), daemon=True),
            threading.Thread(target=self._relay, args=(self.popen.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _relay(self, stream, is_stdout: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if is_stdout and line.startswith("{"):
                try:
                    self.result = json.loads(line)
                    continue
                except json.JSONDecodeError:
                    pass
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

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


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="pscluster",
        description="Run N psserver shards and M psworker workers on this machine for one job. "
        "Flags not listed here are passed to every worker (see psworker --help).",
    )
    parser.add_argument("--shards", type=int, default=2, help="number of shards (default: 2)")
    parser.add_argument("--workers", type=int, default=2, help="number of workers (default: 2)")
    parser.add_argument("--task", default="mnist1d-cnn", help="task to train (default: mnist1d-cnn)")
    parser.add_argument("--host", default="127.0.0.1", help="interface the shards bind (default: 127.0.0.1)")
    parser.add_argument("--start-timeout", type=float, default=120.0,
                        help="seconds for shards to start listening (default: 120)")
    parser.add_argument("--shard-arg", action="append", default=[],
                        help="extra psserver flag, repeatable (e.g. --shard-arg=--threads=8)")
    args, worker_args = parser.parse_known_args(argv)
    if args.shards < 1 or args.workers < 1:
        parser.error("--shards and --workers must be >= 1")
    reserved = {"--ps", "--worker-index", "--num-workers", "--task", "--local"}
    clash = [a for a in worker_args if a.split("=")[0] in reserved]
    if clash:
        parser.error(f"pscluster sets {', '.join(clash)} itself")
    # Validate the worker flags now, not in M failing children.
    worker = build_parser("pscluster (worker flags)").parse_args(
        [*worker_args, "--ps", "127.0.0.1:1", "--task", args.task]
    )
    args.seed = worker.seed or 0  # the final evaluation builds the task with the workers' seed
    return args, worker_args


def _wait_ports(shards: list[_Proc], files: list[Path], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        for proc in shards:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with status {proc.popen.returncode} while starting")
        if all(f.exists() for f in files):
            return [int(f.read_text()) for f in files]
        if time.monotonic() > deadline:
            raise TimeoutError(f"shards did not start listening within {timeout:.0f}s")
        time.sleep(0.1)  # a child process starting up offers no event to wait on


def main(argv: Sequence[str] | None = None) -> int:
    args, worker_args = _parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s pscluster: %(message)s")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    procs: list[_Proc] = []
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    signal.signal(signal.SIGTERM, lambda *_: interrupted.set())
    tmp = tempfile.TemporaryDirectory(prefix="pscluster-")
    started = time.monotonic()
    try:
        files = [Path(tmp.name) / f"shard-{i}.port" for i in range(args.shards)]
        shards = [
            _Proc(f"shard{i}", [sys.executable, "-m", "psserver", "--host", args.host, "--port", "0",
                                "--port-file", str(files[i]), *args.shard_arg], env)
            for i in range(args.shards)
        ]
        procs += shards
        ports = _wait_ports(shards, files, args.start_timeout)
        ps = ",".join(f"{args.host}:{p}" for p in ports)
        log.info("%d shard(s) listening: %s", args.shards, ps)
        workers = [
            _Proc(f"worker{i}", [sys.executable, "-m", "psworker", "--ps", ps, "--task", args.task,
                                 "--worker-index", str(i), "--num-workers", str(args.workers),
                                 "--progress", "log", "--threads", str(threads), *worker_args], env)
            for i in range(args.workers)
        ]
        procs += workers
        while not interrupted.is_set():
            failed = [p for p in procs if p.popen.poll() not in (None, 0)]
            if failed:
                for p in failed:
                    log.error("%s failed with exit status %d; stopping the cluster", p.name, p.popen.returncode)
                return 1
            if all(w.popen.poll() == 0 for w in workers):
                break
            interrupted.wait(timeout=0.2)
        else:
            log.warning("interrupted; stopping the cluster")
            return 130
        seconds = time.monotonic() - started
        for w in workers:
            w.join_output()
        results = [w.result for w in workers]
        if any(r is None for r in results):
            log.error("a worker exited without printing its result")
            return 1
        from psworker.training import evaluate_job  # imports torch: only once training is done

        final = evaluate_job(ps, args.task, seed=args.seed)
        summary = {
            "task": args.task,
            "mode": results[0]["mode"],
            "shards": args.shards,
            "workers": args.workers,
            "steps": sum(r["steps"] for r in results),
            "samples": sum(r["samples"] for r in results),
            "seconds": round(seconds, 3),
            "samples_per_second": round(sum(r["samples"] for r in results) / seconds, 1),
            "final_loss": sum(r["final_loss"] for r in results) / len(results),
            **final,
            "per_worker": results,
        }
        print(json.dumps(summary), flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        log.error("%s", exc)
        return 1
    finally:
        for p in reversed(procs):
            p.stop()
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
