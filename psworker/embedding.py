"""``ShardedEmbedding``: an ``nn.Embedding`` whose table lives only on the shards.

A worker never allocates the table. Each forward pulls just the rows the batch's ids touch,
deduplicated, from every shard at once (row ``i`` lives on shard ``i % num_shards``:
``pswire.tables``); backward gives those rows' gradients, and the session's ``optimizer.step()``
pushes them with the dense gradients of the same step, in the same atomic push per shard. The
shards apply the table's own row-wise optimizer (``TableSpec.optimizer``: SGD, Adagrad, or lazy
Adam as ``torch.optim.SparseAdam``).

Use it as a module of the model handed to ``session.prepare`` (or of a ``--task``'s model)::

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = psworker.ShardedEmbedding(10_000_000, 64, optimizer=OptimizerConfig(name="adagrad", lr=0.05))
            self.top = nn.Linear(64, 1)

A table's name is the module's path in the model (``emb`` above) unless given. Its rows start
at ``initial_rows(spec, ids)`` (``pswire.tables``), computed on the shards when first touched;
:func:`localize` turns the model into a local one with ``nn.Embedding(sparse=True)`` tables that
start from the very same values (the ``--local`` baseline).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import numpy as np
import torch
from torch import nn

from pswire import errors
from pswire.consistency import Mode
from pswire.optim import OptimizerConfig
from pswire.tables import TableSpec, coalesce, initial_rows

__all__ = ["ShardedEmbedding", "TableRows", "attach", "localize", "sharded_embeddings"]

log = logging.getLogger(__name__)


class ShardedEmbedding(nn.Module):
    """Stands in for ``nn.Embedding(num_embeddings, embedding_dim)`` (float32); the table is on
    the shards.

    ``init`` / ``init_scale`` / ``seed``: the rows' initial values (``pswire.tables``: normal with
    standard deviation ``init_scale`` by default). ``optimizer``: the table's update rule on the
    shards; ``None`` takes the job's (SGD without momentum, Adagrad, or Adam, which tables run
    lazily as ``SparseAdam`` does). ``name``: the table's name in the job (default: the module's
    path in the model given to ``session.prepare``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init: str = "normal",
        init_scale: float = 0.01,
        seed: int = 0,
        optimizer: OptimizerConfig | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.init = init
        self.init_scale = float(init_scale)
        self.seed = int(seed)
        self.optimizer = optimizer
        self.name = name
        # Checked now, with a stand-in optimizer, so that a bad size or initializer fails where
        # the module is built.
        self.spec_for(OptimizerConfig(name="adagrad", lr=1.0), name or "table")
        self._tables = None
        """The session's ``psworker.rows.Tables`` once prepared: pulls rows and keeps this step's."""

    def spec_for(self, job_optimizer: OptimizerConfig, name: str) -> TableSpec:
        """This table's spec in a job whose dense optimizer is ``job_optimizer`` (raises
        ``ValueError`` for settings tables refuse)."""
        optimizer = self.optimizer or job_optimizer
        if self.optimizer is None and optimizer.name == "sgd" and optimizer.momentum != 0:
            raise ValueError(
                f"table {self.name or name!r}: the job's SGD has momentum {optimizer.momentum}, which is not applied "
                "to table rows; give the table its own optimizer: ShardedEmbedding(..., optimizer="
                "OptimizerConfig(name='sgd', lr=...)) or name='adagrad'"
            )
        if self.optimizer is None and optimizer.weight_decay != 0:
            raise ValueError(
                f"table {self.name or name!r}: the job's optimizer has weight decay, which is not applied to table "
                "rows; give the table its own optimizer (ShardedEmbedding(..., optimizer=...))"
            )
        if self.optimizer is None and optimizer.amsgrad:
            raise ValueError(f"table {self.name or name!r}: AMSGrad is not available for table rows; give the table "
                             "its own optimizer (ShardedEmbedding(..., optimizer=...))")
        return TableSpec(name=self.name or name, num_rows=self.num_embeddings, dim=self.embedding_dim,
                         optimizer=optimizer, init=self.init, init_scale=self.init_scale, seed=self.seed)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, sharded"

    def prefetch(self, ids: torch.Tensor, *, with_step: bool = False) -> None:
        """Read the rows of ``ids`` (the next batch's) ahead; the next forward with the same ids
        uses them instead of pulling. Async jobs only. Raises ``ValueError`` in ssp and sync
        jobs, whose reads wait on the bound.

        By default the rows are pulled in the background at once, while this step computes: they
        are read before this step's push lands, so a row both batches touch lacks this worker's
        newest update to it (one step of staleness, measured by the shards like any other).

        ``with_step=True``, called before ``optimizer.step()``: the rows ride on the step's
        push-and-pull instead, read by each shard right after it applied this step's push (no
        staleness of this worker's own, and one call per shard for the step and the next
        batch's rows rather than two). With ``overlap`` (the step runs in the background) the
        rows are pulled in the background as by default."""
        if self._tables is None:
            raise RuntimeError("prefetch needs the model handed to session.prepare first")
        self._tables.prefetch(self, ids, with_step=with_step)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._tables is None:
            raise RuntimeError(
                "this ShardedEmbedding's table lives on the shards: hand its model to session.prepare first "
                "(or train locally with psworker.embedding.localize(model))"
            )
        return self._tables.lookup(self, ids)


