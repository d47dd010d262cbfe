"""The worker's training loop: its slice of the data, steps against the shards (or locally),
progress reporting, the final evaluation, and (``--save``) the final model as safetensors."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pswire import errors
from pswire.codec import WIRE_DTYPES
from pswire.consistency import Mode
from psworker.api import connect
from psworker.client import ClientOptions
from psworker.config import WorkerConfig
from psworker.elastic import DataFeed, default_task_size, epoch_order
from pswire.data import DataPlan
from pswire.optim import OptimizerConfig
from psworker.tasks import Task, evaluate, load_task

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["DataSlice", "evaluate_job", "pull_task", "resolve_device", "train"]

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available, else the CPU. Raises ``ValueError`` when CUDA is
    asked for explicitly but is not available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name} asked for CUDA, but torch {torch.__version__} sees no CUDA device "
            "(use --device auto to fall back to the CPU)"
        )
    return device


@dataclass
class DataSlice:
    """Worker ``index`` of ``count``'s share of ``size`` examples: every epoch all workers draw
    the same seeded permutation and take every ``count``-th example from position ``index``, so
    the slices are disjoint and together cover the data. ``(epoch, position)`` is the cursor."""

    size: int
    index: int
    count: int
    seed: int
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        return epoch_order(self.size, self.seed, self.epoch)[self.index :: self.count]

    def __len__(self) -> int:
        return len(self._order)

    def seek(self, epoch: int, position: int) -> None:
        """Continue from a saved cursor."""
        self.epoch, self.position = epoch, position
        self._order = self._permutation()

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """Indices of the next batch; wraps into the next epoch when the slice runs out."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation()
        batch = self._order[self.position : self.position + batch_size]
        self.position += len(batch)
        return batch


