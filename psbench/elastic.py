"""Dynamic data ("elastic workers", ``psworker.elastic``) against the static split, in one run:

* throughput: the training section's smallest MLP (15K parameters, check 3b's case: 2 shards x
  2 async workers), trained by two clusters at once, side by side on the same cores: one whose
  workers have ``--worker-index`` (each its slice, ``worker_steps`` steps), one whose workers
  have none (leasing data tasks of 256 examples from shard 0 for a job of as many steps).
  psbench reads both clusters' steps applied (their shards' pushes) every 0.2 s, and each
  setup's rate is its steps over the same window: from when both passed 10% of their jobs to
  when the first reached 90% (start-ups and ends left out). Run one after the other instead,
  the machine's speed drifted more than the 3% the check asks to see: six back-to-back
  repetitions of the same static run measured 522-665 steps/s (the shards' and workers' CPU per
  step 3.0-3.6 ms), and pairs' ratios spread 0.90-1.25, where side-by-side repetitions spread
  0.95-1.12 (docs/benchmarks.md). Sharing the cores, each setup's rate is set by its cost per
  step (its workers' and shards' CPU, and any stall waiting for data). The cluster started
  second tends to run a little ahead, so the repetitions alternate which starts first.
  Throughput is in steps, not samples: the static split loses about 1.5% of its samples to
  short batches (a 2000-example slice is 31 batches of 64 and one of 16; a 4000-example epoch
  in tasks of 256 has one short batch in 63).
* accuracy: a mnist1d-cnn job (``psbench.config.ElasticJob``: the same examples in every run,
  Adam at a quarter of the task's learning rate, where 4 async workers end calm) trained by
  4 static and by 4 dynamic workers, 5 runs each with seeds 0 to 4 (a run of each setup per
  seed: the same initial weights and epoch orders), the final model's test accuracy evaluated
  on the shards' weights. The workers emulate accelerators (``ElasticJob.compute_ms`` of sleep
  in each training step), so that neither setup's workers fight over the 2 cores: CPU-bound, the
  static split's workers finished up to 1.7 s apart and its job ended in a cool-down, trained
  by fewer and fewer workers, that dynamic data's workers, which finish together, do not get.
  Every run's workers hold step 1 until all of them have joined (``psworker --min-workers``),
  so that both setups train side by side from the first step. Without it the static split's
  start-up skew let its first workers train alone for a while, at lower staleness (the shard's
  histogram: most pushes 1 version stale, against 3 for dynamic data), which was worth about 3
  points of accuracy to the static split (docs/elastic.md). The end and the start are the same
  effect: fewer workers side by side, less stale gradients.
* scaling: the same job trained, CPU-bound, by 4 and by 2 dynamic workers, ``scaling_runs`` of
  each: the job's time from the first worker's first step to the last task's last step (each
  worker's start from its log line ``starts at step 1``, its end from its result line), 4
  workers against 2. On 2 cores two CPU-bound workers already use the machine, so the same job
  is also trained by 4 and by 2 dynamic workers that emulate accelerators (``psworker
  --slowdown``: each step stretched by a sleep to ``ElasticJob.emulated_slowdown`` times its
  length), as the scale section's workers do: what more workers buy when their compute is their
  own.

Every run has shards of its own, started before the clock starts: a job's data queue, once
done, stays done. All processes share this machine's cores.

How long, on 2 cores: 15-17 minutes. The throughput repetitions take about 6 minutes (6 of them,
both clusters at once, about a minute each with start-ups). The 10 accuracy jobs take about 7 (22-26 s
of training each at 30 ms a step). The 6 CPU-bound jobs take about 2 (4-10 s each), and the 4
emulated ones at ``--slowdown`` 2-3 (the 4-worker job at about twice the CPU-bound one's time,
the 2-worker job at four times).
``--quick`` (1 side-by-side repetition of short runs; 2 static and 2 dynamic workers on a 100-step job at 5 ms a
step, then 2 and 1 dynamic workers CPU-bound and emulated): about a minute.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from psbench.config import ElasticJob, TrainingCase
from psbench.procs import Child, ChildError, Children
from psbench.ps import start_shards
from psbench.stats import median, median_ratio
from psbench.training import BATCH_SIZE, cluster_fields, start_worker, worker_result
from psbench.tasks import CNN_DEFAULTS

__all__ = ["CNN_TASK", "ElasticThroughput", "JobRun", "job_seconds", "measure_elastic_jobs",
           "measure_elastic_throughput", "spread", "started_at", "window_cpu", "window_rates"]

log = logging.getLogger(__name__)

CNN_TASK = "psbench.tasks:mnist1d_cnn"
"""psworker's mnist1d-cnn on psbench's cached data."""
_LOG_STARTS = ("--log-level", "INFO")  # for the "starts at step 1" lines; both setups alike
_CNN_FLAGS = ("--threads", "1", "--device", "cpu", "--progress", "none", *_LOG_STARTS)
# psworker.training logs this (at INFO) just before its training loop's clock starts.
_STARTS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ psworker\[\d+\] .* starts at step 1\b", re.M)


def started_at(log_path: Path) -> float:
    """When a worker's training loop started (the Unix time of its ``starts at step 1`` line).
    Raises ``ValueError`` when the log has no such line."""
    found = _STARTS.search(log_path.read_text(errors="replace"))
    if found is None:
        raise ValueError(f"{log_path} has no 'starts at step 1' line")
    return datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def job_seconds(starts: list[float], results: list[dict]) -> float:
    """A job's time from its first worker's first step to its last step: each worker ends its
    last task at its start plus its training loop less its wait at the job's end. A worker that
    trained nothing (it started when every task was taken) is no part of it. Raises
    ``ValueError`` when no worker trained."""
    spans = [(s, s + r["seconds"] - (r.get("data") or {}).get("wait_seconds", 0.0))
             for s, r in zip(starts, results) if r["samples"] > 0]
    if not spans:
        raise ValueError("no worker trained")
    return max(end for _, end in spans) - min(start for start, _ in spans)


def _starts(logs: list[Path]) -> list[float]:
    try:
        return [started_at(path) for path in logs]
    except ValueError as exc:
        raise ChildError(str(exc)) from None


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (None for one value), min and max."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


# -- throughput ----------------------------------------------------------------------------------

WINDOW = (0.1, 0.9)
"""The throughput window: from when both setups have applied this fraction of their jobs' steps
to when the first of them reaches the second (start-ups and the ends left out)."""
POLL_SECONDS = 0.2
"""How often the throughput runs read each setup's shards."""


