"""psbench configuration: one frozen dataclass, built once in ``main()`` from flags, then
``PSBENCH_*`` environment variables, then defaults (flags win). Only this module reads ``argv``
and the environment. :meth:`BenchConfig.plan` turns it into the exact work of a run.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from pswire.flags import add_fields, add_version, parse

__all__ = ["SECTIONS", "BenchConfig", "ElasticJob", "Plan", "ScaleBench", "SparseBench", "TrainingCase", "parse_args",
           "training_case"]

SECTIONS = ("baselines", "goodput", "latency", "training", "memory", "tls", "metrics", "elastic", "sparse", "scale")
"""Every section, in the order they run."""

_NEEDS_BASELINES = ("goodput", "latency")

METRICS_RUN_FACTOR = 1.5
"""How many times a training run's worker steps the metrics section's runs take (6 s instead of
4): scraped once a second, a run must last several seconds for the scrapes to weigh as they
would. The elastic section's throughput runs take as many, so that the window both of its
side-by-side clusters train in (10% to 90% of their jobs) lasts some 35 seconds."""


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"{what} must be distinct integers >= 1, got {text!r}")
    return values


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    out: str = _f("psbench.json", "JSON file the results are written to.")
    quick: bool = _f(False, "Tiny sizes, few repetitions, one small model: a smoke run of every section "
                     "in about a minute.")
    only: str = _f("", "Run only these sections, comma-separated, of: " + ", ".join(SECTIONS)
                   + ". goodput and latency bring baselines along (their ratios need it).")
    reps: int | None = _f(None, "Timed repetitions of each figure after its warm-up (default: 20 for transfers, "
                          "after 3 rounds of warm-up; 5 for metrics' and elastic's throughput pairs, sparse's step "
                          "passes and elastic's mnist1d-cnn jobs, 3 for training, for sparse's dlrm-synth pairs and "
                          "for scale's passes over the worker counts; --quick: 2 for transfers, else 1).")
    sizes: str = _f("", "Model sizes in MiB for goodput, comma-separated (default: 4,64,256; --quick: 1,4). "
                    "tls measures the one nearest 64.")
    widths: str = _f("", "Hidden widths of the training MLPs, comma-separated (default: 100,1024,2048; --quick: 100). "
                     "tls trains the widest; metrics the narrowest and the widest; elastic the narrowest.")
    latency_calls: int | None = _f(None, "Timed calls per latency figure (default: 1000; --quick: 100).")
    keep_logs: str | None = _f(None, "Keep every child process's log in this directory (default: a temporary "
                               "one, removed).")
    log_level: str = _f("INFO", "Logging level of psbench's progress lines (stderr).")

    def __post_init__(self) -> None:
        unknown = set(self.sections_asked()) - set(SECTIONS)
        if unknown:
            raise ValueError(f"--only: unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
        if self.reps is not None and self.reps < 1:
            raise ValueError(f"--reps must be >= 1, got {self.reps}")
        if self.latency_calls is not None and self.latency_calls < 10:
            raise ValueError(f"--latency-calls must be >= 10, got {self.latency_calls}")
        if self.sizes:
            _ints(self.sizes, "--sizes")
        if self.widths:
            _ints(self.widths, "--widths")
        if not self.out:
            raise ValueError("--out must name a file")

    def sections_asked(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.only.split(",") if s.strip())

    def plan(self) -> "Plan":
        """The work of this run, with every default resolved."""
        asked = self.sections_asked() or SECTIONS
        wanted = set(asked) | ({"baselines"} if set(asked) & set(_NEEDS_BASELINES) else set())
        quick = self.quick
        widths = _ints(self.widths, "--widths") if self.widths else ((100,) if quick else (100, 1024, 2048))
        sizes = tuple(sorted(_ints(self.sizes, "--sizes") if self.sizes else ((1, 4) if quick else (4, 64, 256))))
        narrowest = training_case(min(widths), quick=quick)
        elastic_job = QUICK_ELASTIC_JOB if quick else ELASTIC_JOB
        return Plan(
            sections=tuple(s for s in SECTIONS if s in wanted),
            quick=quick,
            sizes_mib=sizes,
            shard_counts=(1, 2),
            # 20 rounds after 3: fresh lanes run their first rounds about 10% slower (their
            # sockets' buffers grow) than the TCP connection they are paired with, warm all run,
            # and the ratio of medians of 5 rounds spread 0.05 between runs (docs/benchmarks.md).
            transfer_reps=self.reps or (2 if quick else 20),
            transfer_warmup=1 if quick else 3,
            training_reps=self.reps or (1 if quick else 3),
            baseline_bytes=(16 if quick else 256) << 20,
            latency_calls=self.latency_calls or (100 if quick else 1000),
            latency_warmup=20 if quick else 100,
            small_bytes=4096,
            # The widest model once more with bf16 on the wire: where compression pays most.
            training=tuple(training_case(w, quick=quick) for w in sorted(widths))
            + (training_case(max(widths), quick=quick, wire_dtype="bf16"),),
            # The cost of TLS on the figures its criterion names: 64 MiB goodput, the widest MLP.
            tls_size_mib=min(sizes, key=lambda s: (abs(s - 64), s)),
            tls_training=training_case(max(widths), quick=quick),
            # The cost of metrics on the smallest model (calls dominate) and the largest (bytes do).
            metrics_training=tuple(
                replace(case, worker_steps=round(case.worker_steps * (1 if quick else METRICS_RUN_FACTOR)))
                for case in (training_case(w, quick=quick) for w in sorted({min(widths), max(widths)}))
            ),
            metrics_reps=self.reps or (1 if quick else 5),
            # Dynamic data against the static split on the smallest model (calls dominate: the
            # data exchanges weigh most), and the elastic job.
            elastic_training=replace(narrowest,
                                     worker_steps=round(narrowest.worker_steps * (1 if quick else METRICS_RUN_FACTOR))),
            # 10 repetitions: one side-by-side repetition's ratio spreads about 4% (the cluster
            # started second is often ahead; the order alternates), so 6 left the median's
            # standard error near 2%, of the 3% check 8 is about.
            elastic_reps=self.reps or (1 if quick else 10),
            elastic_job=replace(elastic_job, runs=self.reps or elastic_job.runs),
            sparse=replace(QUICK_SPARSE if quick else SPARSE, step_reps=self.reps or (1 if quick else 5),
                           dlrm_reps=self.reps or (1 if quick else 3)),
            scale=replace(QUICK_SCALE if quick else SCALE, reps=self.reps or (1 if quick else SCALE.reps)),
        )


@dataclass(frozen=True, kw_only=True)
class TrainingCase:
    """One model to train, with step counts that make each timed loop last a few seconds."""

    width: int
    """Hidden width W of the ``40 -> W -> W -> 10`` MLP (``psbench.tasks:mlpW``)."""
    local_steps: int
    """Steps of the local run."""
    worker_steps: int
    """Steps of each cluster worker."""
    wire_dtype: str = "none"
    """The workers' ``--wire-dtype``: ``bf16`` measures 16-bit wire compression."""

    def __post_init__(self) -> None:
        if self.local_steps < 1 or self.worker_steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.local_steps} and {self.worker_steps}")

    @property
    def parameters(self) -> int:
        w = self.width
        return 40 * w + w + w * w + w + w * 10 + 10

    @property
    def task(self) -> str:
        return f"psbench.tasks:mlp{self.width}"


