"""``pscluster``'s command line: its flags and their help, the checks that refuse a bad
combination of them, and what they make of every child's own flags and environment, which
``psworker.cluster`` (the job on this machine) and ``psworker.ray`` (the job on a Ray cluster)
both start their shards and workers with.

Kept apart from the running of a job because it is judged differently: all of it happens before
any process starts, and every mistake, in pscluster's flags or in the worker and shard flags
passed through (read by the workers' and shards' own parsers), must end there as one usage error
(exit status 2) naming it, not as N shards or M workers failing one by one. Nothing here starts,
waits on or stops a process, so a flag is tested without one.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pswire.flags import add_version, values_from
from pswire.security import TOKEN_ENV
from psworker.config import WorkerConfig, build_parser

if TYPE_CHECKING:
    from psserver.config import ServerConfig

__all__ = ["RAY_RUN_MARK"]


# pscluster sets these itself; a second value would split the job.
_RESERVED_WORKER_FLAGS = {"--ps", "--worker-index", "--num-workers", "--task", "--local", "--worker-name"}
# With --elastic the workers have no index: the data queue hands out their data.
_STATIC_SPLIT_FLAGS = {"--worker-index", "--num-workers"}
_RESERVED_SHARD_FLAGS = {"--host", "--port", "--port-file", "--shard-index", "--num-shards", "--restore"}
_TLS_WORKER_FLAGS = {"--tls-ca", "--tls-cert", "--tls-key"}
_TLS_SHARD_FLAGS = {"--tls-cert", "--tls-key", "--tls-client-ca"}
# The marker of a run directory of pscluster --ray (psworker.ray): it may be given again.
RAY_RUN_MARK = ".psgrpc-run-dir"


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="pscluster",
        description="Run N psserver shards and M psworker workers on this machine for one job. "
        "Flags not listed here are passed to every worker (see psworker --help).",
    )
    add_version(parser)
    parser.add_argument("--shards", type=int, default=2, help="number of shards (default: 2)")
    parser.add_argument("--workers", type=int, default=2, help="number of workers (default: 2)")
    parser.add_argument("--task", default="mnist1d-cnn", help="task to train (default: mnist1d-cnn)")
    parser.add_argument("--host", help="interface the shards bind (default: 127.0.0.1; with --ray each shard binds "
                        "its node's address)")
    parser.add_argument("--start-timeout", type=float, default=120.0,
                        help="seconds for a shard to start listening, also after a restart (default: 120)")
    parser.add_argument("--shard-arg", action="append", default=[],
                        help="extra psserver flag, repeatable (e.g. --shard-arg=--threads=8)")
    parser.add_argument("--elastic", action="store_true",
                        help="dynamic data: start the workers as identical workers without --worker-index "
                        "(named worker-0, worker-1 ...), each leasing data tasks (--data-task-size examples, "
                        "default about 256) from the job's data queue on shard 0 until the job's data is done, "
                        "so faster workers train more of it. --steps/--epochs are then the job's length across "
                        "all workers (default: the task's job steps), not each worker's. The summary adds the "
                        "queue's final state (\"data\"); each worker's steps (\"worker_steps\") differ. Without "
                        "it, worker I of M trains a fixed slice for its own --steps, the task's job steps / M "
                        "unless given")
    parser.add_argument("--restart", action="store_true",
                        help="restart a shard or worker that dies (non-zero exit or a signal) instead of "
                        "stopping the cluster: a shard on the same port with --restore from the newest "
                        "complete checkpoint, a worker with the same flags, so it re-registers and resumes "
                        "from its saved data position (with --elastic: the data tasks it held went back to "
                        "the queue, and it leases tasks again). Off by default")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="with --restart, restarts allowed per shard or worker (default: 3)")
    parser.add_argument("--checkpoint-every", default="5s",
                        help="with --restart, how often shards checkpoint (30s: seconds, 500: steps), unless "
                        "--shard-arg sets it; checkpoints go to a fresh directory under the run directory "
                        "unless --shard-arg sets --checkpoint-dir (default: 5s)")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS: make a throwaway CA, a server certificate (names 127.0.0.1, localhost "
                        "and --host) and a client certificate in the run directory; the shards require the client "
                        "certificate, which every worker and the final evaluation present")
    parser.add_argument("--metrics", action="store_true",
                        help="start every shard and worker with --metrics-port 0 (Prometheus metrics, "
                        "docs/metrics.md) and log the address each one serves them on")
    parser.add_argument("--metrics-sd-file", metavar="FILE",
                        help="write FILE, a Prometheus file-based service discovery file listing every shard's "
                        "(job psserver) and worker's (job psworker) metrics address, rewritten atomically when a "
                        "restarted child serves on a new port and emptied when the cluster stops; implies --metrics")
    parser.add_argument("--run-dir", metavar="DIR",
                        help="keep the run directory in DIR (created; it must be new or empty) instead of a "
                        "temporary one deleted at exit: every child's output in logs/NAME.log (restarts appended), "
                        "pscluster's own log in pscluster.log, the summary in summary.json, checkpoints (with "
                        "--restart) in checkpoints/, and the --tls certificates and --auth tokens. With --ray, the run directory "
                        "of an earlier --ray job may be given again: the job goes on from its checkpoints")
    parser.add_argument("--save", metavar="FILE",
                        help="after the run, write the final model the summary evaluates (the shards' weights, "
                        "with the task's fresh buffers) to FILE as safetensors named by the model's state_dict() "
                        "keys, atomically; the summary names it (\"model_file\")")
    parser.add_argument("--auth", action="store_true",
                        help="tokens: write fresh worker, reader and admin tokens to a token file in the run "
                        f"directory (mode 600) for the shards; workers get the worker token through {TOKEN_ENV}, "
                        "the final evaluation uses the reader token, and the admin token's file is logged for "
                        "psctl --token-file")
    ray = parser.add_argument_group("Ray (docs/ray.md; needs the ray extra: pip install 'psgrpc[ray]')")
    ray.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                     help="run the shards and workers as actors on a Ray cluster instead of on this machine: "
                     "ADDRESS of its head (as for ray start --address; a bare --ray connects to the cluster this "
                     "machine belongs to, or starts one here). Shards are spread over nodes by a placement group "
                     "and bind their node's address; Ray restarts a shard that dies and it restores from "
                     "--run-dir's checkpoints; workers are --elastic ones, so they can come and go. --run-dir "
                     "must then be a path every node sees")
    ray.add_argument("--job-name", default="psgrpc",
                     help="with --ray, the job's name on the Ray cluster, for --set-workers (default: psgrpc)")
    ray.add_argument("--set-workers", type=int, metavar="N",
                     help="with --ray ADDRESS: tell the running job --job-name to scale to N workers (new ones "
                     "join and lease data; removed ones hand back what they hold and exit), then exit")
    ray.add_argument("--shard-cpus", type=float, default=1.0, help="with --ray, CPUs reserved per shard (default: 1)")
    ray.add_argument("--worker-cpus", type=float, default=1.0,
                     help="with --ray, CPUs reserved per worker, also its torch threads (default: 1)")
    ray.add_argument("--shard-resources", type=_resources, default={}, metavar="JSON",
                     help='with --ray, custom Ray resources each shard needs, e.g. \'{"ps_node": 1}\'')
    ray.add_argument("--worker-resources", type=_resources, default={}, metavar="JSON",
                     help="with --ray, custom Ray resources each worker needs")
    args, worker_args = parser.parse_known_args(argv)
    if args.ray is None and (args.set_workers is not None or args.shard_resources or args.worker_resources):
        parser.error("--set-workers, --shard-resources and --worker-resources are for --ray")
    if args.ray is not None:
        if args.host is not None:
            parser.error("--ray: each shard binds its node's address; leave out --host")
        if args.set_workers is not None:
            if args.set_workers < 0:
                parser.error("--set-workers must be >= 0")
            return args, worker_args
        if args.shard_cpus <= 0 or args.worker_cpus <= 0:
            parser.error("--shard-cpus and --worker-cpus must be > 0")
        # Ray's workers are identical ones that come and go, and Ray restarts what dies.
        args.elastic = args.restart = True
    if args.ray is None:
        args.host = args.host or "127.0.0.1"
    args.metrics = args.metrics or args.metrics_sd_file is not None
    if args.save is not None and (os.path.isdir(args.save) or not Path(args.save).resolve().parent.is_dir()):
        parser.error(f"--save {args.save}: give a file in an existing directory")
    # A Ray job's run directory may be given again: the job goes on from its checkpoints.
    again = args.ray is not None and args.run_dir is not None and (Path(args.run_dir) / RAY_RUN_MARK).is_file()
    if args.run_dir is not None and Path(args.run_dir).exists() and not again and (
            not Path(args.run_dir).is_dir() or any(Path(args.run_dir).iterdir())):
        parser.error(f"--run-dir {args.run_dir}: give a new or empty directory (a run's files must not mix "
                     "with another's)")
    if args.metrics_sd_file is not None and not Path(args.metrics_sd_file).resolve().parent.is_dir():
        parser.error(f"--metrics-sd-file {args.metrics_sd_file}: its directory does not exist")
    if args.shards < 1 or args.workers < 1:
        parser.error("--shards and --workers must be >= 1")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    from psserver.checkpointer import parse_schedule

    try:
        parse_schedule(args.checkpoint_every)
    except ValueError as exc:
        parser.error(str(exc))
    metrics_reserved = {"--metrics-port"} if args.metrics else set()
    worker_reserved = _RESERVED_WORKER_FLAGS | (_TLS_WORKER_FLAGS if args.tls else set()) | (
        {"--token-file"} if args.auth else set()) | metrics_reserved
    shard_reserved = _RESERVED_SHARD_FLAGS | (_TLS_SHARD_FLAGS if args.tls else set()) | (
        {"--auth-token-file"} if args.auth else set()) | metrics_reserved
    if args.elastic and (split := [a for a in worker_args if a.split("=")[0] in _STATIC_SPLIT_FLAGS]):
        parser.error(f"--elastic workers have no static split: leave out {', '.join(split)}")
    clash = [a for a in worker_args if a.split("=")[0] in worker_reserved]
    clash += [a for a in args.shard_arg if a.split("=")[0] in shard_reserved]
    if clash:
        parser.error(f"pscluster sets {', '.join(clash)} itself")
    # Validate the worker and shard flags now, as the first worker will read them (its
    # identity included: --data-task-size is for --elastic only), not in M or N failing children.
    worker_parser = build_parser("pscluster (worker flags)")
    worker = values_from(WorkerConfig, worker_parser, worker_parser.parse_args(
        [*worker_args, "--ps", "127.0.0.1:1", "--task", args.task, *_identity_flags(args, 0), *_metrics_flags(args)]
    ), os.environ, "PSWORKER")
    args.seed = worker.seed  # the final evaluation builds the task with the workers' seed
    args.device = worker.device  # with --ray, what the workers ask Ray for
    _shard_config(args, Path("<run directory>"))
    return args, worker_args


def _resources(text: str) -> dict[str, float]:
    """``--shard-resources``/``--worker-resources``: a JSON object of resource name to amount."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in value.items()):
        raise argparse.ArgumentTypeError('give an object of resource names to positive amounts, e.g. {"ps_node": 1}')
    return {k: float(v) for k, v in value.items()}