@dataclass(frozen=True)
class ElasticThroughput:
    """Cluster runs of one model with the static split and with dynamic data side by side, one
    of each per repetition, each setup's steps per second over the window both share."""

    case: TrainingCase
    static_rates: list[float]
    """Per repetition, the static split's steps per second (all its workers) in the window."""
    dynamic_rates: list[float]
    window_seconds: list[float]
    static: list[list[dict]]
    """Per repetition, every static worker's result line."""
    dynamic: list[list[dict]]
    """Per repetition, every dynamic worker's result line."""
    workers: int
    shards: int
    static_cpu: list[float]
    """Per repetition, the static cluster's CPU per step in the window (ms, its shards and workers)."""
    dynamic_cpu: list[float]

    @property
    def ratio(self) -> float:
        """The median over repetitions of the dynamic setup's rate against the static one's,
        measured over the same seconds."""
        return median_ratio(self.dynamic_rates, self.static_rates)

    @property
    def cpu_ratio(self) -> float:
        """The median over repetitions of the dynamic setup's CPU per step against the static one's."""
        return median_ratio(self.dynamic_cpu, self.static_cpu)

    def to_dict(self) -> dict:
        data = [w["data"] for rep in self.dynamic for w in rep]
        return {
            **cluster_fields(self.case, self.shards, self.workers),
            "data_task_size": data[0]["job"]["task_size"],
            "measured": "side by side",
            "window": list(WINDOW),
            "static_steps_per_second": median(self.static_rates),
            "dynamic_steps_per_second": median(self.dynamic_rates),
            "ratio": self.ratio,
            "static_reps": self.static_rates,
            "dynamic_reps": self.dynamic_rates,
            "window_seconds": self.window_seconds,
            "static_cpu_ms_per_step": self.static_cpu,
            "dynamic_cpu_ms_per_step": self.dynamic_cpu,
            "cpu_ratio": self.cpu_ratio,
            # As the workers report them: samples over their whole training loops, which the
            # other setup's workers shared for all but the ends.
            "static_samples_per_second": median([sum(w["samples_per_second"] for w in rep) for rep in self.static]),
            "dynamic_samples_per_second": median([sum(w["samples_per_second"] for w in rep) for rep in self.dynamic]),
            "dynamic_wait_seconds": [[w["data"]["wait_seconds"] for w in rep] for rep in self.dynamic],
            "dynamic_data_tasks": [[w["data"]["tasks"] for w in rep] for rep in self.dynamic],
            "dynamic_data_rides": [[w["data"]["rides"] for w in rep] for rep in self.dynamic],
        }