# Step counts aim for a timed loop of a few seconds. Seconds per step grow with the parameter
# count: measured on a 2-core EPYC (2026-11-25, the three MLPs), about 0.2 ms + 5 ns/parameter
# locally and 0.9 ms + 10 ns/parameter per cluster worker (2 shards x 2 workers sharing the
# cores). The estimates before (0.75 ms + 8.5 ns and 15 ms + 40 ns) dated from before the bulk
# lanes and made the 15K MLP's timed loops last 0.6 s locally and 0.35 s in the cluster, where
# start-up effects weigh.
def training_case(width: int, *, quick: bool = False, wire_dtype: str = "none") -> TrainingCase:
    """The case for an MLP of hidden ``width`` with step counts sized to its cost."""
    parameters = TrainingCase(width=width, local_steps=1, worker_steps=1).parameters
    local_seconds, worker_seconds = (0.5, 1.0) if quick else (2.5, 4.0)
    return TrainingCase(
        width=width,
        local_steps=max(20, round(local_seconds / (0.2e-3 + 5e-9 * parameters))),
        worker_steps=max(10 if quick else 20, round(worker_seconds / (0.9e-3 + 10e-9 * parameters))),
        wire_dtype=wire_dtype,
    )


@dataclass(frozen=True, kw_only=True)
class ElasticJob:
    """The elastic section's mnist1d-cnn job (``psbench.tasks:mnist1d_cnn``, batch 100, Adam at
    ``lr``): trained ``runs`` times each by ``workers`` static workers, by ``workers`` dynamic
    ones and by ``fewer`` dynamic ones, on ``shards`` shards."""

    steps: int
    """The job's length in steps across all its workers (a multiple of ``workers``: each static
    worker trains ``steps / workers``)."""
    workers: int
    fewer: int
    runs: int
    shards: int = 1
    """The CNN has 5K parameters: one shard holds it, and leaves the workers more of the cores."""
    lr: float = 2.5e-3
    """A quarter of the task's 1e-2. At 1e-2, 4 async CPU-bound workers on 2 cores ended
    anywhere from 0.93 down to 0.58 with either split, and one run of about 25 never learned
    (accuracy 0.09: all ReLUs dead). At 5e-3 a job's last second still swung the test accuracy
    by 5-25 points from one evaluation to the next (0.656 to 0.915 within a second), so the
    final figure was one draw from that swing: 0.787-0.928 in 10 runs at 30 ms of emulated
    compute. At 2.5e-3 the same 10 runs ended at 0.871-0.911: a standard deviation of 1.5 points
    per setup, against 2.2 (static) and 5.6 (dynamic) at 5e-3. The job stops short of the band
    the CNN settles in (0.91-0.93), which both setups share (2026-11-27, docs/benchmarks.md)."""
    compute_ms: float = 30.0
    """The accuracy runs' workers emulate accelerators: each training step's forward pass also
    sleeps this long (``psbench.tasks.mnist1d_cnn``'s ``compute_ms``), compute the 2 cores do not
    share, as on a cluster of accelerator workers. CPU-bound, 4 workers on 2 cores run at unequal
    speeds, and the static split's workers finished 0.3-1.7 s apart in a 9 s job: its last tenth
    was trained by fewer workers at lower staleness, a cool-down worth about 2 points to it (4
    runs: 0.909 when its first worker finished, 0.928 at the end), which dynamic data, whose
    workers finish together by design, never gets. With 30 ms a step, the static workers
    finished within 0.2 s of each other, and the comparison is of the data alone
    (docs/benchmarks.md, runs of 2026-11-27)."""
    scaling_runs: int = 3
    """Runs of the job, CPU-bound, by ``workers`` and by ``fewer`` dynamic workers (reported beside check 8d)."""
    emulated_slowdown: float = 4.0
    """The scaling figure with emulated accelerators: every worker's step is stretched to this
    many times its length by a sleep (``psworker --slowdown``), so that a worker's compute is
    not the 2 cores' to share. 4: four workers then keep about one core busy, two about half."""
    emulated_runs: int = 2
    """Runs of the job by ``workers`` and by ``fewer`` dynamic workers with emulated
    accelerators (0: none)."""

    def __post_init__(self) -> None:
        if not 1 <= self.fewer < self.workers or self.runs < 1 or self.shards < 1 or not self.lr > 0:
            raise ValueError(f"need 1 <= fewer < workers, runs >= 1, shards >= 1 and lr > 0: {self}")
        if not self.emulated_slowdown >= 1 or self.emulated_runs < 0:
            raise ValueError(f"need emulated_slowdown >= 1 and emulated_runs >= 0: {self}")
        if not (math.isfinite(self.compute_ms) and self.compute_ms >= 0) or self.scaling_runs < 1:
            raise ValueError(f"need a finite compute_ms >= 0 and scaling_runs >= 1: {self}")
        if self.steps < self.workers or self.steps % self.workers:
            raise ValueError(f"steps ({self.steps}) must be a positive multiple of workers ({self.workers})")