def _shard_config(args: argparse.Namespace, run_dir: Path) -> tuple[dict[str, str], ServerConfig]:
    """The environment of the shards and the settings they will run with, validated by the
    shard's own parser (exits with a usage error naming the problem). ``--restart`` supplies
    checkpoint defaults as ``PSSERVER_*`` variables, so that ``--shard-arg`` flags and the
    user's own variables win over them."""
    from psserver.config import parse_args as parse_shard_args

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.restart:
        env.setdefault("PSSERVER_CHECKPOINT_DIR", str(run_dir / "checkpoints"))
        env.setdefault("PSSERVER_CHECKPOINT_EVERY", args.checkpoint_every)
    return env, parse_shard_args([*args.shard_arg, *_metrics_flags(args)], env)


def _identity_flags(args: argparse.Namespace, i: int) -> list[str]:
    """Worker ``i``'s place in the job: a slice of a static split, or with ``--elastic`` only a
    name (a dynamic worker's default, <host>-<pid>, would change with every restart)."""
    if args.elastic:
        return ["--worker-name", f"worker-{i}"]
    return ["--worker-index", str(i), "--num-workers", str(args.workers)]


def _metrics_flags(args: argparse.Namespace) -> list[str]:
    """What every child gets with ``--metrics``: a free port, reported in its log."""
    return ["--metrics-port", "0"] if args.metrics else []
