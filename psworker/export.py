"""The trained model's way out (DESIGN §9): safetensors files named by the model's ``state_dict()``
keys, from a worker at the end (``psworker --save``), from the running shards (``psctl export
--ps``, ``pscluster --save``) or from a checkpoint directory with no shard running (``psctl
export --checkpoint``, :func:`load_checkpoint`)::

    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

The shards hold the model's parameters only, under their ``named_parameters()`` names (which are
their ``state_dict()`` keys); buffers such as BatchNorm statistics stay on each worker, so a
file read from the shards or a checkpoint has no buffers (``load_state_dict(..., strict=False)``
for a model that has some), and a worker's own file has that worker's.

Reading the shards needs no task and no registration: their status names every part they hold
(name, whole shape, dtype, row range), and a reader's pull (``worker_id`` 0, the reader role
when tokens are on) reads each shard's variables as one consistent snapshot. Shards are read
side by side, not at one instant: while workers still push, the file mixes versions a few steps
apart (stop the workers first, or write a checkpoint, for an exact cut).
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pswire import errors
from pswire.codec import Part
from pswire.dtypes import dtype_of
from pswire.placement import Placement
from pswire.v1 import ps_pb2
from psworker.shard import ClientOptions, ShardClient, parse_addresses
from psworker.tensors import torch_dtype

__all__ = ["PulledModel", "export", "load_checkpoint", "pull_model", "save_model"]


def save_model(tensors: Mapping[str, torch.Tensor], path: str | Path, *,
               metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (a ``state_dict()``, or any name -> tensor map) to ``path`` as a
    safetensors file, atomically: to a temporary name beside it, fsynced, then renamed over
    ``path``, so a reader finds the old file or the whole new one, never part of one.
    ``metadata`` (text only) goes into the file's header beside ``"format": "pt"``.

    Tensors are copied to the CPU where they are elsewhere; ones that share memory (tied
    weights appear under two keys) are each written whole. Returns ``path``. Raises ``OSError``
    when the file cannot be written, ``ValueError`` for a value that is not a tensor.
    """
    path = Path(path)
    if not path.parent.is_dir():  # before any work, and named as given (not the temporary name)
        raise FileNotFoundError(errno.ENOENT, f"no directory {str(path.parent)!r} to write the model in", str(path))
    plain: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name!r} is not a tensor ({type(tensor).__name__})")
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen and tensor.numel():  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        seen.add(storage)
        plain[name] = tensor
    header = {"format": "pt", **(metadata or {})}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        save_file(plain, tmp, metadata=header)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    except OSError:
        pass  # some network filesystems cannot fsync a directory
    finally:
        os.close(fd)
    return path


@dataclass(frozen=True)
class PulledModel:
    """The job's variables as the shards held them when read."""

    tensors: dict[str, torch.Tensor]
    """Whole variables by name (the model's ``state_dict()`` keys), in the shards' dtypes."""
    versions: list[int]
    """Each shard's version of the snapshot read, in shard order."""
    job_fingerprint: str


def pull_model(ps: str | Sequence[str], options: ClientOptions | None = None) -> PulledModel:
    """Read every variable of the job the shards at ``ps`` hold (every shard, listed in shard
    order), without joining the job: row ranges split across shards are put back together and
    dtypes are kept. With tokens on, a reader's token is enough (``options.security``).

    Raises ``PreconditionError`` when a shard holds no initialised job, the list is not the
    job's shards in order, or the shards' parts do not make up one job's variables;
    ``UnavailableError`` when a shard cannot be reached; other ``pswire.errors`` as the shards
    answer (``UnauthenticatedError``, ``PermissionDeniedError`` ...); ``ValueError`` for
    malformed addresses.
    """
    from psserver.model import layout

    options = options or ClientOptions()
    addresses = parse_addresses(ps)
    clients = [ShardClient(address, options) for address in addresses]
    pool = futures.ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="psexport")
    try:
        def each(fn):
            # Every call carries its own gRPC deadline; this outer bound only guards against a hang.
            return [f.result(timeout=options.connect_timeout + 3600) for f in [pool.submit(fn, c) for c in clients]]

        each(lambda c: c.wait_connected(options.connect_timeout))
        statuses = each(lambda c: c.status())
        held = _check_job(addresses, statuses)
        try:
            pieces = layout(held)
        except ValueError as exc:
            where = ",".join(addresses)
            raise errors.PreconditionError(f"the shards at {where} do not hold one model: {exc}") from None
        tensors = {name: torch.empty(found[0][1].full_shape, dtype=torch_dtype(found[0][1].dtype))
                   for name, found in pieces.items()}

        def pull(index: int) -> int:
            client, parts = clients[index], held[index]
            destinations = {p.key: tensors[p.name] if p.is_whole else tensors[p.name][p.row_start:p.row_end]
                            for p in parts}
            # worker_id 0: a reader's pull, which never waits on the consistency bound.
            request = ps_pb2.PullRequest(worker_id=0, clock=-1)
            header, written = client.pull(request, destinations, sum(p.nbytes for p in parts))
            if set(written) != set(destinations):
                raise errors.PreconditionError(f"shard {client.address} sent {sorted(written)} of its parts "
                                               f"{sorted(destinations)}: its job changed while it was read")
            return header.version

        versions = [f.result(timeout=options.connect_timeout + 3600)
                    for f in [pool.submit(pull, i) for i in range(len(clients))]]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for client in clients:
            client.close()
    return PulledModel(tensors, versions, statuses[0].job_fingerprint)