# The CNN's test accuracy settles at 0.91-0.93 after about 2500 steps of a 2-worker job (its
# note in psworker.tasks); 2400 steps of 4 workers at ElasticJob.lr reach 0.87-0.91, in 5-10 s
# of training on 2 cores, or about 25 s at 30 ms of emulated compute a step, so the section's
# 20 jobs and 10 throughput runs take 14-15 minutes with start-ups (848-888 s). Five runs of
# each: one run's accuracy spreads over 2-3 points from seed to seed (0.89-0.94), so with three
# the standard error of the two means' difference was about 1.2 points, near check 8b's 1.5.
ELASTIC_JOB = ElasticJob(steps=2400, workers=4, fewer=2, runs=5)
QUICK_ELASTIC_JOB = ElasticJob(steps=100, workers=2, fewer=1, runs=1, compute_ms=5.0, scaling_runs=1, emulated_runs=1)


@dataclass(frozen=True, kw_only=True)
class SparseBench:
    """The sparse section (``psbench.sparse``): embedding tables on the shards.

    Step time against table size: the same ``steps`` precomputed batches of ``batch`` x
    ``features`` Zipf(``zipf``) ids below ``id_range`` (each step: a pull of the batch's distinct
    rows, then a push of their gradients with a ``dim``-float dense variable per shard and a pull of it)
    against a ``small_rows`` and a ``large_rows`` table of ``dim`` columns (Adagrad), ``shards``
    shards each, ``step_reps`` passes over the batches per table, interleaved, after ``warmup``
    steps. Cluster against local: ``dlrm-synth`` with ``dlrm_rows`` rows, ``psworker --local``
    (``2 * dlrm_worker_steps`` steps) against ``shards`` shards x ``dlrm_workers`` async workers
    (``dlrm_worker_steps`` each, static split), ``dlrm_reps`` pairs, each example trained once."""

    small_rows: int = 100_000
    large_rows: int = 10_000_000
    dim: int = 64
    steps: int = 200
    warmup: int = 10
    batch: int = 256
    features: int = 4
    zipf: float = 1.1
    id_range: int = 100_000
    """Every id is below this, so both tables hold every batch."""
    seed: int = 0
    shards: int = 2
    step_reps: int = 5
    dlrm_rows: int = 1_000_000
    dlrm_workers: int = 2
    dlrm_worker_steps: int = 600
    """Steps of each cluster worker; the local run trains ``dlrm_workers`` times as many, and the
    task's examples are as many as the steps cover (one pass: every example trained once)."""
    dlrm_test_examples: int = 50_000
    dlrm_reps: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.id_range <= self.small_rows <= self.large_rows:
            raise ValueError(f"need 1 <= id_range <= small_rows <= large_rows: {self}")
        if min(self.dim, self.steps, self.batch, self.features, self.shards, self.step_reps, self.dlrm_rows,
               self.dlrm_workers, self.dlrm_worker_steps, self.dlrm_test_examples, self.dlrm_reps) < 1:
            raise ValueError(f"sizes, steps and repetitions must be >= 1: {self}")
        if self.warmup < 0 or not self.zipf > 0:
            raise ValueError(f"need warmup >= 0 and zipf > 0: {self}")

    @property
    def dlrm_local_steps(self) -> int:
        return self.dlrm_workers * self.dlrm_worker_steps


