"""Embedding tables on the shards (``psworker.ShardedEmbedding``, ``pswire.tables``), three figures
of one run:

* steps: whether a step's time depends on the rows it touches or on the table's size. The very
  same precomputed batches (``SparseBench.steps`` batches of 256 x 4 Zipf(1.1) ids below 100,000,
  fixed seed, and a gradient for each distinct id) run against a 100K-row and a 10M-row table of
  64 float32 columns with Adagrad, each on 2 shards of its own, both pairs started together. This
  process drives each pair with ``PSClient`` as a worker's step does: a ``pull_rows`` of the
  batch's distinct ids, then a ``push_pull`` of their gradients with a 64-float dense variable
  per shard (a job needs one on each). After a few untimed warm-up steps on each table, the passes over the
  batches alternate between the tables (which goes first alternates too), so drift in the
  machine's load touches both alike; a pass's figure is the median of its steps' times, and
  10M / 100K is the median over repetitions of each pair of passes' ratio. The shards' CPU per
  step and their peak resident memory are recorded beside it: a 10M-row table reserves 4.8 GiB of
  address space (values and Adagrad's sums) and costs memory only for the rows written.
* dlrm: ``dlrm-synth`` with a 1M-row table (``--task-options rows=1000000``, the task's other
  defaults, its examples cut to what the steps cover: each example trained once), trained by
  ``psworker --local --threads 1`` and by 2 async workers (static split, ``--threads 1``) on 2
  shards, a local run then a cluster run per repetition, the cluster on fresh shards each time
  (a job's tables keep what it trained). Throughput from the workers' result lines (their
  training loops; the cluster's is the sum of its workers'), cluster / local the median of the
  pairs' ratios; each run's ``test_auc`` next to the task's ``teacher_auc``.
* rows: the rows the cluster runs pushed and pulled per second of training: the shards' table
  counters (``StatusResponse.tables``) after each run, over the longer of its workers' training
  loops. A worker's final evaluation reads the test split's rows too (``PullRows``, counted
  alike): those rows (batches of ``psworker.tasks.evaluate``'s size, each batch's distinct ids,
  once per worker) are computed here from the task's test split and left out. As bytes (rows x
  dim x 4, pushed plus pulled) beside the dense path's goodput of the same run: the goodput
  section's smallest model on 2 shards, or, when that section did not run, the same measured
  here.
"""

from __future__ import annotations

import inspect
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from psbench.config import SparseBench
from psbench.procs import Child, Children
from psbench.ps import start_shards
from psbench.stats import median, median_ratio
from psbench.training import worker_result
from pswire.optim import OptimizerConfig
from pswire.placement import model_spec
from pswire.tables import TableSpec
from psworker.client import ClientOptions, PSClient

__all__ = ["DLRM_TASK", "DenseReference", "dense_reference", "evaluation_rows", "measure_dlrm", "measure_steps",
           "rows_figures", "zipf_batches"]

log = logging.getLogger(__name__)

DLRM_TASK = "dlrm-synth"
_TABLE = "emb"
_DENSE = "dense"
_OPTIMIZER = OptimizerConfig(name="adagrad", lr=0.01)
_WORKER_FLAGS = ("--threads", "1", "--device", "cpu", "--progress", "none", "--log-level", "WARNING")


def _client(addresses: list[str]) -> PSClient:
    return PSClient.connected(addresses, ClientOptions(timeout=120.0, connect_timeout=120.0))


# -- steps: step time against table size -----------------------------------------------------------

def zipf_batches(bench: SparseBench) -> list[tuple[np.ndarray, np.ndarray]]:
    """``bench.warmup + bench.steps`` batches, each its distinct ids (int64, sorted) and a
    float32 gradient row per id: ``batch x features`` ids with ``P(id) ~ (id + 1) ** -zipf``,
    ``id < id_range``, drawn exactly (inverse CDF) from a generator seeded with ``seed``."""
    rng = np.random.default_rng(bench.seed)
    cdf = np.cumsum(np.arange(1, bench.id_range + 1, dtype=np.float64) ** -bench.zipf)
    out = []
    for _ in range(bench.warmup + bench.steps):
        drawn = np.searchsorted(cdf, rng.random(bench.batch * bench.features) * cdf[-1], side="right")
        ids = np.unique(np.minimum(drawn, bench.id_range - 1).astype(np.int64))
        out.append((ids, (rng.standard_normal((ids.size, bench.dim), dtype=np.float32) * 1e-3)))
    return out