def window_rates(readings: Sequence[tuple[float, int, int]], job_steps: int) -> tuple[float, float, float]:
    """Two setups' steps per second over the window they share: ``readings`` are ``(time,
    steps applied by the first setup, by the second)``, taken together, in order. The window runs
    from the first reading where both setups are past ``WINDOW[0]`` of ``job_steps`` to the last
    reading (the polling stops once either passes ``WINDOW[1]``). Returns ``(first setup's rate,
    second's, the window's seconds)``. Raises ``ValueError`` when fewer than two readings fall
    in the window (the jobs too short for the polling, or one setup so far behind that the
    other was near its end before it started)."""
    start, end = _window(readings, job_steps)
    seconds = end[0] - start[0]
    return (end[1] - start[1]) / seconds, (end[2] - start[2]) / seconds, seconds


def window_cpu(readings: Sequence[tuple[float, int, int, float, float]], job_steps: int) -> tuple[float, float]:
    """Two setups' CPU per step (ms; shards and workers together) over :func:`window_rates`'s
    window: ``readings`` also hold each setup's CPU seconds so far. Next to the rates it tells a
    cost from the load: CPU per step barely moves with what the other processes do. Raises as
    :func:`window_rates`."""
    start, end = _window(readings, job_steps)
    return tuple(1e3 * (end[3 + i] - start[3 + i]) / max(end[1 + i] - start[1 + i], 1) for i in (0, 1))


def _window(readings: Sequence[tuple], job_steps: int) -> tuple[tuple, tuple]:
    start = next((r for r in readings if min(r[1], r[2]) >= WINDOW[0] * job_steps), None)
    end = readings[-1] if readings else None
    if start is None or end is None or end[0] <= start[0]:
        raise ValueError(f"no window where both setups were between {WINDOW[0]:.0%} and {WINDOW[1]:.0%} of their "
                         f"{job_steps}-step jobs in {len(readings)} readings")
    return start, end


def _steps_applied(admin) -> int:
    # Every step pushes to each shard holding a part of the model, once: the steps applied are
    # the most pushes any shard applied (dynamic data's exchanges are not pushes).
    return max(s.pushes_applied for s in admin.status())