# Measured on the 2-core machine: a step of the row microbenchmark takes 2.5-4 ms; dlrm-synth
# trains at about 250K samples/s locally (1,000 steps of 256 in a second) and 30K per cluster
# worker (9-10 ms a step), so 600 steps per worker are 5-6 s of cluster training.
SPARSE = SparseBench()
QUICK_SPARSE = SparseBench(steps=30, warmup=3, dlrm_worker_steps=60, dlrm_test_examples=5_000)


@dataclass(frozen=True, kw_only=True)
class ScaleBench:
    """The scale section (``psbench.scale``): how throughput grows with workers whose compute is
    emulated. Each worker is a light process (``python -m psbench.scale``) that registers the
    ``40 -> W -> W -> 10`` MLP of each of ``widths`` and steps: ``push_pull`` of a fixed real
    gradient (one backward pass of a ``batch``-example batch), then a sleep of ``compute_ms``
    standing for an accelerator's forward and backward, so the cores stay with the shards and the
    clients. For each width and each of ``shard_counts`` (fresh shards, ``max(workers)`` workers
    started once and kept), every count of ``workers`` steps together for ``warmup_seconds``, then
    ``seconds`` timed; ``reps`` passes over the counts (ascending, then descending, alternating)."""

    widths: tuple[int, ...] = (1024, 2048)
    """1.1M and 4.3M parameters (4.2 and 16.4 MiB of float32)."""
    shard_counts: tuple[int, ...] = (1, 2)
    workers: tuple[int, ...] = (1, 2, 4, 8)
    """Must hold 1: every count's efficiency is against one worker of the same pass."""
    compute_ms: float = 50.0
    batch: int = 64
    """Samples per step (samples/s = steps/s x batch), as the training section's."""
    warmup_seconds: float = 1.5
    seconds: float = 5.0
    reps: int = 3

    def __post_init__(self) -> None:
        for name in ("widths", "shard_counts", "workers"):
            values = getattr(self, name)
            if not values or min(values) < 1 or len(set(values)) != len(values):
                raise ValueError(f"{name} must be distinct integers >= 1, got {values}")
        if 1 not in self.workers:
            raise ValueError(f"workers must include 1 (efficiency is against one worker), got {self.workers}")
        if self.compute_ms < 0 or self.batch < 1 or self.warmup_seconds < 0 or not self.seconds > 0 or self.reps < 1:
            raise ValueError(f"need compute_ms >= 0, batch >= 1, warmup_seconds >= 0, seconds > 0, reps >= 1: {self}")

    @property
    def max_workers(self) -> int:
        return max(self.workers)

    def passes(self) -> list[tuple[int, ...]]:
        """The worker counts of each repetition: ascending, then descending, alternating (so
        drift in the machine's load does not always favour the same end)."""
        ordered = tuple(sorted(self.workers))
        return [ordered if rep % 2 == 0 else ordered[::-1] for rep in range(self.reps)]