def sharded_embeddings(model: nn.Module) -> Iterator[tuple[str, ShardedEmbedding]]:
    """``(path in the model, module)`` of every ``ShardedEmbedding`` in ``model``."""
    for path, module in model.named_modules():
        if isinstance(module, ShardedEmbedding):
            yield path, module


def local_table(module: ShardedEmbedding, name: str, *, chunk_rows: int = 1 << 16) -> nn.Embedding:
    """An ``nn.Embedding(sparse=True)`` holding the initial values of ``module``'s table, named
    ``name`` unless the module has a name (the name picks the initial values' stream)."""
    spec = module.spec_for(OptimizerConfig(name="adagrad", lr=1.0), module.name or name)
    local = nn.Embedding(module.num_embeddings, module.embedding_dim, sparse=True)
    with torch.no_grad():
        for start in range(0, module.num_embeddings, chunk_rows):
            ids = np.arange(start, min(start + chunk_rows, module.num_embeddings), dtype=np.int64)
            local.weight[start:start + ids.size] = torch.from_numpy(initial_rows(spec, ids))
    return local


def localize(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``ShardedEmbedding`` of ``model`` by a local
    ``nn.Embedding(sparse=True)`` with the same initial rows; returns ``model``. Local training
    then needs an optimizer that takes sparse gradients for those (``torch.optim.Adagrad``,
    ``SparseAdam``, or ``SGD`` without momentum)."""
    for path, module in list(sharded_embeddings(model)):
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if not path:
            raise ValueError("the model itself is a ShardedEmbedding: wrap it in a module")
        setattr(parent, attr, local_table(module, path))
    return model


class TableRows:
    """A session's side of its tables: each lookup pulls the batch's distinct rows (from every
    shard at once) into a leaf tensor whose gradient, after backward, is those rows' gradient;
    :meth:`gradients` hands the step's rows to the push, :meth:`clear` forgets them.

    A lookup made while autograd records (a training step) waits on the ssp/sync bound as a pull
    does; one under ``torch.no_grad()`` or in eval mode (an evaluation) reads at once and is not
    pushed.
    """

    def __init__(self, client) -> None:
        self.client = client
        self._lookups: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}
        self._prefetched: dict[str, tuple[torch.Tensor, futures.Future]] = {}
        self._prefetcher: futures.ThreadPoolExecutor | None = None
        self._with_step: dict[str, torch.Tensor] = {}
        """Table -> the distinct ids the next step's push-and-pull reads (``prefetch(with_step=True)``)."""
        self.step_reads_allowed = True
        """False when steps run in the background (overlap): rows announced for the step are
        then pulled in the background at once."""
        self._announced: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        """Table -> (ids, their distinct ids, inverse) of the last prefetch: the lookup of the same
        ids takes them rather than sorting the batch's ids again."""
        self.rows_looked_up = 0
        """Ids looked up for training, repeats included (the unique ratio's denominator)."""
        self.rows_unique = 0
        """Distinct rows those lookups pulled."""

    def lookup(self, module: ShardedEmbedding, ids: torch.Tensor) -> torch.Tensor:
        name = module.name
        announced = self._announced.pop(name, None)
        if announced is not None and _same_ids(announced[0], ids):
            unique, inverse = announced[1], announced[2]
        else:
            unique, inverse = _distinct(module, ids)
        training = module.training and torch.is_grad_enabled()
        ahead = self._prefetched.pop(name, None)
        try:
            if ahead is not None and torch.equal(ahead[0], unique):
                values = ahead[1].result()[name]
            else:
                if ahead is not None:
                    ahead[1].cancel()
                values = self.client.pull_rows({name: unique.numpy()}, wait=training)[name]
        except errors.FencedError as exc:
            # The shards fenced this worker off (evicted, or a shard restored): the step goes on
            # with the rows read as a reader, and its push is dropped by ``optimizer.step()``,
            # which registers again (as when a heartbeat is refused).
            log.warning("%s; this step's rows are read without the registration, its push dropped", exc)
            self.client.fenced.set()
            values = self.client.pull_rows({name: unique.numpy()}, wait=False, as_reader=True)[name]
        rows = torch.from_numpy(values).to(ids.device)
        if training:
            rows.requires_grad_(True)
            self._lookups.setdefault(name, []).append((unique.numpy(), rows))
            self.rows_looked_up += ids.numel()
            self.rows_unique += unique.numel()
        # index_select rather than rows[inverse]: a third of the forward's time, the same gradient.
        return rows.index_select(0, inverse.to(rows.device)).reshape(*ids.shape, module.embedding_dim)

    def prefetch(self, module: ShardedEmbedding, ids: torch.Tensor, *, with_step: bool = False) -> None:
        """:meth:`ShardedEmbedding.prefetch`."""
        if self.client.consistency.mode is not Mode.ASYNC:
            raise ValueError(f"prefetching rows needs an async job, and this one is "
                             f"{self.client.consistency.describe()}: its reads wait on the bound")
        unique, inverse = _distinct(module, ids)
        self._announced[module.name] = (ids.detach().to("cpu", copy=True), unique, inverse)
        if with_step and self.step_reads_allowed:
            self._with_step[module.name] = unique
            return
        if self._prefetcher is None:
            self._prefetcher = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="psworker-rows")
        previous = self._prefetched.pop(module.name, None)
        if previous is not None:
            previous[1].cancel()
        self._prefetched[module.name] = (
            unique, self._prefetcher.submit(self.client.pull_rows, {module.name: unique.numpy()}, wait=False))

    def step_reads(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The rows announced for the next step (table -> (distinct ids, a float32 array their
        values are to be written into)), forgotten here: the step hands them back through
        :meth:`read_with_step` once they are read."""
        reads = {name: (unique.numpy(), np.empty((unique.numel(), self.client.tables[name].dim), dtype=np.float32))
                 for name, unique in self._with_step.items()}
        self._with_step.clear()
        return reads

    def read_with_step(self, reads: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Rows the step read (:meth:`step_reads`, filled in), for the next lookups of those ids."""
        for name, (ids, values) in reads.items():
            done: futures.Future = futures.Future()
            done.set_result({name: values})
            previous = self._prefetched.pop(name, None)
            if previous is not None:
                previous[1].cancel()
            self._prefetched[name] = (torch.from_numpy(ids), done)

    def close(self) -> None:
        """Forget every read ahead and stop the prefetching thread (the session closes)."""
        self.forget_reads()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)

    def gradients(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Table -> ``(ids, gradients)`` of this step's lookups, each id once (the gradients of
        an id looked up twice summed): what the push carries. A table looked up without any
        gradient reaching it is left out."""
        out = {}
        for name, lookups in self._lookups.items():
            blocks = [(ids, rows.grad.detach().to("cpu").numpy()) for ids, rows in lookups if rows.grad is not None]
            if not blocks:
                continue
            out[name] = blocks[0] if len(blocks) == 1 else coalesce(blocks, blocks[0][1].shape[1])
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: the looked-up rows' gradients go, the lookups stay (a loop
        may zero the gradients between its forward and its backward)."""
        for lookups in self._lookups.values():
            for _, rows in lookups:
                if rows.grad is not None:
                    if set_to_none:
                        rows.grad = None
                    else:
                        rows.grad.zero_()

    def clear(self) -> None:
        """Forget this step's lookups (once pushed)."""
        self._lookups.clear()

    def forget_reads(self) -> None:
        """Forget every read ahead (the worker registered again: what was read for the old
        registration is looked up anew)."""
        for _, pending in self._prefetched.values():
            pending.cancel()
        self._prefetched.clear()
        self._with_step.clear()
        self._announced.clear()