def measure_elastic_throughput(
    children: Children, case: TrainingCase, *, reps: int, shards: int = 2, workers: int = 2, timeout: float = 600.0,
) -> ElasticThroughput:
    """``reps`` repetitions of ``case`` trained by two clusters at once, each of ``shards``
    fresh shards and ``workers`` async workers: one with the static split, one with dynamic
    data. Their workers start interleaved, the first of each pair alternating, and psbench
    reads both clusters' shards every ``POLL_SECONDS``. Each setup's rate is its steps applied
    over the same window (:func:`window_rates`), so that whatever the machine's load does to
    one setup it does to the other: run one after the other, the same static run measured
    522-665 steps/s over six back-to-back repetitions. Raises ``ChildError``."""
    from psworker.admin import AdminClient
    from psworker.options import ClientOptions

    job_steps = workers * case.worker_steps
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    results: dict[bool, list[list[dict]]] = {False: [], True: []}
    windows: list[float] = []
    for rep in range(reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        started: dict[bool, list[tuple[Child, str]]] = {}
        admins: dict = {}
        running: dict[bool, list[Child]] = {False: [], True: []}
        try:
            for dynamic in order:
                started[dynamic] = start_shards(children, shards)
                admins[dynamic] = AdminClient.connected([address for _, address in started[dynamic]],
                                                        ClientOptions(timeout=60.0, connect_timeout=60.0))
            for i in range(workers):
                for dynamic in (order if i % 2 == 0 else order[::-1]):
                    ps = ",".join(address for _, address in started[dynamic])
                    running[dynamic].append(start_worker(children, case, ps, i, workers=workers, run=rep,
                                                         dynamic=dynamic))
            processes = {dynamic: [child for child, _ in started[dynamic]] + running[dynamic] for dynamic in order}
            readings = _poll(admins, running, processes, job_steps, timeout)
            for dynamic in order:
                results[dynamic].append([worker_result(child, timeout) for child in running[dynamic]])
        finally:
            for child in running[False] + running[True]:
                children.stop(child)
            for admin in admins.values():
                admin.close()
            for shards_of_setup in started.values():
                for child, _ in shards_of_setup:
                    children.stop(child)
        try:
            static, dynamic, seconds = window_rates(readings, job_steps)
            static_cpu, dynamic_cpu = window_cpu(readings, job_steps)
        except ValueError as exc:
            raise ChildError(f"mlp{case.width} rep {rep + 1}: {exc}") from None
        rates[False].append(static)
        rates[True].append(dynamic)
        cpu[False].append(static_cpu)
        cpu[True].append(dynamic_cpu)
        windows.append(seconds)
        log.info("mlp%d rep %d, side by side over %.1f s: static %.0f steps/s, dynamic %.0f steps/s; CPU per step "
                 "%.3f / %.3f ms", case.width, rep + 1, seconds, static, dynamic, static_cpu, dynamic_cpu)
    for rep in results[True]:
        examples = sum(w["data"]["examples"] for w in rep)
        if examples != job_steps * BATCH_SIZE:
            raise ChildError(f"the dynamic workers trained {examples} examples of a job of "
                             f"{job_steps * BATCH_SIZE}: {rep}")
    return ElasticThroughput(case, rates[False], rates[True], windows, results[False], results[True], workers, shards,
                             cpu[False], cpu[True])


def _poll(admins: dict, running: dict[bool, list[Child]], processes: dict[bool, list[Child]], job_steps: int,
          timeout: float) -> list[tuple[float, int, int, float, float]]:
    """Read both setups' steps applied, and the CPU seconds of their ``processes``, every
    ``POLL_SECONDS`` until either passes ``WINDOW[1]`` of its job or a worker exits. Raises
    ``ChildError`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    readings: list[tuple[float, int, int, float, float]] = []
    while True:
        before = time.monotonic()
        static, dynamic = _steps_applied(admins[False]), _steps_applied(admins[True])
        try:
            used = [sum(child.cpu_seconds() for child in processes[setup]) for setup in (False, True)]
        except OSError:  # a process exited: its result line (or failure) is read next
            return readings
        readings.append(((before + time.monotonic()) / 2, static, dynamic, *used))
        if max(static, dynamic) >= WINDOW[1] * job_steps:
            return readings
        for child in running[False] + running[True]:
            if child.popen.poll() is not None:
                return readings  # its result line (or failure) is read next
        if time.monotonic() > deadline:
            raise ChildError(f"the side-by-side runs did not reach {WINDOW[1]:.0%} of their jobs within {timeout:.0f}s")
        time.sleep(POLL_SECONDS)


# -- the mnist1d-cnn job: accuracy and scaling -------------------------------------------------------

@dataclass(frozen=True)
class JobRun:
    """One run of the elastic section's job."""

    workers: int
    dynamic: bool
    seed: int
    test_accuracy: float
    """Of the final model, pulled from the shards once every worker finished."""
    seconds: float
    """The job's time: :func:`job_seconds`."""
    wall_seconds: float
    """From starting the workers to the last one's exit: start-ups and the final evaluation in."""
    worker_examples: list[int]

    def to_dict(self) -> dict:
        return {"workers": self.workers, "dynamic": self.dynamic, "seed": self.seed,
                "test_accuracy": self.test_accuracy, "seconds": self.seconds, "wall_seconds": self.wall_seconds,
                "worker_examples": self.worker_examples}


def run_job(children: Children, job: ElasticJob, *, workers: int, dynamic: bool, seed: int,
            timeout: float = 600.0, extra: Sequence[str] = (), compute_ms: float = 0.0) -> JobRun:
    """``job`` trained once by ``workers`` async workers (static split or dynamic data; with
    ``extra`` worker flags; ``compute_ms`` of emulated accelerator compute a step, see
    ``ElasticJob.compute_ms``) on shards of its own; returns its accuracy and times. Raises
    ``ChildError``, or ``pswire.errors.PSError`` from the final evaluation."""
    from psworker.training import evaluate_job  # torch and the task's data: once there is a job

    kind = "dynamic" if dynamic else "static"
    started = start_shards(children, job.shards)
    running: list[Child] = []
    try:
        ps = ",".join(address for _, address in started)
        launched = time.monotonic()
        for i in range(workers):
            place = (("--steps", str(job.steps)) if dynamic else
                     ("--worker-index", str(i), "--num-workers", str(workers), "--steps", str(job.steps // workers)))
            running.append(children.start_module(
                f"cnn-{kind}{workers}-seed{seed}-worker{i}", "psworker", "--ps", ps, "--task", CNN_TASK, *place,
                "--seed", str(seed), "--lr", str(job.lr), "--worker-name", f"{kind}-worker{i}",
                "--min-workers", str(workers), *_CNN_FLAGS, *extra,
                *(("--task-options", f"compute_ms={compute_ms:g}") if compute_ms > 0 else ()),
                separate_stdout=True,
            ))
        results = [worker_result(child, timeout) for child in running]
        wall = time.monotonic() - launched
        starts = _starts([child.log_path for child in running])
        final = evaluate_job(ps, CNN_TASK, seed=seed)
    finally:
        for child in running:
            children.stop(child)
        for child, _ in started:
            children.stop(child)
    trained = sum(r["samples"] for r in results)
    if trained != job.steps * CNN_DEFAULTS.batch_size:
        raise ChildError(f"{workers} {kind} workers trained {trained} examples of a job of "
                         f"{job.steps * CNN_DEFAULTS.batch_size}")
    return JobRun(workers, dynamic, seed, final["test_accuracy"], job_seconds(starts, results), wall,
                  [r["samples"] for r in results])


def measure_elastic_jobs(children: Children, job: ElasticJob, timeout: float = 600.0) -> dict:
    """``job.runs`` runs of ``workers`` static and ``workers`` dynamic workers emulating
    accelerators (``job.compute_ms``; a run of each per seed, the first alternating), for the
    accuracy; ``job.scaling_runs`` CPU-bound runs of ``workers`` and ``fewer`` dynamic ones, and
    ``job.emulated_runs`` of both stretched by ``--slowdown``, for the job's time. Returns the
    ``accuracy``, ``scaling`` and ``emulated`` parts of the section. Raises ``ChildError``."""
    runs: dict[bool, list[JobRun]] = {False: [], True: []}
    for seed in range(job.runs):
        for dynamic in ((False, True) if seed % 2 == 0 else (True, False)):
            run = run_job(children, job, workers=job.workers, dynamic=dynamic, seed=seed, timeout=timeout,
                          compute_ms=job.compute_ms)
            runs[dynamic].append(run)
            log.info("mnist1d-cnn seed %d, %d %s workers at %g ms of emulated compute a step: test accuracy %.3f, "
                     "job %.1fs", seed, job.workers, "dynamic" if dynamic else "static", job.compute_ms,
                     run.test_accuracy, run.seconds)
    more, fewer = _more_and_fewer(children, job, job.scaling_runs, timeout)
    slow = ("--slowdown", f"{job.emulated_slowdown:g}")
    emulated_more, emulated_fewer = _more_and_fewer(children, job, job.emulated_runs, timeout, extra=slow)
    static, dynamic = runs[False], runs[True]
    accuracy = {
        "static": spread([r.test_accuracy for r in static]),
        "dynamic": spread([r.test_accuracy for r in dynamic]),
    }
    accuracy["difference_points"] = 100 * (accuracy["dynamic"]["mean"] - accuracy["static"]["mean"])
    # How far apart two means of this many runs fall by chance alone: from the runs' own spread.
    accuracy["difference_stderr_points"] = (
        100 * math.sqrt((accuracy["dynamic"]["std"] ** 2 + accuracy["static"]["std"] ** 2) / job.runs)
        if job.runs > 1 else None)
    common = {"task": "mnist1d-cnn", "shards": job.shards, "job_steps": job.steps,
              "batch_size": CNN_DEFAULTS.batch_size, "lr": job.lr}
    return {
        "accuracy": {**common, "runs": job.runs, "workers": job.workers, "compute_ms": job.compute_ms, **accuracy,
                     # The same runs' times (emulated compute): a static worker trains its share whatever
                     # the others do, a dynamic one what the queue hands it.
                     "static_seconds": median([r.seconds for r in static]),
                     "dynamic_seconds": median([r.seconds for r in dynamic]),
                     "static_runs": [r.to_dict() for r in static], "dynamic_runs": [r.to_dict() for r in dynamic]},
        "scaling": {**common, "runs": job.scaling_runs, "workers": job.workers, "fewer": job.fewer,
                    **_job_times(more, fewer)},
        **({"emulated": {
            **common, "workers": job.workers, "fewer": job.fewer, "slowdown": job.emulated_slowdown,
            "runs": job.emulated_runs, **_job_times(emulated_more, emulated_fewer),
            "test_accuracy": [r.test_accuracy for r in emulated_more + emulated_fewer],
        }} if job.emulated_runs else {}),
    }


def _more_and_fewer(children: Children, job: ElasticJob, runs: int, timeout: float,
                    extra: Sequence[str] = ()) -> tuple[list[JobRun], list[JobRun]]:
    """``runs`` runs of the job by ``job.workers`` and by ``job.fewer`` dynamic workers (with
    ``extra`` worker flags), a run of each per seed, the first alternating."""
    timed: dict[int, list[JobRun]] = {job.workers: [], job.fewer: []}
    for seed in range(runs):
        for workers in (job.workers, job.fewer) if seed % 2 == 0 else (job.fewer, job.workers):
            run = run_job(children, job, workers=workers, dynamic=True, seed=seed, timeout=timeout, extra=extra)
            timed[workers].append(run)
            log.info("mnist1d-cnn seed %d, %d dynamic workers%s: job %.1fs (%.1fs with start-ups)", seed, workers,
                     f" with {' '.join(extra)}" if extra else "", run.seconds, run.wall_seconds)
    return timed[job.workers], timed[job.fewer]


def _job_times(more: list[JobRun], fewer: list[JobRun]) -> dict:
    """The job's time with more workers against fewer: medians, and the median over seeds of
    each run with more workers against the run with fewer of the same seed."""
    return {
        "seconds": median([r.seconds for r in more]),
        "fewer_seconds": median([r.seconds for r in fewer]),
        "ratio": median_ratio([r.seconds for r in more], [r.seconds for r in fewer]),
        "wall_ratio": median_ratio([r.wall_seconds for r in more], [r.wall_seconds for r in fewer]),
        "more_runs": [r.to_dict() for r in more],
        "fewer_runs": [r.to_dict() for r in fewer],
    }