class _Progress:
    """A bar on a terminal, else a log line every ``every`` seconds (``total`` None: unknown,
    as for a dynamic-data worker, whose share of the job depends on the others)."""

    def __init__(self, mode: str, total: int | None, every: float, name: str) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.total, self.every, self.name = mode, total, every, name
        self.started = self.last = time.monotonic()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=name, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, samples: int) -> None:
        now = time.monotonic()
        rate = samples / max(now - self.started, 1e-9)
        if self.bar is not None:
            self.bar.update(1)
            if step % 20 == 0 or step == self.total:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
        elif self.mode == "log" and (now - self.last >= self.every or step == self.total):
            self.last = now
            of = f"/{self.total}" if self.total else ""
            log.info("%s step %d%s loss %.4f samples/s %.0f", self.name, step, of, loss, rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _steps(config: WorkerConfig, task: Task, data: DataSlice, batch_size: int) -> int:
    if config.steps is not None:
        return config.steps
    if config.epochs is not None:
        return max(1, math.ceil(config.epochs * math.ceil(len(data) / batch_size)))
    return max(1, task.defaults.steps // config.count)


def _job_updates(config: WorkerConfig, plan: DataPlan | None, total: int | None, batch_size: int) -> int:
    """The job's length in the shards' updates, the default end of a cosine schedule: one per
    step in async and ssp (every worker's steps), one per clock in sync."""
    if plan is not None:
        return math.ceil(plan.total / batch_size)
    assert total is not None
    return total if config.local or config.mode == "sync" else total * config.count


def data_plan(config: WorkerConfig, task: Task, batch_size: int) -> DataPlan:
    """The job's dynamic-data plan from the flags: ``--epochs`` passes over the data, or
    ``--steps`` batches (default: the task's job steps), in tasks of ``--data-task-size``."""
    size = len(task.train[0])
    if config.epochs is not None:
        total = max(1, round(config.epochs * size))
    else:
        total = (config.steps or task.defaults.steps) * batch_size
    return DataPlan(examples=size, task_size=config.data_task_size or default_task_size(batch_size),
                    seed=config.seed, total=total)


def train(config: WorkerConfig, *, registry: CollectorRegistry | None = None,
          stop: threading.Event | None = None) -> dict:
    """Run the configured training and return the result record (the worker's JSON line).
    With ``registry``, the ``psworker_*`` metrics (``psworker.metrics``) are registered there
    and kept up to date.

    Raises ``ValueError`` for bad settings and ``pswire.errors.PSError`` when the shards refuse
    or cannot be reached.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    metrics = None
    if registry is not None:
        from psworker.metrics import WorkerMetrics

        metrics = WorkerMetrics(registry, worker=config.name, task=config.task,
                                mode="local" if config.local else config.mode, device=str(device),
                                overlap=config.overlap)
    task = load_task(config.task, seed=config.seed, options=config.task_option_map())
    defaults = task.defaults
    batch_size = config.batch_size or defaults.batch_size
    model = task.model.to(device)
    x_train, y_train = task.train
    data = DataSlice(len(x_train), config.index, config.count, config.seed)
    plan = data_plan(config, task, batch_size) if config.dynamic else None
    total = None if plan is not None else _steps(config, task, data, batch_size)
    opt_config = config.optimizer_config(
        default_name=defaults.optimizer, default_lr=defaults.lr, default_momentum=defaults.momentum,
        job_updates=_job_updates(config, plan, total, batch_size),
    )

    session = None
    if config.local:
        model, optimizer = local_training(model, opt_config)
    else:
        options = ClientOptions(
            timeout=config.rpc_timeout, connect_timeout=config.connect_timeout, wait_timeout=config.wait_timeout,
            retry_timeout=config.retry_timeout,
            wire_dtype=WIRE_DTYPES.get(config.wire_dtype), bulk=not config.no_bulk, lane_calls=not config.no_lane_calls,
            step_calls=not config.no_step_calls,
            pack_below=config.pack_below,
            security=config.security,
            on_retry=metrics.retried if metrics is not None else None,
            on_exchange=metrics.exchanged if metrics is not None else None,
        )
        session = connect(config.ps, worker_name=config.name, job=f"task={config.task}", options=options,
                          overlap=config.overlap)
        model, optimizer = session.prepare(model, opt_config, consistency=config.consistency())
    log.info(
        "%s: task %s on %s, %s of batch %d, %s lr %g (%s), %s",
        config.name, config.task, device,
        f"{total} steps" if plan is None else f"dynamic data ({plan.describe()})", batch_size, opt_config.name,
        opt_config.lr, opt_config.describe_schedule(),
        "local" if config.local else f"{len(session.client.addresses)} shard(s), {session.client.consistency.describe()}",
    )

    first_step = 1
    if plan is None and session is not None and session.client.resume_data.get("step", 0) > 0:
        # A restarted worker: carry on from the progress the shards recorded for it. (pscluster
        # --restart reads this line, and the one below, as the sign that the worker is back.)
        resume = session.client.resume_data
        first_step = min(total, resume["step"]) + 1
        data.seek(resume["epoch"], resume["position"])
        log.info("%s resumes at step %d of %d (epoch %d, position %d): the progress the shards recorded",
                 config.name, first_step, total, resume["epoch"], resume["position"])
    else:
        wait_for = config.min_workers or (config.count if plan is None and config.mode in ("sync", "ssp") else 0)
        if session is not None and wait_for > 1:
            try:
                _wait_for_workers(session, wait_for, config.wait_timeout, config.name, config.mode)
            except BaseException:
                session.close()
                raise
        log.info("%s starts at step 1%s", config.name, f" of {total}" if total else "")
    progress = _Progress(config.progress, total, config.log_every, config.name)
    recent: deque[float] = deque(maxlen=20)
    losses: list[float] = []
    evals: list[dict] = []
    samples = 0
    step = first_step - 1
    if metrics is not None:
        metrics.take_exchange()  # the initial pull (and a sync job's wait for its workers) is no step's
    started = time.monotonic()

    # The next batch's table rows ride on this step's calls (psworker.tasks.Task.prefetch).
    prefetch = task.prefetch if session is not None and session.client.consistency.mode is Mode.ASYNC else None

    def train_step(idx: torch.Tensor, following: torch.Tensor | None = None) -> None:
        nonlocal samples, step
        step += 1
        step_started = time.monotonic()
        x, y = x_train[idx].to(device, non_blocking=True), y_train[idx].to(device, non_blocking=True)
        loss = task.loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if prefetch is not None and following is not None:
            prefetch(model, x_train[following].to(device, non_blocking=True))
        exchange_started = time.monotonic()
        optimizer.step()
        exchange_seconds = time.monotonic() - exchange_started
        if config.slowdown > 1.0:
            # A simulated straggler: stretch this step to slowdown times its real length.
            time.sleep((config.slowdown - 1.0) * (time.monotonic() - step_started))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value} at step {step}: lower --lr")
        if metrics is not None:
            metrics.step(seconds=time.monotonic() - step_started, exchange_seconds=exchange_seconds,
                         samples=len(idx), loss=value, rejoins=session.rejoins if session is not None else 0)
            if session is not None and session.tables is not None:
                metrics.tables(ids=session.tables.rows_looked_up, rows=session.tables.rows_unique)
        recent.append(value)
        if config.record_losses:
            losses.append(value)
        samples += len(idx)
        progress.update(step, value, samples)
        if config.eval_every and step % config.eval_every == 0 and step != total:
            evals.append({"step": step, "seconds": round(time.monotonic() - started, 3), **evaluate(model, task)})
            if metrics is not None:
                metrics.evaluated(evals[-1])

    feed = DataFeed(session, plan) if plan is not None and session is not None else None
    stopped = False
    try:
        model.train()
        if feed is None:
            batches = _batches(data, first_step, total, batch_size)
            current = next(batches, None)
            while current is not None:
                _, idx, position = current
                if session is not None:
                    session.progress = position
                current = next(batches, None)  # the next batch, for prefetching its rows
                train_step(idx, current[1] if current is not None else None)
        else:
            on_task = (lambda: metrics.data(tasks=feed.tasks, wait_seconds=feed.wait_seconds)) if metrics else None
            stopped = _train_tasks(feed, session, batch_size, train_step, stop, config.name, on_task)
        if session is not None:
            try:
                session.synchronize()  # the last step's exchange (overlap) counts in the time
            except errors.FencedError as exc:
                log.warning("%s: the last step's push was refused: %s", config.name, exc)
        seconds = time.monotonic() - started
        if session is not None:
            session.pull(wait=False)  # the newest weights, including other workers' pushes
        final = evaluate(model, task)
        if metrics is not None:
            metrics.evaluated(final)
        if config.save is not None:
            _save(model, config, step, session)
    finally:
        progress.close()
        if feed is not None:
            feed.close(current=feed.current)
        if session is not None:
            session.close()
    return {
        "task": config.task,
        "mode": "local" if config.local else config.mode,
        "worker": config.name,
        "worker_index": config.worker_index,
        "num_workers": config.num_workers,
        "device": str(device),
        "steps": step if total is None else total,
        "first_step": first_step,
        "samples": samples,
        "seconds": round(seconds, 3),
        "samples_per_second": round(samples / max(seconds, 1e-9), 1),
        # None when a restarted worker found all its steps done already.
        "final_loss": sum(recent) / len(recent) if recent else None,
        "rejoins": session.rejoins if session is not None else 0,
        **final,
        **({"data": {"mode": "dynamic", "tasks": feed.tasks, "examples": feed.examples,
                     "wait_seconds": round(feed.wait_seconds, 3), "stopped": stopped,
                     "stalls": feed.stalls, "stall_seconds": round(feed.stall_seconds, 3), "rides": feed.rides,
                     "job": plan.to_dict()}} if feed is not None else {}),
        **({"model_file": config.save} if config.save is not None else {}),
        **({"tables": {"ids": session.tables.rows_looked_up, "rows": session.tables.rows_unique,
                       "unique_ratio": round(session.tables.rows_unique / max(session.tables.rows_looked_up, 1), 4)}}
           if session is not None and session.tables is not None else {}),
        **({"losses": losses} if config.record_losses else {}),
        **({"evals": evals + [{"step": step, "seconds": round(seconds, 3), **final}]} if config.eval_every else {}),
    }


def _train_tasks(feed: DataFeed, session, batch_size: int, train_step, stop: threading.Event | None,
                 name: str, on_task=None) -> bool:
    """Dynamic data: train leased tasks batch by batch until the job's data is done. Each task
    is reported once its last step's push was acknowledged. Returns True when ``stop`` ended it
    early (the task in hand goes back with what was trained of it). ``on_task()`` is called
    as each task starts (metrics)."""
    order: tuple[int, torch.Tensor] | None = None
    while True:
        lease = feed.next_task(stop)
        if on_task is not None:
            on_task()
        if lease is None:
            return stop is not None and stop.is_set()
        task = lease.task
        if order is None or order[0] != task.epoch:
            order = (task.epoch, epoch_order(feed.plan.examples, feed.plan.seed, task.epoch))
        indices = order[1][task.start:task.end]
        feed.current = (lease, 0)
        for offset in range(0, task.size, batch_size):
            if stop is not None and stop.is_set():
                return True
            following = offset + batch_size
            train_step(indices[offset:following],
                       indices[following:following + batch_size] if following < task.size else None)
            if session.client.registration() != lease.registration:
                # Fenced and registered again during the step: the task went back to the queue.
                log.warning("%s: %s went back to the queue when this worker was fenced; taking the next",
                            name, task)
                break
            feed.current = (lease, min(task.size, offset + batch_size))
        else:
            session.synchronize()  # with overlap, the last push is acknowledged here
            feed.current = None
            feed.finish(lease)
            continue
        feed.current = None


def _batches(data: DataSlice, first: int, last: int, batch_size: int) -> Iterator[tuple[int, torch.Tensor, dict]]:
    """Steps ``first..last`` of a static split: (step number, the batch's indices, the progress
    once it is taken, as pushes record it)."""
    for step_number in range(first, last + 1):
        idx = data.next_batch(batch_size)
        yield step_number, idx, {"step": step_number, "epoch": data.epoch, "position": data.position}


def _wait_for_workers(session, count: int, timeout: float, name: str, mode: str) -> None:
    """Hold step 1 until ``count`` workers have joined every shard (``--min-workers``; sync and
    SSP workers of a static split wait for ``--num-workers``). In sync every clock then averages
    every worker's gradient from the first; in SSP the staleness bound covers every worker from
    the first (without this, the first workers to start would train alone, up to the whole job,
    before a slow one joined); in async the workers train side by side from the first step, at
    the staleness they will keep. Raises ``DeadlineError`` after ``timeout``.

    A worker that has trained and gone (left, or evicted) counts as joined: the others may start
    and finish the whole job between two polls of a worker still holding, which would otherwise
    wait for them forever. One that went without pushing (it gave up holding) does not count."""
    deadline = time.monotonic() + timeout
    next_log = time.monotonic() + 5.0
    pause = threading.Event()
    while True:
        joined = _joined_workers([s.workers for s in session.status()])
        if joined >= count:
            return
        now = time.monotonic()
        if now > deadline:
            raise errors.DeadlineError(
                f"only {joined} of {count} workers joined the {mode} job within {timeout:.0f}s (--wait-timeout)"
            )
        if now >= next_log:
            log.info("%s waits for %d of %d workers to join before step 1", name, count - joined, count)
            next_log = now + 5.0
        pause.wait(0.05)  # a plain timed wait between status polls; nothing sets it


def _joined_workers(shards) -> int:
    """How many workers joined the job, from each shard's ``WorkerInfo`` list: those live on
    every shard, and those gone after pushing to any (see :func:`_wait_for_workers`; a model
    packed on shard 0 gets no pushes on the others)."""
    live = set.intersection(*({w.worker_name for w in workers if w.live} for workers in shards))
    gone = {w.worker_name for workers in shards for w in workers if not w.live and w.pushes > 0}
    return len(live | gone)


class LocalOptimizers:
    """The ``--local`` baseline of a model with ``ShardedEmbedding`` tables: the tables become
    ``nn.Embedding(sparse=True)`` with the same initial rows (``psworker.embedding.localize``),
    each stepped by the torch optimizer its table's rule follows (``SGD``, ``Adagrad``,
    ``SparseAdam``), and the rest of the model by the job's optimizer. Also the baseline of a job
    with a learning-rate schedule: step ``t`` (from 1) runs each optimizer at its settings'
    ``lr * lr_factor(t)``, as the shards do at their update ``t``."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], settings: list[OptimizerConfig]) -> None:
        self.optimizers = optimizers
        self.settings = settings
        self.steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.steps += 1
        for o, c in zip(self.optimizers, self.settings):
            if c.scheduled:
                for group in o.param_groups:
                    group["lr"] = c.lr * c.lr_factor(self.steps)
            o.step()
        return loss


def local_training(model: torch.nn.Module, c) -> tuple[torch.nn.Module, torch.optim.Optimizer | LocalOptimizers]:
    """The model and optimizer of ``--local`` training with the job's optimizer settings ``c``
    (the model's ``ShardedEmbedding`` tables made local, as :class:`LocalOptimizers` says)."""
    from psworker.embedding import localize, sharded_embeddings

    tables = [(path, module.spec_for(c, module.name or path)) for path, module in sharded_embeddings(model)]
    if not tables:
        optimizer = _local_optimizer(model.parameters(), c)
        return model, (LocalOptimizers([optimizer], [c]) if c.scheduled else optimizer)
    device = next(model.parameters()).device
    localize(model)
    for path, _ in tables:
        model.get_submodule(path).to(device)
    sparse = {id(model.get_submodule(path).weight) for path, _ in tables}
    optimizers = [_local_optimizer([p for p in model.parameters() if id(p) not in sparse], c)]
    for path, spec in tables:
        weight, t = model.get_submodule(path).weight, spec.optimizer
        if t.name == "adam":
            optimizers.append(torch.optim.SparseAdam([weight], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps))
        else:
            optimizers.append(_local_optimizer([weight], t))
    return model, LocalOptimizers(optimizers, [c] + [spec.optimizer for _, spec in tables])


def _local_optimizer(params, c) -> torch.optim.Optimizer:
    if c.name == "sgd":
        return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, dampening=c.dampening,
                               nesterov=c.nesterov, weight_decay=c.weight_decay)
    if c.name == "adam":
        return torch.optim.Adam(params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                                weight_decay=c.weight_decay, amsgrad=c.amsgrad)
    return torch.optim.Adagrad(params, lr=c.lr, lr_decay=c.lr_decay, weight_decay=c.weight_decay,
                               eps=c.eps, initial_accumulator_value=c.initial_accumulator_value)