def _distinct(module: ShardedEmbedding, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of a lookup (sorted, on the CPU) and where each id of ``ids`` is among
    them. Raises ``TypeError`` / ``IndexError`` for ids that are not integers or not rows."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ShardedEmbedding ids must be int64 or int32, got {ids.dtype}")
    # numpy's unique: half of torch.unique's time on a batch's thousand ids, the same result.
    found, where = np.unique(ids.reshape(-1).to("cpu", torch.int64).numpy(), return_inverse=True)
    unique, inverse = torch.from_numpy(found), torch.from_numpy(where.astype(np.int64, copy=False))
    if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= module.num_embeddings):
        bad = int(unique[0]) if int(unique[0]) < 0 else int(unique[-1])
        raise IndexError(f"table {module.name!r}: id {bad} is out of range for {module.num_embeddings} rows")
    return unique, inverse


def _same_ids(known: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether ``ids`` holds the ids ``known`` (a CPU copy of an earlier batch's) held."""
    if ids.shape != known.shape or ids.dtype != known.dtype:
        return False
    return torch.equal(known, ids if ids.device == known.device else ids.to(known.device))


def table_client(model: nn.Module):
    """The client a model's ``ShardedEmbedding`` tables read through (None without tables, or
    before the model was prepared or pulled)."""
    for _, module in sharded_embeddings(model):
        if module._tables is not None:
            return module._tables.client
    return None


def attach(model: nn.Module, client, job_optimizer: OptimizerConfig) -> tuple[list[TableSpec], TableRows | None]:
    """Name each ``ShardedEmbedding`` of ``model`` (its path unless named), build its spec, and
    route its lookups through one ``TableRows`` of ``client``. Returns the specs (in the model's
    order) and the ``TableRows`` (None without tables). Raises ``ValueError`` for two tables of
    one name or settings tables refuse."""
    found = list(sharded_embeddings(model))
    if not found:
        return [], None
    rows = TableRows(client)
    specs, names = [], set()
    for path, module in found:
        if not path:
            raise ValueError("the model itself is a ShardedEmbedding: wrap it in a module")
        spec = module.spec_for(job_optimizer, module.name or path)
        if spec.name in names:
            raise ValueError(f"two ShardedEmbedding modules are both named {spec.name!r}")
        names.add(spec.name)
        module.name = spec.name
        module._tables = rows
        specs.append(spec)
    return specs, rows
