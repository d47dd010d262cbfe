"""A shard's state as checkpoint content (tensors + JSON metadata) and back.

``encode`` runs under the store's lock, so a snapshot never holds half of a push. ``decode``
verifies everything (every part present with its dtype and shape, every optimizer state against
the job's update rule, the job's settings) and returns fresh records; the store swaps them in
only once all is verified.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pswire.codec import Part, dtype_name
from pswire.dtypes import dtype_of
from pswire.errors import InvalidArgumentError
from pswire.consistency import Consistency
from pswire.optim import OptimizerConfig
from pswire.tables import TableSpec, coalesce
from psserver.consistency import PushAction
from psserver.job import MAX_COUNT, Registration
from psserver.optimizers import UpdateRule, create_update_rule
from psserver.state import Counters, PushResult, Slot, SyncClock, Worker
from psserver.tables import RowTable

__all__ = ["FORMAT", "Decoded", "Position", "decode", "encode", "encode_job"]

FORMAT = 1


def encode_job(job: Registration) -> dict[str, Any]:
    return {
        "shard_index": job.shard_index,
        "num_shards": job.num_shards,
        "placement_digest": job.placement_digest,
        "job_fingerprint": job.job_fingerprint,
        "optimizer": job.optimizer.to_dict(),
        "consistency": {
            "mode": job.consistency.mode.value, "staleness": job.consistency.staleness,
            "backup_workers": job.consistency.backup_workers,
            "stale_policy": job.consistency.stale_policy.value,
        },
        "parts": [[p.name, list(p.full_shape), dtype_name(p.dtype), p.row_start, p.row_end] for p in job.parts],
        "tables": [t.to_dict() for t in job.tables],
    }


def _decode_job(doc: dict[str, Any]) -> Registration:
    parts = []
    for name, shape, dtype, start, end in doc["parts"]:
        try:
            dtype = dtype_of(str(dtype))
        except InvalidArgumentError:
            raise ValueError(f"unknown dtype {dtype!r} for {name!r}") from None
        parts.append(Part(name, tuple(int(d) for d in shape), dtype, int(start), int(end)))
    return Registration(
        worker_name="(checkpoint)",
        shard_index=int(doc["shard_index"]),
        num_shards=int(doc["num_shards"]),
        placement_digest=str(doc["placement_digest"]),
        parts=tuple(parts),
        optimizer=OptimizerConfig.from_dict(doc["optimizer"]),
        job_fingerprint=str(doc["job_fingerprint"]),
        consistency=Consistency(**doc["consistency"]),
        tables=tuple(TableSpec.from_dict(t) for t in doc.get("tables", [])),
    )


@dataclass(frozen=True)
class Position:
    """Where a shard stands, beside its records."""

    version: int
    clock: int
    clock_floor: int
    open_clock: int
    next_worker_id: int


def encode(
    job: Registration, slots: Mapping[str, Slot], sync: SyncClock, workers: Mapping[str, Worker],
    counters: Counters, position: Position, tables: Mapping[str, RowTable] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Copies of every array of the state, by name, and the metadata beside them (caller
    holds the store's lock). A table's written rows go in pieces ``rows/NNNNN/...`` (each at
    most ``psserver.tables.PIECE_BYTES``, a file of its own in the checkpoint), and its open
    sync clock's gradients, summed per row, under ``syncrows/<table index>/``."""
    tensors: dict[str, np.ndarray] = {}
    table_docs, piece_number = [], 0
    for index, spec in enumerate(job.tables):
        table = (tables or {})[spec.name]
        pieces = table.pieces()
        for piece in pieces:
            for name, array in piece.items():
                tensors[f"rows/{piece_number:05d}/{name}"] = array
            piece_number += 1
        table_docs.append({"name": spec.name, "step": table.step, "pieces": len(pieces),
                           "rows_pushed": table.rows_pushed, "rows_pulled": table.rows_pulled})
        blocks = sync.rows.get(spec.name)
        if blocks is not None:
            ids, sums = coalesce(blocks, spec.dim)
            tensors[f"syncrows/{index}/ids"], tensors[f"syncrows/{index}/grads"] = ids, sums
    for key, slot in slots.items():
        tensors[f"var/{key}"] = slot.value.copy()
        for name, t in slot.state.items():
            tensors[f"opt/{key}/{name}"] = t.copy()
    for key, total in sync.sums.items():
        tensors[f"sum/{key}"] = total.copy()
    metadata = {
        "format": FORMAT,
        "job": encode_job(job),
        "version": position.version,
        "clock": position.clock,
        "clock_floor": position.clock_floor,
        "open_clock": position.open_clock,
        "received": sync.received,
        "contributors": sorted(sync.contributors),
        "counts": dict(sync.counts),
        "slot_versions": {k: s.version for k, s in slots.items()},
        "next_worker_id": position.next_worker_id,
        "workers": [
            {"name": w.name, "id": w.worker_id, "generation": w.generation, "clock": w.clock,
             "live": w.live, "evicted": w.evicted, "pushes": w.pushes, "max_sequence": w.max_sequence,
             "applied": [[q, r.version, r.staleness, r.action.value] for q, r in w.applied.items()],
             "data": w.data}
            for w in workers.values()
        ],
        "counters": counters.checkpointed(),
        "tables": table_docs,
    }
    return tensors, metadata


