"""Worker configuration: one frozen dataclass, built once in ``main()`` from flags, then
``PSWORKER_*`` environment variables, then defaults (flags win). Only this module reads ``argv``
and the environment (``PSGRPC_TOKEN`` included: a token is never a flag's value)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field

from pswire.consistency import Consistency
from pswire.flags import add_fields, add_version, parse
from pswire.optim import OPTIMIZERS, OptimizerConfig
from pswire.placement import PACK_BELOW
from pswire.security import TOKEN_ENV, ClientSecurity, client_security

LR_SCHEDULES = ("constant", "cosine")
"""psworker --lr-schedule: constant, or cosine decay (``OptimizerConfig.decay_steps``)."""

__all__ = ["WorkerConfig", "build_parser", "parse_args", "parse_task_options"]


def _f(default, help: str, **kw):
    kw.pop("flag", None)  # bool fields are switches by their type
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    ps: str = _f("", "Shard addresses, HOST:PORT[,HOST:PORT...], in the same order on every worker.")
    task: str = _f("mnist1d-mlp", "Built-in task (mnist1d-mlp, mnist1d-cnn, linreg, dlrm-synth: embedding tables "
                   "on the shards) or package.module:function.")
    task_options: str = _f("", "Options of the task, KEY=VALUE[,KEY=VALUE...] (dlrm-synth: rows, dim, features, "
                           "examples, zipf, ...).")
    local: bool = _f(False, "Train in this process with no server (the baseline).", flag=True)
    mode: str = _f("async", "Consistency: async (nobody waits), ssp (bounded staleness) or sync.",
                   choices=("async", "ssp", "sync"))
    staleness: int = _f(0, "SSP bound S in clocks (steps): a worker at clock c reads once all reached c - S.")
    backup_workers: int = _f(0, "Sync: apply each clock once live workers - B gradients arrived.")
    stale_policy: str = _f("drop", "SSP: a push staler than S is dropped, or scaled by lr / staleness.",
                           choices=("drop", "scale"))
    slowdown: float = _f(1.0, "Make this worker this many times slower (a straggler, for tests and demos).")
    steps: int | None = _f(None, "Length in optimizer steps. With dynamic data (no --worker-index): the job's, across "
                           "all its workers; with --worker-index: this worker's (default: the task's job steps, "
                           "divided by --num-workers with --worker-index).")
    epochs: float | None = _f(None, "Length in passes over the data instead of --steps: the job's with dynamic data, "
                              "this worker's slice with --worker-index.")
    batch_size: int | None = _f(None, "Examples per step (default: the task's).")
    optimizer: str | None = _f(None, "sgd, adam or adagrad (default: the task's).", choices=OPTIMIZERS)
    lr: float | None = _f(None, "Learning rate (default: the task's).")
    momentum: float | None = _f(None, "SGD momentum (default: the task's, else 0).")
    nesterov: bool = _f(False, "SGD with Nesterov momentum.", flag=True)
    dampening: float = _f(0.0, "SGD dampening.")
    weight_decay: float = _f(0.0, "L2 penalty.")
    beta1: float = _f(0.9, "Adam beta1.")
    beta2: float = _f(0.999, "Adam beta2.")
    eps: float | None = _f(None, "Adam/Adagrad eps (default: 1e-8 for Adam, 1e-10 for Adagrad).")
    amsgrad: bool = _f(False, "Adam: AMSGrad variant.", flag=True)
    lr_decay: float = _f(0.0, "Adagrad learning-rate decay.")
    initial_accumulator_value: float = _f(0.0, "Adagrad initial accumulator.")
    lr_schedule: str = _f("constant", "Learning-rate schedule, run by the shards over their update count: constant, "
                          "or cosine (decay to --min-lr-ratio x lr by --decay-steps, as torch's CosineAnnealingLR).",
                          choices=LR_SCHEDULES)
    warmup_steps: int = _f(0, "Warm up the learning rate linearly over the shards' first N updates (any schedule).")
    decay_steps: int | None = _f(None, "Cosine: the update at which the decay ends (default: the job's length in "
                                 "updates: its steps across all workers in async and ssp, one worker's in sync with "
                                 "--worker-index; give it for a sync job of dynamic data).")
    min_lr_ratio: float = _f(0.0, "Cosine: the learning rate it ends at, as a fraction of --lr.")
    seed: int = _f(0, "Seed of the model's initial weights and of the data order.")
    device: str = _f("auto", "cpu, cuda, cuda:N or auto (CUDA when available).")
    threads: int = _f(0, "Threads torch may use for compute; 0 keeps torch's default (pscluster sets 1 per worker).")
    worker_index: int | None = _f(None, "Static split: this worker's index, 0..num-workers-1, picks a fixed slice of "
                                  "the data. Without it the data is dynamic: shard 0 leases data tasks to whichever "
                                  "workers ask, so identical workers can join and leave at any time.")
    num_workers: int | None = _f(None, "Static split: the number of workers sharing the data (with --worker-index; "
                                 "default: 1).")
    min_workers: int = _f(0, "Hold step 1 until this many workers have joined the job (any mode, static or dynamic "
                          "data; 0: sync and ssp workers of a static split wait for --num-workers, others start at "
                          "once). Workers then train side by side from the first step, as an elastic job's minimum "
                          "size does.")
    data_task_size: int | None = _f(None, "Dynamic data: examples per data task, the unit a worker leases, trains and "
                                    "reports (default: about 256, in whole batches). Every worker must use the same.")
    worker_name: str | None = _f(None, "Stable name of this worker (default: worker-<index>, or <host>-<pid> with "
                                 "dynamic data). Names must be unique among live workers.")
    progress: str = _f("auto", "auto (a bar on a terminal, else log lines), bar, log or none.",
                       choices=("auto", "bar", "log", "none"))
    log_every: float = _f(5.0, "Seconds between progress log lines.")
    rpc_timeout: float = _f(30.0, "Deadline of a small RPC in seconds (transfers get more per byte).")
    connect_timeout: float = _f(60.0, "Seconds to wait for every shard to accept a connection.")
    retry_timeout: float = _f(120.0, "Seconds a push or pull keeps retrying a shard that is unreachable, too slow or "
                              "overloaded (one being restarted, say) before the worker gives up.")
    wait_timeout: float = _f(600.0, "Seconds a pull may wait on the ssp/sync bound before failing.")
    wire_dtype: str = _f("none", "Wire compression: send gradients and pull weights as bf16 or fp16 (the shards "
                         "keep full precision); none sends them as they are.", choices=("none", "bf16", "fp16"))
    overlap: bool = _f(False, "Async only: run each step's push and pull in the background while the next step "
                       "computes (hides communication behind compute, at one step of extra staleness).", flag=True)
    no_bulk: bool = _f(False, "Send every byte through gRPC, never on the shards' bulk lanes (plain TCP beside gRPC "
                       "that carries large pushes and pulls, used when a shard offers one and its port is reachable).", flag=True)
    no_lane_calls: bool = _f(False, "Make the small calls of every step (inline pushes and pulls, row reads) as gRPC "
                             "calls; by default they travel whole on a bulk lane, which costs a tenth of the CPU.",
                             flag=True)
    no_step_calls: bool = _f(False, "Make each async step's call to a shard as a PushPull (protobuf) rather than as "
                             "a Step, the same push and reads in a fixed binary layout that costs less CPU on both "
                             "sides.", flag=True)
    pack_below: int = _f(PACK_BELOW, "A model of at most this many bytes lives whole on shard 0: one call per step "
                         "instead of one per shard. 0 spreads every model over the shards. Every worker of a job "
                         "must give the same (it is part of the placement the shards check).")
    eval_every: int = _f(0, "Evaluate the current model on the test split every N steps (0: only at the end); "
                         "results go to \"evals\" in the JSON line.")
    record_losses: bool = _f(False, "Include every step's loss in the JSON result (\"losses\").", flag=True)
    save: str | None = _f(None, "At the end, write the final model (after the last pull: the job's weights, with this "
                          "worker's own buffers) to this file as safetensors named by the model's state_dict() keys, "
                          "atomically (a temporary file, then a rename); its directory must exist. Unset: no file.")
    log_level: str = _f("INFO", "Logging level.")
    metrics_port: int | None = _f(None, "Serve Prometheus metrics (psworker_* and process_*; docs/metrics.md) at "
                                  "http://METRICS_HOST:PORT/metrics while training; 0 picks a free port, which is "
                                  "logged (\"metrics on http://HOST:PORT/metrics\"). Unset: no endpoint. The "
                                  "endpoint has no TLS or tokens: keep it where only Prometheus reaches.")
    metrics_host: str = _f("127.0.0.1", "Interface of the metrics endpoint (with --metrics-port).")
    tls_ca: str | None = _f(None, "PEM bundle of the CA that signed the shards' certificates: talk TLS to them "
                            "(their certificates must name the host in --ps).")
    tls_cert: str | None = _f(None, "PEM certificate of this worker, for shards that require client certificates "
                              "(mutual TLS; needs --tls-ca and --tls-key).")
    tls_key: str | None = _f(None, "PEM private key of --tls-cert.")
    token_file: str | None = _f(None, f"File holding the bearer token this worker sends (its whole content); "
                                f"without it, the {TOKEN_ENV} environment variable, if set. Never a flag's value: "
                                "command lines are visible to every user of the machine.")
    token: InitVar[str | None] = None
    """The token from ``PSGRPC_TOKEN`` (``parse_args``), used when no ``token_file`` is given. Not
    a field: it has no flag, and it is kept only inside ``security`` (never in ``repr``); a
    ``dataclasses.replace`` must pass it again."""

    def __post_init__(self, token: str | None) -> None:
        object.__setattr__(self, "_security", client_security(
            tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, token_file=self.token_file,
            env_token=token,
        ))
        if not self.local and not self.ps:
            raise ValueError("give --ps HOST:PORT[,HOST:PORT...] (or --local to train without a server)")
        self.task_option_map()  # validates the syntax
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"--epochs must be > 0, got {self.epochs}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.pack_below < 0:
            raise ValueError(f"--pack-below must be >= 0 (bytes), got {self.pack_below}")
        if self.worker_index is None and self.num_workers is not None and not self.local:
            raise ValueError("--num-workers needs --worker-index (a static split); leave both out for dynamic data")
        count = self.num_workers or 1
        if count < 1 or not 0 <= (self.worker_index or 0) < count:
            raise ValueError(
                f"--worker-index must be in 0..{count - 1} (got {self.worker_index} with --num-workers {count})"
            )
        if self.data_task_size is not None and (self.data_task_size < 1 or not self.dynamic):
            raise ValueError("--data-task-size must be >= 1, and is for dynamic data (no --worker-index, not --local)")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.min_workers < 0 or (self.min_workers and self.local):
            raise ValueError(f"--min-workers must be >= 0, and is for workers of shards (not --local); got "
                             f"{self.min_workers}")
        if self.slowdown < 1.0:
            raise ValueError(f"--slowdown must be >= 1, got {self.slowdown}")
        self.consistency()  # validates the mode's settings
        if self.overlap and (self.local or self.mode != "async"):
            raise ValueError("--overlap needs --mode async and shards (--ps): ssp and sync bound what a step may see")
        if self.save is not None and (not self.save.strip() or os.path.isdir(self.save)
                                      or not os.path.isdir(os.path.dirname(os.path.abspath(self.save)))):
            raise ValueError(f"--save {self.save!r}: give a file in an existing directory")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if min(self.log_every, self.rpc_timeout, self.connect_timeout, self.wait_timeout, self.retry_timeout) <= 0:
            raise ValueError("--log-every, --rpc-timeout, --connect-timeout, --retry-timeout and --wait-timeout "
                             "must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535 (0: any free port), got {self.metrics_port}")
        if not self.metrics_host.strip():
            raise ValueError("--metrics-host is empty: give an interface, e.g. 127.0.0.1")

    @property
    def security(self) -> ClientSecurity | None:
        """TLS and token settings for ``ClientOptions.security``; None when none are set."""
        return self._security

    def consistency(self) -> Consistency:
        """The consistency setting asked for; raises ``ValueError`` when inconsistent."""
        return Consistency(
            mode=self.mode, staleness=self.staleness, backup_workers=self.backup_workers,
            stale_policy=self.stale_policy,
        )

    def task_option_map(self) -> dict[str, str]:
        """``task_options`` as a dict (:func:`parse_task_options`)."""
        return parse_task_options(self.task_options)

    @property
    def dynamic(self) -> bool:
        """Dynamic data: the job's queue on shard 0 hands this worker its data (no --worker-index)."""
        return not self.local and self.worker_index is None

    @property
    def index(self) -> int:
        """The static split's index (0 with dynamic data or --local)."""
        return self.worker_index or 0

    @property
    def count(self) -> int:
        """The static split's worker count (1 with dynamic data or --local)."""
        return self.num_workers or 1

    @property
    def name(self) -> str:
        if self.worker_name:
            return self.worker_name
        if self.dynamic:
            return f"{socket.gethostname()}-{os.getpid()}"
        return f"worker-{self.index}"

    def optimizer_config(
        self, *, default_name: str, default_lr: float, default_momentum: float = 0.0, job_updates: int = 0,
    ) -> OptimizerConfig:
        """The job's optimizer from flags, falling back to the task's defaults; ``job_updates``
        is the cosine schedule's length when ``--decay-steps`` is not given. Raises
        ``ValueError`` for invalid settings."""
        decay_steps = 0
        if self.lr_schedule == "cosine":
            decay_steps = self.decay_steps if self.decay_steps is not None else job_updates
            if decay_steps <= self.warmup_steps:
                raise ValueError(f"--lr-schedule cosine decays from update {self.warmup_steps + 1} "
                                 f"(after --warmup-steps) to --decay-steps, but the decay ends at update {decay_steps}")
        elif self.decay_steps is not None or self.min_lr_ratio:
            raise ValueError("--decay-steps and --min-lr-ratio belong to --lr-schedule cosine")
        name = self.optimizer or default_name
        same_as_task = name == default_name
        momentum = self.momentum if self.momentum is not None else (default_momentum if same_as_task else 0.0)
        return OptimizerConfig(
            name=name,
            lr=self.lr if self.lr is not None else default_lr,
            momentum=momentum if name == "sgd" else 0.0,
            dampening=self.dampening,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps if self.eps is not None else (1e-10 if name == "adagrad" else 1e-8),
            amsgrad=self.amsgrad,
            lr_decay=self.lr_decay,
            initial_accumulator_value=self.initial_accumulator_value,
            warmup_steps=self.warmup_steps,
            decay_steps=decay_steps,
            min_lr_ratio=self.min_lr_ratio,
        )