# Measured on the 2-core machine: starting 8 workers (torch imported in each) takes 5-13 s, and
# each configuration then runs reps x counts x (warmup + seconds) = 3 x 4 x 6.5 = 78 s: about
# 6 minutes for the 4 configurations.
SCALE = ScaleBench()
QUICK_SCALE = ScaleBench(widths=(1024,), shard_counts=(2,), workers=(1, 2), warmup_seconds=0.5, seconds=1.5, reps=1)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything a run does, resolved from :class:`BenchConfig`."""

    sections: tuple[str, ...]
    quick: bool
    sizes_mib: tuple[int, ...]
    shard_counts: tuple[int, ...]
    transfer_reps: int
    transfer_warmup: int
    training_reps: int
    baseline_bytes: int
    """Bytes per timed transfer of the TCP and bare gRPC goodput baselines."""
    latency_calls: int
    latency_warmup: int
    small_bytes: int
    """Payload of the echo baseline and size of the small variable: 4 KiB."""
    training: tuple[TrainingCase, ...]
    tls_size_mib: int
    """Model size of the goodput with TLS and without: the size nearest 64 MiB."""
    tls_training: TrainingCase
    """The model trained with TLS and without: the widest."""
    metrics_training: tuple[TrainingCase, ...]
    """The models trained with metrics on and off: the narrowest and the widest."""
    metrics_reps: int
    """Pairs of cluster runs (metrics off, on) per model."""
    elastic_training: TrainingCase
    """The model trained with dynamic data and with the static split: the narrowest."""
    elastic_reps: int
    """Repetitions of ``elastic_training`` by a static-split and a dynamic-data cluster side by side."""
    elastic_job: ElasticJob
    sparse: SparseBench
    scale: ScaleBench

    def to_dict(self) -> dict:
        return {
            "sections": list(self.sections), "quick": self.quick, "sizes_mib": list(self.sizes_mib),
            "shard_counts": list(self.shard_counts), "transfer_reps": self.transfer_reps,
            "transfer_warmup": self.transfer_warmup, "training_reps": self.training_reps,
            "baseline_bytes": self.baseline_bytes, "latency_calls": self.latency_calls,
            "latency_warmup": self.latency_warmup, "small_bytes": self.small_bytes,
            "training": [_case_dict(c) for c in self.training],
            "tls_size_mib": self.tls_size_mib, "tls_training": _case_dict(self.tls_training),
            "metrics_training": [_case_dict(c) for c in self.metrics_training], "metrics_reps": self.metrics_reps,
            "elastic_training": _case_dict(self.elastic_training), "elastic_reps": self.elastic_reps,
            "elastic_job": asdict(self.elastic_job), "sparse": asdict(self.sparse),
            "scale": asdict(self.scale),
        }


def _case_dict(case: TrainingCase) -> dict:
    return {"width": case.width, "local_steps": case.local_steps, "worker_steps": case.worker_steps,
            "wire_dtype": case.wire_dtype}


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> BenchConfig:
    """Flags, then ``PSBENCH_<FIELD>`` variables, then defaults. Exits with a usage error naming
    the problem on invalid input."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="psbench",
        description="Measure the parameter server against its limits on this machine (loopback): "
        "baselines (raw TCP, bare gRPC, local training), PS goodput, small-call latency, "
        "training throughput, shard memory, the cost of TLS and of metrics, dynamic data (elastic workers) "
        "against the static split, embedding tables on the shards (sparse), and throughput against the number of "
        "workers whose compute is emulated (scale). Prints a table and writes JSON.",
        epilog="Every flag can also be set as PSBENCH_<FLAG> (e.g. PSBENCH_REPS=3); flags win.",
    )
    add_fields(parser, BenchConfig)
    add_version(parser)
    return parse(BenchConfig, parser, argv, env, "PSBENCH")
