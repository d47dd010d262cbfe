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

Embedding tables (``psworker.embedding.ShardedEmbedding``) leave with the model: each table is
written as ``"{table name}.weight"``, float32 ``[num_rows, dim]`` (a table's name is its
module's path unless given one, so the key is the one ``localize(model).state_dict()`` has:
``localize(Model()).load_state_dict(load_file(path))`` loads strictly). A table can be larger
than memory (10M x 64 is 2.4 GiB), so a file with tables is written streaming: the header is
computed from the shapes first, then each table is read and written in chunks of at most
``TABLE_CHUNK_ROWS`` rows (``TABLE_CHUNK_BYTES``), the next chunk read while one is written:
from the shards by a reader's ``PullRows`` of each range of ids (a row never written comes back
as its initial value), from a checkpoint by the written rows of its pieces over the initial
values of the others. From running shards, the chunks are read one after the other, each a
consistent read of its rows, not of the whole table. A file without tables is written by
``safetensors`` exactly as before tables existed.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from safetensors.torch import save_file

from pswire import errors
from pswire.codec import Part
from pswire.dtypes import dtype_of
from pswire.placement import Placement
from pswire.tables import TableSpec
from pswire.v1 import ps_pb2
from pswire.wire import rows_from_proto, rows_to_proto, table_from_proto
from psworker.retry import retrying
from psworker.shard import ClientOptions, ShardClient, parse_addresses
from psworker.tensors import torch_dtype

__all__ = [
    "TABLE_CHUNK_BYTES", "TABLE_CHUNK_ROWS", "PulledModel", "StreamedTensor", "export", "load_checkpoint",
    "pull_model", "save_model", "save_model_with_tables", "table_chunk_rows",
]

TABLE_CHUNK_ROWS = 1 << 16
"""The most rows of a table read and written at once."""

TABLE_CHUNK_BYTES = 16 << 20
"""The most bytes of a table's rows read and written at once (fewer rows for a wide table)."""


def table_chunk_rows(spec: TableSpec) -> int:
    """How many rows of ``spec``'s table one chunk holds."""
    return max(1, min(TABLE_CHUNK_ROWS, TABLE_CHUNK_BYTES // spec.row_bytes))


@dataclass(frozen=True)
class StreamedTensor:
    """A float32 tensor that :func:`save_model` writes in chunks of rows, never whole in memory:
    ``read(start, stop)`` gives rows ``[start, stop)`` (a float32 array or tensor of shape
    ``(stop - start, *shape[1:])``), asked for in order, at most ``chunk_rows`` at a time."""

    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray | torch.Tensor]
    chunk_rows: int = TABLE_CHUNK_ROWS

    def __post_init__(self) -> None:
        if not self.shape or any(int(d) < 0 for d in self.shape) or self.chunk_rows < 1:
            raise ValueError(f"a streamed tensor needs a shape of at least one dimension and chunk_rows >= 1, got "
                             f"{list(self.shape)} and {self.chunk_rows}")

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape, dtype=np.int64))


_SAFETENSORS_DTYPES = {
    getattr(torch, name): code for name, code in (
        ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"), ("int64", "I64"),
        ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"), ("uint16", "U16"),
        ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ) if hasattr(torch, name)
}