def parse_task_options(text: str) -> dict[str, str]:
    """``--task-options`` as a dict (``"rows=1000,dim=8"``: ``{"rows": "1000", "dim": "8"}``;
    spaces around keys and values are dropped). Raises ``ValueError`` for an item without
    ``=``, an empty key, or a key given twice."""
    options: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--task-options: {item.strip()!r} is not KEY=VALUE")
        if key in options:
            raise ValueError(f"--task-options: {key!r} is given twice")
        options[key] = value.strip()
    return options


def build_parser(prog: str = "psworker") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a task against parameter-server shards (or locally with --local).",
        epilog="Every flag can also be set as PSWORKER_<FLAG> (e.g. PSWORKER_PS=ps0:7000); flags win.",
    )
    add_fields(parser, WorkerConfig)
    return parser


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> WorkerConfig:
    """Flags, then ``PSWORKER_<FIELD>`` variables, then defaults. Exits with a usage error
    naming the problem on invalid input."""
    env = os.environ if env is None else env
    parser = build_parser()
    add_version(parser)  # here, not in build_parser: pscluster checks worker flags with that
    config = parse(WorkerConfig, parser, argv, env, "PSWORKER")
    token = env.get(TOKEN_ENV)
    if token is None or config.token_file or config.local:
        return config
    try:
        return dataclasses.replace(config, token=token)
    except ValueError as exc:
        parser.error(str(exc))