def _save(model: torch.nn.Module, config: WorkerConfig, step: int, session=None) -> None:
    """``--save``: the final model as safetensors. Raises ``ValueError`` naming the file when it
    cannot be written (the training's result is then lost with it: say so loudly)."""
    from psworker.export import save_model, save_model_with_tables

    metadata = {"task": config.task, "worker": config.name, "step": str(step)}
    try:
        if session is not None and session.tables is not None:
            # The tables as the shards hold them, streamed (the worker never holds one whole).
            save_model_with_tables(model, session.client, config.save, metadata=metadata)
        else:
            save_model(model.state_dict(), config.save, metadata=metadata)
    except OSError as exc:
        raise ValueError(f"--save: cannot write the model to {config.save}: {exc}") from exc
    log.info("%s saved the final model to %s", config.name, config.save)


def pull_task(ps: str, task_spec: str, *, seed: int = 0, options: ClientOptions | None = None,
              task_options: dict[str, str] | None = None) -> Task:
    """Task ``task_spec`` (built with ``seed`` and ``task_options``) with the job's current
    weights pulled into its model, without joining the job (its buffers stay the fresh model's:
    the shards hold parameters only). A model's ``ShardedEmbedding`` tables stay on the shards:
    its lookups read them as a reader, through a client that stays open as long as the model
    (``psworker.embedding.table_client(model)``). Raises ``PreconditionError`` when the shards
    hold a different model."""
    import weakref

    from pswire.errors import PreconditionError
    from pswire.placement import model_spec
    from pswire.wire import optimizer_from_proto, table_from_proto
    from psworker.client import PSClient
    from psworker.embedding import attach

    task = load_task(task_spec, seed=seed, options=task_options)
    params = {name: p.data for name, p in task.model.named_parameters()}
    client = PSClient(ps, options)
    try:
        client.wait_connected()
        statuses = client.status()
        digests = {s.placement_digest for s in statuses}
        try:
            if len(digests) != 1:
                raise PreconditionError("the shards disagree on the placement")
            client.set_placement(model_spec(params.items()), digest=digests.pop())
        except PreconditionError:
            raise PreconditionError(f"the shards hold a different model than task {task_spec!r}") from None
        client.pull(params, skip_unchanged=False)
        tables = [table_from_proto(t.spec) for t in statuses[0].tables]
        if tables:
            client.tables = {t.name: t for t in tables}
            specs, _ = attach(task.model, client, optimizer_from_proto(statuses[0].optimizer))
            if [s.name for s in specs] != [t.name for t in tables]:
                raise PreconditionError(f"the shards hold other tables than task {task_spec!r}")
            weakref.finalize(task.model, client.close)
            return task
    except BaseException:
        client.close()
        raise
    client.close()
    return task


def evaluate_job(ps: str, task_spec: str, *, seed: int = 0, options: ClientOptions | None = None) -> dict:
    """Pull the job's current weights (without joining it, :func:`pull_task`) and evaluate them
    on the task's test split. Raises ``PreconditionError`` when the shards hold a different model."""
    task = pull_task(ps, task_spec, seed=seed, options=options)
    return evaluate(task.model, task)