def save_model(tensors: Mapping[str, torch.Tensor | StreamedTensor], path: str | Path, *,
               metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (a ``state_dict()``, or any name -> tensor map) to ``path`` as a
    safetensors file, atomically: to a temporary name beside it, fsynced, then renamed over
    ``path``, so a reader finds the old file or the whole new one, never part of one.
    ``metadata`` (text only) goes into the file's header beside ``"format": "pt"``.

    Tensors are copied to the CPU where they are elsewhere; ones that share memory (tied
    weights appear under two keys) are each written whole. A :class:`StreamedTensor` value (a
    table) is written in chunks as it is read, the file's header computed from the shapes
    first; without one the file is ``safetensors.torch.save_file``'s. Returns ``path``. Raises
    ``OSError`` when the file cannot be written, ``ValueError`` for a value that is not a tensor
    (or a dtype safetensors has no name for, or rows that do not fit their tensor), and what a
    streamed tensor's ``read`` raises.
    """
    path = Path(path)
    if not path.parent.is_dir():  # before any work, and named as given (not the temporary name)
        raise FileNotFoundError(errno.ENOENT, f"no directory {str(path.parent)!r} to write the model in", str(path))
    plain: dict[str, torch.Tensor | StreamedTensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if isinstance(tensor, StreamedTensor):
            plain[name] = tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name!r} is not a tensor ({type(tensor).__name__})")
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen and tensor.numel():  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        seen.add(storage)
        plain[name] = tensor
    header = {"format": "pt", **(metadata or {})}
    streamed = any(isinstance(t, StreamedTensor) for t in plain.values())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        if streamed:
            with open(tmp, "wb") as f:
                _write_streaming(f, plain, header)
                f.flush()
                os.fsync(f.fileno())
        else:
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


def _write_streaming(f: BinaryIO, tensors: Mapping[str, torch.Tensor | StreamedTensor],
                     metadata: Mapping[str, str]) -> None:
    """A safetensors file into ``f``: 8 bytes of header length (little-endian), the JSON header
    (``__metadata__`` and each tensor's dtype, shape and byte range), padded with spaces to a
    multiple of 8, then the tensors' bytes. Tensors are laid out as safetensors lays them out
    (larger elements first, then by name), so every one is aligned to its element size."""
    if sys.byteorder != "little":
        raise ValueError("safetensors files are little-endian: this machine is not")
    if any(not isinstance(k, str) or not isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map text to text")
    layout = []
    for name, value in tensors.items():
        if name == "__metadata__":
            raise ValueError("a tensor cannot be named __metadata__")
        if isinstance(value, StreamedTensor):
            layout.append((name, "F32", [int(d) for d in value.shape], 4, value.nbytes))
            continue
        code = _SAFETENSORS_DTYPES.get(value.dtype)
        if code is None:
            raise ValueError(f"{name!r}: dtype {value.dtype} has no safetensors name")
        layout.append((name, code, list(value.shape), value.element_size(), value.numel() * value.element_size()))
    layout.sort(key=lambda item: (-item[3], item[0]))
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, code, shape, _, nbytes in layout:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, _, shape, _, nbytes in layout:
        value = tensors[name]
        written = _write_rows(f, name, value) if isinstance(value, StreamedTensor) else _write_bytes(f, value)
        if written != nbytes:  # cannot happen: the header would lie about every tensor after this one
            raise ValueError(f"{name!r}: wrote {written} bytes, its header says {nbytes}")


def _write_bytes(f: BinaryIO, tensor: torch.Tensor) -> int:
    if not tensor.numel():
        return 0
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    f.write(data)
    return data.nbytes


def _write_rows(f: BinaryIO, name: str, value: StreamedTensor) -> int:
    """Write ``value`` chunk by chunk, reading the next chunk while one is written."""
    rows, rest = value.shape[0], tuple(value.shape[1:])
    bounds = [(start, min(start + value.chunk_rows, rows)) for start in range(0, rows, value.chunk_rows)]
    written = 0
    pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="psexport-rows")
    try:
        pending = pool.submit(value.read, *bounds[0]) if bounds else None
        for i, (start, stop) in enumerate(bounds):
            chunk = pending.result()
            pending = pool.submit(value.read, *bounds[i + 1]) if i + 1 < len(bounds) else None
            if isinstance(chunk, torch.Tensor):
                chunk = chunk.detach().to("cpu").numpy()
            chunk = np.asarray(chunk)
            if chunk.dtype != np.float32 or chunk.shape != (stop - start, *rest):
                raise ValueError(f"{name!r}: rows [{start}, {stop}) came as {chunk.dtype}{list(chunk.shape)}, "
                                 f"expected float32{[stop - start, *rest]}")
            data = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
            f.write(data)
            written += data.nbytes
            del chunk, data
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return written


def save_model_with_tables(model: torch.nn.Module, client, path: str | Path, *,
                           metadata: Mapping[str, str] | None = None) -> Path:
    """``psworker --save`` for a model with tables: ``model.state_dict()`` (its dense part), and
    each of its ``ShardedEmbedding`` tables read from the shards by ``client`` (the worker's
    registered ``PSClient``, before it leaves the job) as ``"{module path}.weight"``, the key
    ``localize(model).state_dict()`` has, streamed in chunks (:func:`save_model`). The table is
    read as it is when each chunk is read (``wait=False``: never held on the ssp/sync bound).
    Without tables this is ``save_model(model.state_dict(), ...)``.

    Raises as :func:`save_model` does, ``ValueError`` for a table the client has not registered
    or a key that is also a variable's, and ``pswire.errors`` as the shards answer.
    """
    from psworker.embedding import sharded_embeddings

    entries: dict[str, torch.Tensor | StreamedTensor] = dict(model.state_dict())
    for where, module in sharded_embeddings(model):
        name = module.name or where
        spec = client.tables.get(name)
        if spec is None:
            raise ValueError(f"table {name!r} (the ShardedEmbedding at {where!r}) is not one of the client's "
                             "registered tables: save after session.prepare, before the worker leaves")

        def read(start: int, stop: int, name: str = name) -> np.ndarray:
            return client.pull_rows({name: np.arange(start, stop, dtype=np.int64)}, wait=False)[name]

        _put_table(entries, f"{where}.weight", StreamedTensor((spec.num_rows, spec.dim), read, table_chunk_rows(spec)))
    return save_model(entries, path, metadata=metadata)


def _put_table(entries: dict, key: str, table: StreamedTensor) -> None:
    if key in entries:
        raise ValueError(f"a table would be written as {key!r}, which is also a variable's name")
    entries[key] = table


@dataclass(frozen=True)
class PulledModel:
    """The job's variables as the shards held them when read."""

    tensors: dict[str, torch.Tensor]
    """Whole variables by name (the model's ``state_dict()`` keys), in the shards' dtypes."""
    versions: list[int]
    """Each shard's version of the snapshot read, in shard order."""
    job_fingerprint: str
    tables: tuple[TableSpec, ...] = ()
    """The job's embedding tables (their rows are not in ``tensors``: :func:`export` reads them
    in chunks)."""


def pull_model(ps: str | Sequence[str], options: ClientOptions | None = None) -> PulledModel:
    """Read every variable of the job the shards at ``ps`` hold (every shard, listed in shard
    order), without joining the job: row ranges split across shards are put back together and
    dtypes are kept. With tokens on, a reader's token is enough (``options.security``). The
    job's embedding tables are named (:attr:`PulledModel.tables`), not read.

    Raises ``PreconditionError`` when a shard holds no initialised job, the list is not the
    job's shards in order, or the shards' parts do not make up one job's variables;
    ``UnavailableError`` when a shard cannot be reached; other ``pswire.errors`` as the shards
    answer (``UnauthenticatedError``, ``PermissionDeniedError`` ...); ``ValueError`` for
    malformed addresses.
    """
    with _ShardReader(ps, options) as reader:
        return reader.pull()


class _ShardReader:
    """A reader of the running shards of one job (no registration: worker id 0): their status
    checked on opening, then the dense variables (:meth:`pull`) and any rows of the tables
    (:meth:`rows`)."""

    def __init__(self, ps: str | Sequence[str], options: ClientOptions | None) -> None:
        self.options = options or ClientOptions()
        self.addresses = parse_addresses(ps)
        self.clients = [ShardClient(address, self.options) for address in self.addresses]
        self.pool = futures.ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="psexport")
        try:
            self._each(lambda c: c.wait_connected(self.options.connect_timeout))
            self.statuses = self._each(lambda c: c.status())
            self.held = _check_job(self.addresses, self.statuses)
            self.tables = _check_tables(self.addresses, self.statuses)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "_ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()

    def _each(self, fn, items=None) -> list:
        # Every call carries its own gRPC deadline; this outer bound only guards against a hang.
        items = self.clients if items is None else items
        return [f.result(timeout=self.options.connect_timeout + 3600) for f in [self.pool.submit(fn, i) for i in items]]

    def pull(self) -> PulledModel:
        from psserver.model import layout

        held = self.held
        try:
            pieces = layout(held)
        except ValueError as exc:
            where = ",".join(self.addresses)
            raise errors.PreconditionError(f"the shards at {where} do not hold one model: {exc}") from None
        tensors = {name: torch.empty(found[0][1].full_shape, dtype=torch_dtype(found[0][1].dtype))
                   for name, found in pieces.items()}

        def pull(index: int) -> int:
            client, parts = self.clients[index], held[index]
            destinations = {p.key: tensors[p.name] if p.is_whole else tensors[p.name][p.row_start:p.row_end]
                            for p in parts}
            # worker_id 0: a reader's pull, which never waits on the consistency bound.
            request = ps_pb2.PullRequest(worker_id=0, clock=-1)
            header, written = client.pull(request, destinations, sum(p.nbytes for p in parts))
            if set(written) != set(destinations):
                raise errors.PreconditionError(f"shard {client.address} sent {sorted(written)} of its parts "
                                               f"{sorted(destinations)}: its job changed while it was read")
            return header.version

        versions = self._each(pull, range(len(self.clients)))
        return PulledModel(tensors, versions, self.statuses[0].job_fingerprint, self.tables)

    def rows(self, spec: TableSpec, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of table ``spec``, float32 ``[stop - start, dim]``, each shard's
        read side by side (a reader's ``PullRows``: never held on the consistency bound)."""
        n = len(self.clients)
        out = np.empty((stop - start, spec.dim), dtype=np.float32)

        def one(shard: int) -> None:
            mine = np.arange(start + (shard - start) % n, stop, n, dtype=np.int64)  # row i is on shard i % n
            if not mine.size:
                return
            client = self.clients[shard]
            request = ps_pb2.PullRowsRequest(worker_id=0, clock=-1, rows=[rows_to_proto(spec.name, mine)])
            reply = retrying(lambda: client.pull_rows(request, mine.size * spec.row_bytes, may_wait=False),
                             self.options, client.address, f"read rows of table {spec.name!r}")
            got = [rows_from_proto(block, spec.dim) for block in reply.rows if block.table == spec.name]
            if len(got) != 1 or not np.array_equal(got[0][0], mine):
                raise errors.PreconditionError(f"shard {client.address} answered other rows of table {spec.name!r} "
                                               "than asked for")
            out[mine - start] = got[0][1]

        self._each(one, range(n))
        return out


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


def _check_tables(addresses: list[str], statuses: list[ps_pb2.StatusResponse]) -> tuple[TableSpec, ...]:
    """The job's embedding tables, which every shard must list alike."""
    try:
        listed = [tuple(table_from_proto(t.spec) for t in s.tables) for s in statuses]
    except errors.InvalidArgumentError as exc:
        raise errors.PreconditionError(f"a shard lists a table that cannot be: {exc}") from None
    if any(tables != listed[0] for tables in listed[1:]):
        raise errors.PreconditionError(f"the shards at {','.join(addresses)} list different embedding tables")
    return listed[0]


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

    Each embedding table comes whole, as ``"{table name}.weight"`` float32 ``[num_rows, dim]``
    (the key of ``localize(model).state_dict()``): its written rows from the checkpoint, the
    others their initial values. That is ``num_rows * dim * 4`` bytes per table in memory, on
    top of the checkpoint's own arrays while it is read (a 10M x 64 table is 2.4 GiB): for a
    file, ``psctl export --checkpoint`` writes tables in chunks instead. The tables' optimizer
    state is not read.

    Raises ``CheckpointError`` (``psserver.checkpoint``) naming the problem: no such directory,
    no checkpoint, an incomplete one (a shard's part missing or unfinished), a damaged one (a
    file whose size or sha256 is not its manifest's).
    """
    from psserver.checkpoint import CheckpointError
    from psserver.model import read_checkpoint

    model = read_checkpoint(path, checkpoint_id=checkpoint_id, optimizer=optimizer)
    out = {name: _tensor(array) for name, array in model.variables.items()}
    for name, table in model.tables.items():
        if f"{name}.weight" in out:
            raise CheckpointError(f"checkpoint {model.checkpoint_id}: table {name!r} would come as "
                                  f"{name + '.weight'!r}, which is also a variable's name")
        out[f"{name}.weight"] = torch.from_numpy(table.array(chunk_rows=table_chunk_rows(table.spec)))
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
    say what was written. Each embedding table is written as ``"{table name}.weight"``, read
    and written in chunks (the module docstring). Raises as those two do, ``OSError`` when
    ``out`` cannot be written, and ``ValueError`` unless exactly one source is given."""
    if (ps is None) == (checkpoint is None):
        raise ValueError("export from the shards (--ps) or from a checkpoint directory (--checkpoint), one of them")
    if checkpoint_id is not None and checkpoint is None:
        raise ValueError("--id names a checkpoint to read with --checkpoint; the shards are read as they are now")
    if not Path(out).resolve().parent.is_dir():
        raise ValueError(f"--out {out}: its directory does not exist")
    entries: dict[str, torch.Tensor | StreamedTensor] = {}
    if ps is not None:
        with _ShardReader(ps, options) as reader:
            pulled = reader.pull()
            entries.update(pulled.tensors)
            for spec in pulled.tables:
                _put_table(entries, f"{spec.name}.weight", StreamedTensor(
                    (spec.num_rows, spec.dim), functools.partial(reader.rows, spec), table_chunk_rows(spec)))
            source = f"{len(pulled.versions)} shard(s) at versions {pulled.versions}"
            metadata = {"source": "shards", "job": pulled.job_fingerprint,
                        "versions": ",".join(map(str, pulled.versions))}
            tables = [spec.name for spec in pulled.tables]
            if tables:
                metadata["tables"] = json.dumps(tables)
            save_model(entries, out, metadata=metadata)  # while the shards are open: tables are read now
    else:
        from psserver.model import read_checkpoint

        model = read_checkpoint(checkpoint, checkpoint_id=checkpoint_id)
        entries.update((name, _tensor(array)) for name, array in model.variables.items())
        for name, table in model.tables.items():
            _put_table(entries, f"{name}.weight", StreamedTensor(table.shape, table.rows, table_chunk_rows(table.spec)))
        source = f"checkpoint {model.checkpoint_id} ({model.num_shards} part(s), {model.path})"
        metadata = {"source": "checkpoint", "checkpoint_id": str(model.checkpoint_id)}
        tables = list(model.tables)
        if tables:
            metadata["tables"] = json.dumps(tables)
        save_model(entries, out, metadata=metadata)
    nbytes = sum(t.nbytes if isinstance(t, StreamedTensor) else t.numel() * t.element_size() for t in entries.values())
    what = f"{len(entries) - len(tables)} variables" + (f" and {len(tables)} table(s)" if tables else "")
    return f"wrote {what} ({nbytes} bytes) from {source} to {out}"