@dataclass
class Decoded:
    job: Registration
    rule: UpdateRule
    slots: dict[str, Slot]
    sync: SyncClock
    workers: dict[str, Worker]
    """Every worker the checkpoint knew, fenced: each must re-register."""
    position: Position
    counters: dict[str, Any]
    """What :meth:`Counters.checkpointed` wrote, for :meth:`Counters.restore`."""
    tables: dict[str, RowTable]


def _check_counts(metadata: dict[str, Any]) -> None:
    """Raises ``ValueError`` for a count that no shard could have reached (``job.MAX_COUNT``):
    a checkpoint never brings back a value that would break the restored shard."""
    counts = [(k, metadata.get(k, 0)) for k in ("version", "clock", "clock_floor", "open_clock", "received",
                                                   "next_worker_id")]
    counts += [(f"version of {k!r}", v) for k, v in metadata["slot_versions"].items()]
    for w in metadata["workers"]:
        counts += [(f"{k} of worker {w.get('name')!r}", w.get(k, 0))
                   for k in ("id", "generation", "clock", "pushes", "max_sequence")]
        counts += [(f"data {k} of worker {w.get('name')!r}", v) for k, v in (w.get("data") or {}).items()]
    for what, value in counts:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
            raise ValueError(f"metadata's {what} is {value!r}, not a count in 0..{MAX_COUNT}")


