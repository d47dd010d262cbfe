"""Reads and pushes of embedding-table rows, planned across a job's shards: which shard owns
each id (``pswire.tables.owner``, a pure function of the id and the shard count), the calls
that carry each shard's share (no larger than one reply), and each reply checked against what
was asked before its values are written out. No sockets and no sessions: ``psworker.client.PSClient``
sends the calls this module plans.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from pswire import errors
from pswire.tables import TableSpec, owner
from pswire.v1 import ps_pb2
from pswire.wire import rows_from_proto, rows_to_proto

__all__ = ["Identity", "PlannedTable", "RowsCall", "plan_rows", "row_blocks", "rows_calls", "write_rows"]


class PlannedTable(NamedTuple):
    """One table of a rows read."""

    table: str
    spec: TableSpec
    ids: np.ndarray
    """The ids asked for (int64, each once), in the order their values are written out."""
    where: np.ndarray
    """The shard that owns each id."""


class RowsCall(NamedTuple):
    """One ``PullRows`` call to one shard."""

    request: ps_pb2.PullRowsRequest
    blocks: list[tuple[str, TableSpec, np.ndarray]]
    """Per table block of the request: (table, spec, positions of its ids in the table's ``ids``)."""
    nbytes: int
    """Bytes of row values the reply carries."""


class Identity(NamedTuple):
    """The registration a training read is made as (its worker id, generation and session secret)."""

    worker_id: int
    generation: int
    secret: bytes


def _known(tables: Mapping[str, TableSpec], table: str) -> TableSpec:
    spec = tables.get(table)
    if spec is None:
        raise ValueError(f"unknown table {table!r}: register it first")
    return spec


def plan_rows(tables: Mapping[str, TableSpec], num_shards: int, requests: Mapping[str, np.ndarray]) -> list[PlannedTable]:
    """The plan of a rows read (table -> ids) over ``num_shards`` shards; raises ``ValueError``
    for a table not in ``tables``."""
    plan = []
    for table, ids in requests.items():
        spec = _known(tables, table)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        plan.append(PlannedTable(table, spec, ids, owner(ids, num_shards)))
    return plan


def rows_calls(plan: list[PlannedTable], shard: int, *, identity: Identity | None, clock: int, limit: int,
               ) -> list[RowsCall]:
    """Shard ``shard``'s rows of every table of ``plan``, packed into calls of at most ``limit``
    bytes of values (below the shards' own limit on a reply). ``identity``: the registration the
    read is made as (None: as a reader, with none). A shard with no rows gets no call."""
    out: list[RowsCall] = []
    blocks: list[tuple[PlannedTable, np.ndarray]] = []
    nbytes = 0

    def flush() -> None:
        request = ps_pb2.PullRowsRequest(rows=[rows_to_proto(t.table, t.ids[piece]) for t, piece in blocks],
                                         clock=clock)
        if identity is not None:
            request.worker_id, request.generation, request.session = identity
        out.append(RowsCall(request, [(t.table, t.spec, piece) for t, piece in blocks], nbytes))

    for planned in plan:
        positions = np.flatnonzero(planned.where == shard)
        row_bytes = planned.spec.row_bytes
        step = max(1, limit // row_bytes)
        for start in range(0, positions.size, step):
            piece = positions[start:start + step]
            if blocks and nbytes + piece.size * row_bytes > limit:
                flush()
                blocks, nbytes = [], 0
            blocks.append((planned, piece))
            nbytes += piece.size * row_bytes
    if blocks:
        flush()
    return out


def write_rows(address: str, reply: ps_pb2.PullRowsResponse, call: RowsCall,
               out: Mapping[str, np.ndarray]) -> None:
    """Write a rows reply's values into ``out`` (table -> values of the plan's ids), once it is
    checked to answer ``call``; raises ``InvalidArgumentError`` for a reply that does not."""
    if len(reply.rows) != len(call.blocks):
        raise errors.InvalidArgumentError(f"shard {address} answered {len(reply.rows)} tables' rows "
                                          f"for {len(call.blocks)}")
    for (table, spec, piece), block, sent in zip(call.blocks, reply.rows, call.request.rows):
        _, values = rows_from_proto(block, spec.dim)
        if block.table != table or block.ids != sent.ids:  # the ids' bytes as asked, in order
            raise errors.InvalidArgumentError(f"shard {address} answered other rows of "
                                              f"table {table!r} than asked for")
        out[table][piece] = values


def row_blocks(tables: Mapping[str, TableSpec], num_shards: int,
               rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None) -> list[list[ps_pb2.RowBlock]]:
    """Each shard's ``RowBlock`` messages of a push's ``rows`` (table -> (ids, gradients)). Every
    table of ``rows`` gets a block on every shard, an empty one where none of its rows lives
    there, so that each shard counts the table's step. Raises ``ValueError`` for a table not in
    ``tables``."""
    out: list[list[ps_pb2.RowBlock]] = [[] for _ in range(num_shards)]
    for table, (ids, values) in (rows or {}).items():
        _known(tables, table)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        values = np.ascontiguousarray(values, dtype=np.float32)
        where = owner(ids, num_shards)
        for shard in range(num_shards):
            mask = where == shard
            out[shard].append(rows_to_proto(table, ids[mask], values[mask]))
    return out