def _check_job(addresses: list[str], statuses: list[ps_pb2.StatusResponse]) -> list[tuple[Part, ...]]:
    """The parts each shard holds, once every status says that the list is one job's shards in
    order, each with its variables initialised; raises ``PreconditionError`` naming what is not."""
    for i, (address, s) in enumerate(zip(addresses, statuses)):
        if s.state != "ready":
            raise errors.PreconditionError(f"shard {address} holds no model to read (state {s.state or 'empty'}): "
                                           "no job, or its first worker has not initialised it yet")
        if (s.shard_index, s.num_shards) != (i, len(addresses)):
            raise errors.PreconditionError(
                f"shard {address} is shard {s.shard_index} of {s.num_shards}, listed as {i} of {len(addresses)}: "
                "give every shard of the job, in shard order"
            )
    if len({s.placement_digest for s in statuses}) != 1 or len({s.job_fingerprint for s in statuses}) != 1:
        raise errors.PreconditionError(f"the shards at {','.join(addresses)} hold different jobs")
    held = [tuple(Part.from_proto(p) for p in s.parts) for s in statuses]
    if Placement(len(held), tuple(held)).digest() != statuses[0].placement_digest:
        raise errors.PreconditionError("the parts the shards list do not make up their job's placement")
    return held


def load_checkpoint(path: str | Path, *, checkpoint_id: int | None = None,
                    optimizer: bool = False) -> dict[str, torch.Tensor]:
    """The model in a shard checkpoint, read with no shard running, as CPU tensors named by the
    model's ``state_dict()`` keys (parameters only: buffers stay on the workers):
    ``model.load_state_dict(psworker.load_checkpoint("/ckpt"))``.

    ``path`` is the checkpoint root (given to ``psserver --checkpoint-dir``; the newest complete
    checkpoint is read, or ``checkpoint_id``) or one checkpoint's ``ckpt-{id}`` directory. Every
    part is verified (sizes, sha256) first, and row-split variables are put back together.
    ``optimizer``: also the update rule's state, as ``"opt/{variable}/{state}"`` entries beside
    the variables (e.g. ``opt/0.weight/exp_avg``; the shards' own naming; leave them out of
    ``load_state_dict``). bfloat16 variables come back as ``torch.bfloat16``.

    Raises ``CheckpointError`` (``psserver.checkpoint``) naming the problem: no such directory,
    no checkpoint, an incomplete one (a shard's part missing or unfinished), a damaged one (a
    file whose size or sha256 is not its manifest's).
    """
    from psserver.model import read_checkpoint

    model = read_checkpoint(path, checkpoint_id=checkpoint_id, optimizer=optimizer)
    out = {name: _tensor(array) for name, array in model.variables.items()}
    for name, states in model.optimizer.items():
        out.update({f"opt/{name}/{state}": _tensor(array) for state, array in states.items()})
    return out


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s memory (no copy), for every dtype a shard holds: numpy knows
    bfloat16 only through ml_dtypes, which torch does not read, so the bytes are reinterpreted."""
    dtype = torch_dtype(dtype_of(array.dtype))
    flat = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return flat.view(dtype).reshape(array.shape)


def export(out: str | Path, *, ps: str | None = None, checkpoint: str | Path | None = None,
           checkpoint_id: int | None = None, options: ClientOptions | None = None) -> str:
    """``psctl export``: write the model from the running shards at ``ps`` (:func:`pull_model`)
    or from the checkpoint directory ``checkpoint`` (:func:`load_checkpoint`) to ``out``, and
    say what was written. Raises as those two do, ``OSError`` when ``out`` cannot be written,
    and ``ValueError`` unless exactly one source is given."""
    if (ps is None) == (checkpoint is None):
        raise ValueError("export from the shards (--ps) or from a checkpoint directory (--checkpoint), one of them")
    if checkpoint_id is not None and checkpoint is None:
        raise ValueError("--id names a checkpoint to read with --checkpoint; the shards are read as they are now")
    if not Path(out).resolve().parent.is_dir():
        raise ValueError(f"--out {out}: its directory does not exist")
    if ps is not None:
        pulled = pull_model(ps, options)
        tensors, source = pulled.tensors, f"{len(pulled.versions)} shard(s) at versions {pulled.versions}"
        metadata = {"source": "shards", "job": pulled.job_fingerprint, "versions": ",".join(map(str, pulled.versions))}
    else:
        from psserver.model import read_checkpoint

        model = read_checkpoint(checkpoint, checkpoint_id=checkpoint_id)
        tensors = {name: _tensor(array) for name, array in model.variables.items()}
        source = f"checkpoint {model.checkpoint_id} ({model.num_shards} part(s), {model.path})"
        metadata = {"source": "checkpoint", "checkpoint_id": str(model.checkpoint_id)}
    save_model(tensors, out, metadata=metadata)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return f"wrote {len(tensors)} variables ({nbytes} bytes) from {source} to {out}"