def decode(tensors: dict[str, np.ndarray], metadata: dict[str, Any], *, now: float, source: str) -> Decoded:
    """Check a checkpoint part for completeness and consistency, and rebuild the store's records
    from copies of its tensors; ``now`` (the store's clock) starts each worker's lease, and the
    workers are fenced as restored from ``source``. Raises ``ValueError`` naming the first
    problem."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {metadata.get('format')!r}, this shard reads format {FORMAT}")
    job = _decode_job(metadata["job"])
    values, states, sums = {}, {}, {}
    for part in job.parts:
        value = tensors.get(f"var/{part.key}")
        if value is None:
            raise ValueError(f"variable {part.key!r} is missing")
        if value.dtype != part.dtype.numpy or tuple(value.shape) != part.shape:
            raise ValueError(
                f"variable {part.key!r} is {value.dtype}{list(value.shape)}, expected {part.dtype}{list(part.shape)}"
            )
        values[part.key] = value
        prefix = f"opt/{part.key}/"
        states[part.key] = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        if f"sum/{part.key}" in tensors:
            sums[part.key] = tensors[f"sum/{part.key}"].copy()
    for key in ("version", "clock_floor", "open_clock", "received", "workers", "slot_versions", "next_worker_id"):
        if key not in metadata:
            raise ValueError(f"metadata lacks {key!r}")
    if set(metadata["slot_versions"]) != set(values):
        raise ValueError("metadata's part versions do not match the variables")
    _check_counts(metadata)
    rule = create_update_rule(job.optimizer)
    for key, state in states.items():
        fresh = rule.init_state(values[key])
        if set(state) != set(fresh):
            raise ValueError(f"optimizer state of {key!r} has {sorted(state)}, expected {sorted(fresh)}")
        for name, t in state.items():
            if t.dtype != fresh[name].dtype or t.shape != fresh[name].shape:
                raise ValueError(f"optimizer state {name!r} of {key!r} has the wrong dtype or shape")
    slots = {
        p.key: Slot(p, values[p.key].copy(), {n: t.copy() for n, t in states[p.key].items()},
                    int(metadata["slot_versions"][p.key]))
        for p in job.parts
    }
    workers = {}
    for w in metadata["workers"]:
        worker = Worker(int(w["id"]), str(w["name"]), int(w["generation"]), clock=int(w["clock"]),
                        live=False, evicted=False, pushes=int(w["pushes"]), heard_at=now,
                        fenced=f"the shard was restored from {source}", data=dict(w.get("data") or {}))
        worker.max_sequence = int(w["max_sequence"])
        worker.applied = {int(q): PushResult(int(v), int(st), PushAction(a)) for q, v, st, a in w["applied"]}
        workers[worker.name] = worker
    sync = SyncClock(
        sums, {k: int(v) for k, v in metadata.get("counts", {}).items()}, int(metadata["received"]),
        {str(n) for n in metadata.get("contributors", [])} & set(workers),
    )
    position = Position(
        version=int(metadata["version"]), clock=int(metadata.get("clock", metadata["clock_floor"])),
        clock_floor=int(metadata["clock_floor"]), open_clock=int(metadata["open_clock"]),
        next_worker_id=int(metadata["next_worker_id"]),
    )
    return Decoded(job, rule, slots, sync, workers, position, dict(metadata.get("counters", {})),
                   _decode_tables(job, tensors, metadata, sync))


def _decode_tables(job: Registration, tensors: dict[str, np.ndarray], metadata: dict[str, Any],
                   sync: SyncClock) -> dict[str, RowTable]:
    """The job's tables rebuilt from a checkpoint's pieces (every row checked), and the open sync
    clock's row gradients put back into ``sync``. Raises ``ValueError`` naming the problem."""
    docs = metadata.get("tables", [])
    if [d.get("name") for d in docs] != [t.name for t in job.tables]:
        raise ValueError("metadata's tables do not match the job's")
    pieces: dict[int, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        if key.startswith("rows/"):
            _, number, name = (key.split("/", 2) + ["", ""])[:3]
            if not (number.isdigit() and name):
                raise ValueError(f"tensor {key!r} is not a table piece's (rows/NNNNN/name)")
            pieces.setdefault(int(number), {})[name] = array
    tables, number = {}, 0
    for index, (spec, doc) in enumerate(zip(job.tables, docs)):
        table = RowTable(spec, job.shard_index, job.num_shards)
        for value in (doc.get("step"), doc.get("pieces"), doc.get("rows_pushed", 0), doc.get("rows_pulled", 0)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
                raise ValueError(f"metadata of table {spec.name!r} holds {value!r}, not a count")
        table.step, table.rows_pushed, table.rows_pulled = doc["step"], doc["rows_pushed"], doc["rows_pulled"]
        for _ in range(doc["pieces"]):
            piece = pieces.pop(number, None)
            if piece is None:
                raise ValueError(f"table {spec.name!r}: piece {number} is missing")
            table.load(piece)
            number += 1
        ids, grads = tensors.get(f"syncrows/{index}/ids"), tensors.get(f"syncrows/{index}/grads")
        if ids is not None and grads is not None:
            table.locate(ids, unique=True)
            if grads.dtype != np.float32 or grads.shape != (ids.size, spec.dim) or not np.isfinite(grads).all():
                raise ValueError(f"table {spec.name!r}: the open sync clock's gradients are damaged")
            sync.rows[spec.name] = [(ids.copy(), grads.copy())]
        tables[spec.name] = table
    if pieces:
        raise ValueError(f"pieces {sorted(pieces)} belong to no table")
    return tables
