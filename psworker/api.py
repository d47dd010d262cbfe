"""Training against the parameter server from an existing PyTorch loop, in three changed lines::

    session = psworker.connect("127.0.0.1:7000,127.0.0.1:7001")      # 1: connect to the shards
    model, optimizer = session.prepare(model, optimizer)               # 2: same model, PS optimizer
    ...                                                                # 3: the loop is unchanged:
    loss.backward(); optimizer.step(); optimizer.zero_grad()           #    step() pushes and pulls

``prepare`` registers the model and the optimizer's settings with the job (the first worker to
register initialises the shards with its model's values; later ones join and must agree), then
pulls the current weights into the model. The wrapped optimizer's ``step()`` pushes the
gradients, the shards apply the update rule, and the new weights are pulled back in place.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import torch

from pswire import errors
from pswire.consistency import Consistency, Mode
from pswire.optim import OptimizerConfig
from pswire.placement import model_spec
from psworker.client import ClientOptions, PSClient
from psworker.embedding import attach

__all__ = ["DistributedOptimizer", "Session", "connect"]

log = logging.getLogger(__name__)


def connect(
    ps: str | Sequence[str],
    *,
    worker_name: str | None = None,
    job: str = "",
    options: ClientOptions | None = None,
    overlap: bool = False,
) -> "Session":
    """Connect to every shard of a job (``"host:port,host:port"`` or a list).

    ``worker_name`` identifies this worker across restarts (default: host name and pid); ``job``
    is a free-form identity every worker of the job must share. ``options`` sets deadlines,
    compression and credentials: shards that serve TLS or check tokens need
    ``ClientOptions(security=ClientSecurity(ca_file=..., cert_file=..., key_file=..., token=...))``
    (``pswire.security``; the files are read when it is built). ``overlap`` (async jobs only):
    each step's push and the pull of the weights for the step after next run in the background
    while the next step computes (see :class:`Session`). Raises ``ValueError`` for malformed
    addresses and ``UnavailableError`` when a shard does not answer in time (a failed TLS
    handshake included); the first call the shards refuse raises ``UnauthenticatedError`` (no
    token, or one they do not know) or ``PermissionDeniedError`` (a token whose role may not).
    """
    client = PSClient.connected(ps, options)
    return Session(client, worker_name or f"{socket.gethostname()}-{os.getpid()}", job, overlap=overlap)


class Session:
    """One worker's membership in a job. Use :func:`connect` to make one.

    With ``overlap``, ``step()`` copies the gradients, loads the weights the previous step's
    exchange brought, and returns while this step's push and pull run on a background thread,
    so communication hides behind the next step's compute (on a GPU worker, or whenever a core
    is free). The price is one step of staleness: a step computes on weights that lack the
    worker's own previous gradient. The shard measures and reports it like any other. Only for
    async jobs, whose steps may use any recent weights; ssp and sync bound what a step may see.
    """

    def __init__(self, client: PSClient, worker_name: str, job: str = "", *, overlap: bool = False) -> None:
        self.client = client
        self.overlap = overlap
        self._pending: futures.Future | None = None
        self._loaded_versions: list[int] | None = None
        """Each shard's version of the weights now in the model (what a step computes on; kept
        with overlap only, where a push names it)."""
        self._exchanger = (
            futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="psworker-exchange") if overlap else None
        )
        self.worker_name = worker_name
        self.job = job
        self.initialized_job = False
        """True when this worker uploaded the initial values (it registered first)."""
        self._params: dict[str, torch.nn.Parameter] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._on_cuda = False  # a parameter lives on a CUDA device (prepare)
        self._grads: dict[str, torch.Tensor] = {}
        self._table_specs: list = []
        self.tables = None
        """The ``psworker.embedding.TableRows`` of the model's ``ShardedEmbedding`` tables (None
        without any): their lookups this step, pushed by ``step()``."""
        self.rejoins = 0
        """How many times this worker re-registered after being fenced off."""
        self.steps = 0
        """Optimizer steps this worker completed (every push acknowledged, but with overlap the
        last one's, which lands with the next step)."""
        self.left = False
        """True while this worker has left the job's membership without closing (a dynamic-data
        worker waiting for a task in an ssp/sync job); :meth:`rejoin` ends it."""
        self._step_hooks: list[Callable[[], None]] = []
        self._close_hooks: list[Callable[[], None]] = []
        self.progress: dict[str, int] | None = None
        """Set by a training loop before ``step()``: its data position, kept by the shards (and
        in checkpoints) so that a restarted worker resumes where it was."""

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerConfig,
        *,
        consistency: Consistency | None = None,
    ) -> tuple[torch.nn.Module, "DistributedOptimizer"]:
        """Register ``model`` and the optimizer's settings, then load the job's weights.

        ``optimizer`` is a ``torch.optim`` SGD, Adam or Adagrad over the model's parameters (its
        hyper-parameters become the job's update rule on the shards) or an ``OptimizerConfig``;
        ``consistency`` the job's setting (default async), which every worker must share. The
        model's ``psworker.ShardedEmbedding`` modules become the job's tables, their rows on the
        shards: each forward pulls the rows its ids touch, and ``step()`` pushes their gradients.
        Returns the same model object and a :class:`DistributedOptimizer`. Raises ``ValueError``
        for unsupported optimizers, ``PreconditionError`` when the model or settings disagree
        with the job's.
        """
        config = optimizer if isinstance(optimizer, OptimizerConfig) else OptimizerConfig.from_torch(optimizer)
        self._params = dict(model.named_parameters())
        if not self._params:
            raise ValueError("the model has no parameters (a model of tables alone needs one dense parameter)")
        self._table_specs, self.tables = attach(model, self.client, config)
        if self.tables is not None:
            self.tables.step_reads_allowed = not self.overlap
        for name, param in self._params.items():
            # Pulls write into a CPU tensor of the parameter's shape: the parameter itself when it
            # lives on the CPU and is contiguous, otherwise a staging copy (pinned for CUDA).
            # With overlap the pull lands while the next step computes, so never in the parameter.
            if param.device.type == "cpu" and param.is_contiguous() and not self.overlap:
                self._staging[name] = param.data
            else:
                pin = param.device.type == "cuda"
                self._staging[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=pin)
                self._grads[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=pin)
        self._on_cuda = any(p.device.type == "cuda" for p in self._params.values())
        self._optimizer_config, self._consistency = config, consistency
        spec = self._register()
        if self.overlap and self.client.consistency.mode is not Mode.ASYNC:
            raise ValueError(
                f"overlap needs an async job, and this one is {self.client.consistency.describe()}: "
                "in ssp and sync a step must compute on the weights its clock allows"
            )
        log.info(
            "%s %s the job on %d shard(s): %d variables, optimizer %s lr %g, %s",
            self.worker_name, "initialised" if self.initialized_job else "joined",
            self.client.num_shards, len(spec), config.name, config.lr, self.client.consistency.describe(),
        )
        self.pull()
        return model, DistributedOptimizer(self, optimizer if not isinstance(optimizer, OptimizerConfig) else None)

    def _register(self):
        initial = {name: p.detach().to("cpu").contiguous() for name, p in self._params.items()}
        spec = model_spec(initial.items())
        self.initialized_job = self.client.register(
            spec, self._optimizer_config, worker_name=self.worker_name, job_fingerprint=self.job,
            initial_values=initial, consistency=self._consistency, tables=self._table_specs,
        )
        return spec

    def rejoin(self) -> None:
        """Register again after being fenced off (evicted, or superseded), then pull the job's
        current weights. Raises like :meth:`prepare`."""
        started = time.monotonic()
        if self.tables is not None:
            self.tables.clear()  # this step's rows go with its dropped gradient
            self.tables.forget_reads()
        self._register()
        self.left = False
        self.pull()
        self.rejoins += 1
        log.warning("%s re-registered and pulled in %.2fs", self.worker_name, time.monotonic() - started)

    def pull(self, *, wait: bool = True) -> None:
        """Load the shards' current weights into the model's parameters, in place. In ssp/sync
        this waits as the bound requires; ``wait=False`` reads at once (e.g. to evaluate)."""
        self.synchronize()
        self.client.pull(self._staging, wait=wait)
        self._load_staged()

    def _load_staged(self) -> None:
        with torch.no_grad():
            for name, param in self._params.items():
                staged = self._staging[name]
                if staged.data_ptr() != param.data_ptr():
                    param.data.copy_(staged, non_blocking=True)
            if self._on_cuda:
                torch.cuda.synchronize()
        if self.overlap:
            self._loaded_versions = self.client.versions()

    def push(self) -> None:
        """Push the parameters' gradients; parameters without a gradient are left out, as
        ``torch.optim`` skips them. Raises ``InvalidArgumentError`` if a gradient is not finite."""
        self.synchronize()
        rows = self._row_gradients()
        self.client.push(self._gradients(allow_none=bool(rows)), data=self.progress, rows=rows)

    def push_pull(self) -> None:
        """A training step's traffic: push the gradients, then load the updated weights (one
        call per shard when both are small; see ``PSClient.push_pull``). With overlap: load the
        weights of the previous step's exchange, then start this one in the background."""
        rows = self._row_gradients()
        if not self.overlap:
            # The next batch's rows announced with prefetch(with_step=True) ride on this step's calls.
            reads = self.tables.step_reads() if self.tables is not None else None
            self.client.push_pull(self._gradients(allow_none=bool(rows)), self._staging, data=self.progress, rows=rows,
                                  read_rows=reads)
            if reads:
                self.tables.read_with_step(reads)
            self._load_staged()
            return
        computed_on = self._loaded_versions  # the weights this step's gradients come from
        self.synchronize()
        grads = self._gradients(allow_none=bool(rows))  # copies: the next backward may write them in place
        progress = dict(self.progress) if self.progress else None
        assert self._exchanger is not None
        self._pending = self._exchanger.submit(
            self.client.push_pull, grads, self._staging, data=progress, base_versions=computed_on, rows=rows,
        )

    def _row_gradients(self) -> dict:
        """This step's table rows and their gradients (copies), and the lookups forgotten."""
        if self.tables is None:
            return {}
        rows = self.tables.gradients()
        self.tables.clear()
        return rows

    def leave(self) -> None:
        """Leave the job's membership but stay connected (ssp/sync peers stop waiting for this
        worker); :meth:`rejoin` joins again."""
        self.synchronize()
        self.client.leave()
        self.left = True

    def add_step_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after every optimizer step that completed (``psworker.elastic``)."""
        self._step_hooks.append(hook)

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` first thing in :meth:`close`, before the worker leaves."""
        self._close_hooks.append(hook)

    def stepped(self) -> None:
        """Count a completed step and tell the step hooks (``DistributedOptimizer.step`` calls it)."""
        self.steps += 1
        for hook in self._step_hooks:
            hook()

    def synchronize(self) -> None:
        """Wait for the step running in the background (overlap), raise its error if it failed,
        and load the weights it pulled; nothing without overlap or when none is running."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
            self._load_staged()

    def _gradients(self, *, allow_none: bool = False) -> dict[str, torch.Tensor]:
        grads = {}
        with torch.no_grad():
            for name, param in self._params.items():
                if param.grad is None:
                    continue
                grad = param.grad
                if name in self._grads:
                    self._grads[name].copy_(grad)
                    grad = self._grads[name]
                elif not grad.is_contiguous():
                    grad = grad.contiguous()
                grads[name] = grad
        if not grads and not allow_none:
            raise errors.InvalidArgumentError("no parameter has a gradient: call backward() before step()")
        return grads

    def status(self):
        return self.client.status()

    def close(self) -> None:
        """Finish the step in flight (overlap), leave the job (so ssp/sync peers stop waiting for
        this worker) and disconnect."""
        try:
            try:
                self.synchronize()
            except errors.PSError as exc:
                log.warning("%s: the last step's exchange failed: %s", self.worker_name, exc)
            for hook in self._close_hooks:
                hook()
            if self._params and not self.left:
                self.client.leave()
        finally:
            if self._exchanger is not None:
                self._exchanger.shutdown(wait=True)
            if self.tables is not None:
                self.tables.close()
            self.client.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DistributedOptimizer:
    """Stands in for the local optimizer: ``step()`` pushes gradients and pulls new weights.

    The update rule runs on the shards, so the wrapped optimizer never steps; it is kept for
    ``zero_grad`` and ``param_groups``. Learning-rate changes made locally (e.g. by a scheduler)
    do not reach the shards: give a schedule in the job's ``OptimizerConfig`` (``warmup_steps``,
    ``decay_steps``, ``min_lr_ratio``), which the shards run over their update count.
    """

    def __init__(self, session: Session, local: torch.optim.Optimizer | None) -> None:
        self.session = session
        self.local = local

    @property
    def param_groups(self) -> list[dict]:
        return self.local.param_groups if self.local is not None else []

    def step(self, closure=None):
        """Push this step's gradients, then pull the updated weights into the model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            if self.session.client.fenced.is_set():
                raise errors.FencedError("a heartbeat was refused: this worker was evicted")
            self.session.push_pull()
            self.session.stepped()
        except errors.FencedError as exc:
            # The shards fenced this worker off (it was evicted, e.g. after a partition, or a
            # shard restored from a checkpoint): a gradient computed for a registration that no
            # longer exists is dropped, and the worker joins again and pulls the current weights.
            log.warning("%s: %s; re-registering", self.session.worker_name, exc)
            self.session.rejoin()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.session.tables is not None:
            self.session.tables.zero_grad(set_to_none)
        for param in self.session._params.values():
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()