class _TableRig:
    """A registered job of one table of ``rows`` rows (and the dense variable) on its shards."""

    def __init__(self, stack: ExitStack, children: Children, started: list[tuple[Child, str]], rows: int,
                 bench: SparseBench) -> None:
        self.rows = rows
        self.shards = [child for child, _ in started]
        self.client = stack.enter_context(_client([address for _, address in started]))
        # A job needs a dense variable on every shard: one of dim floats each (placement puts
        # variables of equal size one per shard).
        dense = {f"{_DENSE}{i}": torch.zeros(bench.dim) for i in range(len(self.shards))}
        table = TableSpec(name=_TABLE, num_rows=rows, dim=bench.dim, optimizer=_OPTIMIZER)
        self.client.register(model_spec(dense.items()), _OPTIMIZER, worker_name="psbench-sparse",
                             initial_values=dense, tables=[table])
        self.dense_grad = {name: torch.full((bench.dim,), 1e-3) for name in dense}
        self.dense_dest = {name: torch.empty(bench.dim) for name in dense}
        self.step_seconds: list[float] = []
        """Per pass, the median of its steps' seconds."""
        self.shard_cpu: list[float] = []
        """Per pass, the shards' CPU seconds per step."""
        self.client_cpu: list[float] = []
        """Per pass, this process's CPU seconds per step."""

    def step(self, ids: np.ndarray, grads: np.ndarray) -> float:
        started = time.perf_counter()
        self.client.pull_rows({_TABLE: ids})
        self.client.push_pull(self.dense_grad, self.dense_dest, rows={_TABLE: (ids, grads)})
        return time.perf_counter() - started

    def timed_pass(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        shard_cpu = sum(child.cpu_seconds() for child in self.shards)
        client_cpu = time.process_time()
        seconds = [self.step(ids, grads) for ids, grads in batches]
        self.client_cpu.append((time.process_time() - client_cpu) / len(batches))
        self.shard_cpu.append((sum(child.cpu_seconds() for child in self.shards) - shard_cpu) / len(batches))
        self.step_seconds.append(median(seconds))

    def to_dict(self, dim: int, rows_per_step: float) -> dict:
        statuses = self.client.status()
        tables = [t for s in statuses for t in s.tables if t.spec.name == _TABLE]
        step = median(self.step_seconds)
        return {
            "rows": self.rows,
            "step_seconds": step,
            "step_seconds_reps": [round(s, 7) for s in self.step_seconds],
            # Rows pulled and pushed, 4 bytes per value, per second of the median step.
            "row_bytes_per_second": 2 * rows_per_step * dim * 4 / step,
            "shard_cpu_seconds_per_step": median(self.shard_cpu),
            "shard_cpu_seconds_per_step_reps": self.shard_cpu,
            "client_cpu_seconds_per_step": median(self.client_cpu),
            "rows_written": sum(t.rows_written for t in tables),
            "rows_pushed": sum(t.rows_pushed for t in tables),
            "shard_resident_table_bytes": sum(t.bytes_resident for t in tables),
            "shard_peak_rss_bytes": [child.peak_rss_bytes() for child in self.shards],
        }


def measure_steps(children: Children, bench: SparseBench) -> dict:
    """Step time of the same batches against a ``small_rows`` and a ``large_rows`` table
    (module docstring). Raises ``ChildError`` or ``pswire.errors.PSError``."""
    batches = zipf_batches(bench)
    warmup, timed = batches[:bench.warmup], batches[bench.warmup:]
    sizes = (bench.small_rows, bench.large_rows)
    with ExitStack() as stack:
        # Both pairs of shards start together (start-up is no figure's) and stay up together.
        launched = [children.launch_server(f"shard{i}-rows{rows}", "psserver", "--host", "127.0.0.1")
                    for rows in sizes for i in range(bench.shards)]
        for child, _ in launched:
            stack.callback(children.stop, child)
        addresses = [(child, f"127.0.0.1:{children.wait_port(child, port_file)}") for child, port_file in launched]
        rigs = [_TableRig(stack, children, addresses[k * bench.shards:(k + 1) * bench.shards], rows, bench)
                for k, rows in enumerate(sizes)]
        for rig in rigs:
            for ids, grads in warmup:
                rig.step(ids, grads)
        for rep in range(bench.step_reps):
            for rig in (rigs if rep % 2 == 0 else rigs[::-1]):
                rig.timed_pass(timed)
            log.info("sparse steps rep %d: %s", rep + 1,
                     ", ".join(f"{rig.rows:,} rows {rig.step_seconds[-1] * 1e3:.2f} ms" for rig in rigs))
        rows_per_step = sum(ids.size for ids, _ in timed) / len(timed)
        small, large = rigs
        return {
            "dim": bench.dim, "shards": bench.shards, "optimizer": _OPTIMIZER.name, "steps": len(timed),
            "warmup_steps": len(warmup), "batch": bench.batch, "features": bench.features, "zipf": bench.zipf,
            "id_range": bench.id_range, "seed": bench.seed, "reps": bench.step_reps,
            "ids_per_step": bench.batch * bench.features, "rows_per_step": rows_per_step,
            "tables": [rig.to_dict(bench.dim, rows_per_step) for rig in rigs],
            "ratio": median_ratio(large.step_seconds, small.step_seconds),
        }


# -- dlrm: cluster against local; rows: its row traffic --------------------------------------------

def _task_options(bench: SparseBench) -> str:
    """The task's options: its default batch, and the examples one pass of the local run (all
    the workers' steps) covers."""
    from psworker.dlrm import dlrm_synth

    batch = int(inspect.signature(dlrm_synth).parameters["batch"].default)
    return (f"rows={bench.dlrm_rows},examples={bench.dlrm_local_steps * batch},"
            f"test_examples={bench.dlrm_test_examples}")


def evaluation_rows(bench: SparseBench) -> int:
    """The rows one worker's final evaluation of ``dlrm-synth`` pulls: ``psworker.tasks.evaluate``
    runs the test split in batches, and each batch's lookup pulls its distinct ids."""
    from psworker.dlrm import dlrm_synth
    from psworker.tasks import evaluate

    task = dlrm_synth(rows=str(bench.dlrm_rows), examples="1", test_examples=str(bench.dlrm_test_examples))
    batch = inspect.signature(evaluate).parameters["batch_size"].default
    ids = task.test[0][:, task.model.dense_features:].long().numpy()
    return sum(np.unique(ids[start:start + batch]).size for start in range(0, ids.shape[0], batch))


@dataclass(frozen=True)
class _ClusterRun:
    workers: list[dict]
    """Every worker's result line."""
    rows_pushed: int
    rows_pulled: int
    """Rows pulled in all, the workers' final evaluations included."""
    dim: int


def _table_counts(addresses: list[str]) -> tuple[int, int, int]:
    """(rows pushed, rows pulled, dim) summed over the shards' tables."""
    with _client(addresses) as client:
        tables = [t for s in client.status() for t in s.tables]
    return (sum(t.rows_pushed for t in tables), sum(t.rows_pulled for t in tables),
            tables[0].spec.dim if tables else 0)


def _run_local(children: Children, bench: SparseBench, timeout: float) -> dict:
    child = children.start_module(
        "local-dlrm", "psworker", "--local", "--task", DLRM_TASK, "--task-options", _task_options(bench),
        "--steps", str(bench.dlrm_local_steps), *_WORKER_FLAGS, separate_stdout=True)
    try:
        return worker_result(child, timeout)
    finally:
        children.stop(child)


def _run_cluster(children: Children, bench: SparseBench, rep: int, timeout: float) -> _ClusterRun:
    started = start_shards(children, bench.shards)
    running: list[Child] = []
    try:
        addresses = [address for _, address in started]
        before = _table_counts(addresses)
        for i in range(bench.dlrm_workers):
            running.append(children.start_module(
                f"worker{i}-dlrm", "psworker", "--ps", ",".join(addresses), "--task", DLRM_TASK,
                "--task-options", _task_options(bench), "--worker-index", str(i),
                "--num-workers", str(bench.dlrm_workers), "--steps", str(bench.dlrm_worker_steps),
                "--worker-name", f"psbench-sparse-run{rep}-worker{i}", *_WORKER_FLAGS, separate_stdout=True))
        workers = [worker_result(child, timeout) for child in running]
        after = _table_counts(addresses)
        return _ClusterRun(workers, after[0] - before[0], after[1] - before[1], after[2])
    finally:
        for child in running + [child for child, _ in started]:
            children.stop(child)


@dataclass(frozen=True)
class DenseReference:
    """The dense path's push + pull goodput that the rows' bytes are set beside."""

    bytes_per_second: float
    size_mib: int
    shards: int
    source: str
    """``goodput section`` or ``measured here``."""


def dense_reference(goodput: list[dict] | None, shards: int = 2) -> DenseReference | None:
    """The goodput section's smallest model on ``shards`` shards (on the bulk lanes), or None."""
    rows = [g for g in goodput or [] if g["shards"] == shards and g.get("transport", "lanes") == "lanes"]
    if not rows:
        return None
    row = min(rows, key=lambda g: g["size_mib"])
    return DenseReference(row["bytes_per_second"], row["size_mib"], shards, "goodput section")


def measure_dlrm(children: Children, bench: SparseBench, *, timeout: float = 600.0) -> tuple[dict, list[_ClusterRun]]:
    """``dlrm_reps`` pairs of a local run and a cluster run (module docstring); the figures, and
    the cluster runs for :func:`rows_figures`. Raises ``ChildError``."""
    local: list[dict] = []
    cluster: list[_ClusterRun] = []
    for rep in range(bench.dlrm_reps):
        local.append(_run_local(children, bench, timeout))
        cluster.append(_run_cluster(children, bench, rep, timeout))
        log.info("dlrm-synth %d rows, rep %d: local %.0f samples/s, cluster %.0f samples/s", bench.dlrm_rows,
                 rep + 1, local[-1]["samples_per_second"], sum(w["samples_per_second"] for w in cluster[-1].workers))
    local_rates = [r["samples_per_second"] for r in local]
    cluster_rates = [sum(w["samples_per_second"] for w in run.workers) for run in cluster]
    cluster_auc = [[w["test_auc"] for w in run.workers] for run in cluster]
    first = local[0]
    return {
        "task": DLRM_TASK, "task_options": _task_options(bench), "rows": bench.dlrm_rows,
        "batch_size": first["samples"] // first["steps"], "test_examples": bench.dlrm_test_examples,
        "shards": bench.shards, "workers": bench.dlrm_workers, "local_steps": bench.dlrm_local_steps,
        "worker_steps": bench.dlrm_worker_steps,
        "local_samples_per_second": median(local_rates),
        "cluster_samples_per_second": median(cluster_rates),
        "ratio_to_local": median_ratio(cluster_rates, local_rates),
        "local_reps": local_rates,
        "cluster_reps": [[w["samples_per_second"] for w in run.workers] for run in cluster],
        "cluster_worker_seconds": [[w["seconds"] for w in run.workers] for run in cluster],
        "local_test_auc": median([r["test_auc"] for r in local]),
        # Each worker evaluates the shards' model as it finishes: their mean, per run.
        "cluster_test_auc": median([sum(a) / len(a) for a in cluster_auc]),
        "teacher_auc": first["teacher_auc"],
        "teacher_dense_auc": first["teacher_dense_auc"],
        "local_test_auc_reps": [r["test_auc"] for r in local],
        "cluster_test_auc_reps": cluster_auc,
    }, cluster


def rows_figures(bench: SparseBench, runs: list[_ClusterRun], dense: DenseReference | None) -> dict:
    """Rows pushed and pulled per second of the cluster runs' training, and as bytes beside the
    dense path's goodput (module docstring)."""
    evaluation = evaluation_rows(bench) * bench.dlrm_workers
    pushed, pulled, seconds, rates = [], [], [], []
    for run in runs:
        trained = run.rows_pulled - evaluation
        if trained <= 0 or run.rows_pushed <= 0:
            raise RuntimeError(f"the shards counted {run.rows_pushed} rows pushed and {run.rows_pulled} pulled, "
                               f"{evaluation} of them by the evaluations: no training traffic to measure")
        span = max(w["seconds"] for w in run.workers)
        pushed.append(run.rows_pushed)
        pulled.append(trained)
        seconds.append(span)
        rates.append((run.rows_pushed + trained) * run.dim * 4 / span)
    dim = runs[0].dim
    out = {
        "dim": dim,
        "rows_pushed_per_second": median([p / s for p, s in zip(pushed, seconds)]),
        "rows_pulled_per_second": median([p / s for p, s in zip(pulled, seconds)]),
        "bytes_per_second": median(rates),
        "rows_pushed_reps": pushed,
        "rows_pulled_reps": pulled,
        "rows_pulled_by_evaluation": evaluation,
        "training_seconds_reps": seconds,
        "dense_bytes_per_second": dense.bytes_per_second if dense else None,
        "dense_size_mib": dense.size_mib if dense else None,
        "dense_shards": dense.shards if dense else None,
        "dense_source": dense.source if dense else None,
        "ratio_to_dense": median(rates) / dense.bytes_per_second if dense else None,
    }
    log.info("sparse rows: %.0f pushed/s, %.0f pulled/s, %.1f MiB/s (dense %s)", out["rows_pushed_per_second"],
             out["rows_pulled_per_second"], out["bytes_per_second"] / (1 << 20),
             f"{dense.bytes_per_second / (1 << 20):.0f} MiB/s" if dense else "not measured")
    return out
