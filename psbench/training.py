"""Training throughput: the benchmark MLPs (``psbench.tasks``) trained by real ``psworker``
processes, locally (``--local``, one process, no server: the baseline) and as a cluster of
2 shards and 2 async workers on loopback.

Throughputs come from each worker's own result line, which times its training loop only
(after start-up, connection, registration and the first pull; before the final evaluation).
A cluster's throughput is the sum of its workers'. All processes share this machine's cores,
as they would on a real host running shards next to trainers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from psbench.config import TrainingCase
from psbench.procs import Child, Children
from psbench.ps import start_shards
from psbench.stats import median

__all__ = ["TrainingResult", "measure_training", "run_cluster", "run_local", "start_worker", "worker_result"]

log = logging.getLogger(__name__)

BATCH_SIZE = 64


def cluster_fields(case: TrainingCase, shards: int, workers: int) -> dict:
    """What a paired cluster comparison's JSON says of its runs (psbench's elastic, metrics and
    tls sections): the model, the batch, the cluster and each worker's steps."""
    return {"task": case.task, "width": case.width, "parameters": case.parameters, "batch_size": BATCH_SIZE,
            "shards": shards, "workers": workers, "worker_steps": case.worker_steps}
_COMMON = ("--threads", "1", "--device", "cpu", "--batch-size", str(BATCH_SIZE), "--optimizer", "sgd",
           "--lr", "0.05", "--progress", "none", "--log-level", "WARNING")


@dataclass(frozen=True)
class TrainingResult:
    case: TrainingCase
    parameters: int
    local: list[dict]
    """One result line per local repetition."""
    cluster: list[list[dict]]
    """Per cluster repetition, every worker's result line."""
    workers: int
    shards: int

    @property
    def local_samples_per_second(self) -> float:
        return median([r["samples_per_second"] for r in self.local])

    @property
    def cluster_samples_per_second(self) -> float:
        return median(self._cluster_reps())

    @property
    def ratio_to_local(self) -> float:
        """The median over repetitions of cluster / local, each cluster run against the local
        run just before it: the pair saw about the same load from other processes."""
        return median([c / r["samples_per_second"] for c, r in zip(self._cluster_reps(), self.local)])

    def _cluster_reps(self) -> list[float]:
        return [sum(w["samples_per_second"] for w in rep) for rep in self.cluster]

    def to_dict(self) -> dict:
        local, cluster = self.local_samples_per_second, self.cluster_samples_per_second
        return {
            "task": self.case.task,
            "width": self.case.width,
            "wire_dtype": self.case.wire_dtype,
            "parameters": self.parameters,
            "batch_size": BATCH_SIZE,
            "shards": self.shards,
            "workers": self.workers,
            "local_steps": self.case.local_steps,
            "worker_steps": self.case.worker_steps,
            "local_samples_per_second": local,
            "cluster_samples_per_second": cluster,
            "ratio_to_local": self.ratio_to_local,
            "local_reps": [r["samples_per_second"] for r in self.local],
            "cluster_reps": [[w["samples_per_second"] for w in rep] for rep in self.cluster],
            "cluster_worker_seconds": [[w["seconds"] for w in rep] for rep in self.cluster],
        }


def worker_result(child: Child, timeout: float) -> dict:
    """The worker's one-line JSON result; raises ``ChildError`` if it failed or printed none."""
    code = child.wait(timeout)
    if code != 0:
        raise child.failure(f"exited with status {code}")
    if child.stdout_path is None:
        raise ValueError(f"{child.name} was started without separate_stdout: its result line is in its log")
    lines = [line for line in child.stdout_path.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise child.failure("printed no result line")
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise child.failure(f"printed a result line that is not JSON ({exc})") from None
    # A dynamic-data worker that started last may find every task of a short job taken.
    if not result.get("samples_per_second", 0) > 0 and "data" not in result:
        raise child.failure(f"reported no throughput: {lines[-1][:300]}")
    return result


def run_local(children: Children, case: TrainingCase, *, timeout: float) -> dict:
    """One ``psworker --local`` run; returns its result line. Raises ``ChildError``."""
    child = children.start_module(
        f"local-mlp{case.width}", "psworker", "--local", "--task", case.task, "--steps", str(case.local_steps),
        *_COMMON, separate_stdout=True,
    )
    try:
        return worker_result(child, timeout)
    finally:
        children.stop(child)


def start_worker(
    children: Children, case: TrainingCase, ps: str, index: int, *, workers: int, run: int = 0,
    extra: Sequence[str] = (), dynamic: bool = False,
) -> Child:
    """Start worker ``index`` of ``workers`` async workers of ``case`` against the shards at
    ``ps``, with ``extra`` flags (``--tls-ca ...``): ``case.worker_steps`` steps of its slice of a
    static split, or with ``dynamic`` no index, leasing the job's data (``psworker.elastic``) from
    shard 0 until the job, ``workers * case.worker_steps`` steps long, is done: the same examples
    in all. A job's data queue, once done, stays done: dynamic runs need shards of their own.

    Worker names carry ``run``: a worker joining under a name the shards know resumes that
    worker's recorded progress, and one that had finished would have no steps left to time."""
    place = (("--steps", str(case.worker_steps * workers)) if dynamic else
             ("--worker-index", str(index), "--num-workers", str(workers), "--steps", str(case.worker_steps)))
    return children.start_module(
        f"worker{index}-mlp{case.width}{'-dynamic' if dynamic else ''}", "psworker", "--ps", ps,
        "--task", case.task, *place,
        "--worker-name", f"psbench-run{run}-{case.wire_dtype}-worker{index}", "--wire-dtype", case.wire_dtype,
        *_COMMON, *extra, separate_stdout=True,
    )


def run_cluster(
    children: Children, case: TrainingCase, ps: str, *, workers: int, timeout: float, run: int = 0,
    extra: Sequence[str] = (), started: Callable[[Child], None] | None = None, dynamic: bool = False,
) -> list[dict]:
    """``workers`` async workers (:func:`start_worker`) started together against the shards at
    ``ps``; ``started`` is told of each worker as it starts. Returns every worker's result line.
    Raises ``ChildError`` when a worker fails or runs past ``timeout``."""
    running: list[Child] = []
    try:
        for i in range(workers):
            running.append(start_worker(children, case, ps, i, workers=workers, run=run, extra=extra,
                                        dynamic=dynamic))
            if started is not None:
                started(running[-1])
        return [worker_result(child, timeout) for child in running]
    finally:
        for child in running:
            children.stop(child)


def measure_training(
    children: Children, case: TrainingCase, *, reps: int, shards: int = 2, workers: int = 2, timeout: float = 600.0
) -> TrainingResult:
    """``reps`` local runs and ``reps`` cluster runs of ``case``, alternated so that a change in
    the machine's load during the run touches both alike. The cluster runs share one set of
    shards (each run's workers join the job again, as restarted workers do): starting shards
    is start-up cost that no figure includes. Raises ``ChildError``."""
    local, cluster = [], []
    started = start_shards(children, shards)
    try:
        ps = ",".join(address for _, address in started)
        for rep in range(reps):
            local.append(run_local(children, case, timeout=timeout))
            cluster.append(run_cluster(children, case, ps, workers=workers, timeout=timeout, run=rep))
            log.info("mlp%d rep %d: local %.0f samples/s, cluster %.0f samples/s", case.width, rep + 1,
                     local[-1]["samples_per_second"], sum(w["samples_per_second"] for w in cluster[-1]))
    finally:
        for child, _ in started:
            children.stop(child)
    return TrainingResult(case, case.parameters, local, cluster, workers, shards)
