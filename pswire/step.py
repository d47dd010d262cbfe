"""The lean step call, ``Step``: an async worker's whole step with one shard (its push, the
variables pulled after it and the next batch's table rows) as one fixed binary layout that a bulk
lane carries whole (``pswire.lanes.LANE_METHODS``), in place of protobuf's ``PushPull``.

A step's ``PushPull`` spends most of its CPU, on both sides, on what is the same every step: the
header names every part the push carries and the pull lists every part it sends back, each
variable travels as a message field of its own, and the reply's rows are one more message. Here
the push carries every part this shard holds, end to end in the job's order (or none: a push of
rows alone), the reply carries every part's values the same way, and each table's rows are raw
arrays; both sides know the parts from the registration, so nothing names them. The shard makes
every check ``PushPull`` makes (the lane's session, fencing, the exactly-once sequence, sizes
against the job, the finite screen); a request that does not parse is refused whole
(INVALID_ARGUMENT), before anything is applied.

Request body (little-endian; ``REQUEST``):

- worker id (u64), generation (u64), sequence (u64), base version (i64), clock (i64), base clock
  (i64), the session's length (u16), the number of tables (u16), whether the worker's progress
  follows (u8, then 5 bytes of padding), its progress (step, epoch, position: u64 each, as
  ``TensorHeader.data``), the dense gradient's length (u64);
- the session (``RegisterResponse.session``);
- the dense gradient: every part this shard holds, in the job's order, each in its own dtype
  (length 0: the push carries rows only);
- per table (``TABLE``): the name's length (u16), whether the push carries the table (u8: a
  table pushed with no rows here still counts its step, as an empty ``RowBlock`` does; then a
  byte of padding), the rows' width ``dim`` (u32), the rows pushed (u32, 0 when not pushed), the
  rows read (u32); then the name (UTF-8), the pushed ids (int64, each once), their gradients
  (float32, ``dim`` each) and the ids to read once the push is applied (int64).

Reply body (``REPLY``): the push's version (i64) and staleness (i64), its action (u8, an index
into ``ACTIONS``), the version and clock (i64 each) of the state read after it, the length of
the values that follow (u64); then every part's values end to end (when the shard holds any),
then per table of the request, in its order, the rows read (float32, ``dim`` each).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["ACTIONS", "REPLY", "REQUEST", "TABLE", "StepReply", "StepRequest", "StepRows", "decode_reply",
           "decode_request", "encode_reply", "encode_request", "owner_of"]

REQUEST = struct.Struct("<QQQqqqHHB5xQQQQ")
TABLE = struct.Struct("<HBxIII")
REPLY = struct.Struct("<qqB7xqqQ")
ACTIONS = ("apply", "scale", "drop", "accumulate")
"""``PushResponse.action``'s values, by their index in a reply."""
_I8, _F4 = np.dtype("<i8"), np.dtype("<f4")


class StepRows(NamedTuple):
    """One table's rows in a step: ``ids`` and ``values`` are bytes (views of the request) in the
    shape of a ``RowBlock``, so the shard decodes and checks them as it does a push's blocks."""

    table: str
    ids: memoryview
    values: memoryview


@dataclass(frozen=True)
class StepRequest:
    worker_id: int
    generation: int
    sequence: int
    base_version: int
    clock: int
    base_clock: int
    session: bytes
    data: dict[str, int] | None
    """The worker's progress after this step (``TensorHeader.data``), if it sent it."""
    dense: memoryview
    """The dense gradient's bytes (empty: a push of rows alone)."""
    pushed: list[StepRows]
    """The rows of each table the push carries (some with none on this shard)."""
    reads: list[tuple[str, np.ndarray]]
    """Each table's ids to read after the push, in the request's order of tables."""
    dims: list[int]
    """Each table's row width as the worker sent it (checked against the job's by the shard)."""


@dataclass(frozen=True)
class StepReply:
    push_version: int
    staleness: int
    action: str
    version: int
    clock: int
    dense: memoryview
    rows: list[np.ndarray]
    """Per table of the request, its rows read, ``(read ids, dim)`` float32."""


def owner_of(body) -> tuple[int, int]:
    """``(worker_id, generation)`` a request names; raises ``ValueError`` for one too short."""
    if len(body) < REQUEST.size:
        raise ValueError(f"a Step request of {len(body)} bytes is shorter than its {REQUEST.size}-byte head")
    worker_id, generation = struct.unpack_from("<QQ", body)
    return worker_id, generation


def encode_request(*, worker_id: int, generation: int, sequence: int, base_version: int, clock: int,
                   base_clock: int, session: bytes, data: Mapping[str, int] | None, dense: Sequence,
                   tables: Sequence[tuple]) -> list:
    """The request's pieces, to be sent end to end: ``dense`` is the parts' byte views in order,
    ``tables`` ``(name, dim, pushed ids, pushed gradients, read ids)`` with numpy arrays (int64,
    float32 ``(n, dim)``, int64); pushed ids None: the push does not carry the table."""
    nbytes = sum(len(view) for view in dense)
    progress = [data.get(key, 0) for key in ("step", "epoch", "position")] if data else (0, 0, 0)
    pieces = [REQUEST.pack(worker_id, generation, sequence, base_version, clock, base_clock, len(session),
                           len(tables), bool(data), *progress, nbytes), session, *dense]
    for name, dim, ids, grads, reads in tables:
        encoded = name.encode()
        pushed = ids is not None
        pieces += [TABLE.pack(len(encoded), pushed, dim, ids.size if pushed else 0, reads.size), encoded]
        if pushed:
            pieces += [_bytes(ids, _I8), _bytes(grads, _F4)]
        pieces.append(_bytes(reads, _I8))
    return pieces


def _bytes(array: np.ndarray, dtype: np.dtype) -> memoryview:
    """``array``'s bytes in ``dtype``, C-ordered (a view when they already are)."""
    if not array.size:
        return memoryview(b"")
    return np.ascontiguousarray(array, dtype=dtype).reshape(-1).data.cast("B")


class _Reader:
    """Takes consecutive pieces of a body, refusing any that runs past its end."""

    def __init__(self, body, what: str) -> None:
        self.view, self.at, self.what = memoryview(body).cast("B"), 0, what

    def take(self, nbytes: int, name: str) -> memoryview:
        end = self.at + nbytes
        if end > len(self.view):
            raise ValueError(f"{self.what} ends inside its {name}: {len(self.view)} bytes, "
                             f"{name} needs bytes {self.at}..{end}")
        piece, self.at = self.view[self.at:end], end
        return piece

    def array(self, count: int, dtype: np.dtype, name: str) -> np.ndarray:
        piece = self.take(count * dtype.itemsize, name)
        out = np.frombuffer(piece, dtype=dtype)
        return out if out.flags.aligned else out.copy()

    def done(self) -> None:
        if self.at != len(self.view):
            raise ValueError(f"{self.what} has {len(self.view) - self.at} bytes past its end")


def decode_request(body, max_dim: int = 1 << 16) -> StepRequest:
    """A request's fields as views of ``body``; raises ``ValueError`` naming the first thing that
    does not add up (a length past the body's end, bytes left over, a name that is not UTF-8, a
    row width of 0 or above ``max_dim``, a table listed twice)."""
    reader = _Reader(body, "Step request")
    (worker_id, generation, sequence, base_version, clock, base_clock, session_len, count, has_data, step, epoch,
     position, dense_len) = REQUEST.unpack(reader.take(REQUEST.size, "head"))
    if has_data > 1:
        raise ValueError(f"the head's progress flag is {has_data} (0 or 1)")
    data = {"step": step, "epoch": epoch, "position": position} if has_data else None
    session = bytes(reader.take(session_len, "session"))
    dense = reader.take(dense_len, "dense gradient")
    pushed, reads, dims, seen = [], [], [], set()
    for k in range(count):
        name_len, is_pushed, dim, npushed, nread = TABLE.unpack(reader.take(TABLE.size, f"head of table {k}"))
        try:
            name = bytes(reader.take(name_len, f"name of table {k}")).decode()
        except UnicodeDecodeError:
            raise ValueError(f"table {k}'s name is not UTF-8") from None
        if not 0 < dim <= max_dim:
            raise ValueError(f"table {name!r}: rows of width {dim} (1..{max_dim})")
        if name in seen:
            raise ValueError(f"table {name!r} is listed twice in one Step")
        seen.add(name)
        if is_pushed > 1 or (npushed and not is_pushed):
            raise ValueError(f"table {name!r}: {npushed} rows pushed with the pushed flag {is_pushed}")
        ids = reader.take(npushed * 8, f"pushed ids of table {name!r}")
        values = reader.take(npushed * dim * 4, f"gradients of table {name!r}")
        if is_pushed:
            pushed.append(StepRows(name, ids, values))
        reads.append((name, reader.array(nread, _I8, f"ids to read of table {name!r}")))
        dims.append(dim)
    reader.done()
    return StepRequest(worker_id, generation, sequence, base_version, clock, base_clock, session, data, dense,
                       pushed, reads, dims)


def encode_reply(push_version: int, staleness: int, action: str, version: int, clock: int, dense: Sequence,
                 rows: Sequence[np.ndarray]) -> list:
    """The reply's pieces, to be sent end to end (``dense``: byte views; ``rows``: float32 arrays)."""
    nbytes = sum(len(view) for view in dense)
    return [REPLY.pack(push_version, staleness, ACTIONS.index(action), version, clock, nbytes), *dense,
            *(_bytes(r, _F4) for r in rows)]


def decode_reply(body, dense_bytes: int, reads: Sequence[tuple[int, int]]) -> StepReply:
    """A reply to a request that expects ``dense_bytes`` of values and, per table, ``(rows read,
    dim)``; raises ``ValueError`` for one that does not match it exactly."""
    reader = _Reader(body, "Step reply")
    push_version, staleness, action, version, clock, nbytes = REPLY.unpack(reader.take(REPLY.size, "head"))
    if action >= len(ACTIONS):
        raise ValueError(f"Step reply names action {action} (0..{len(ACTIONS) - 1})")
    if nbytes != dense_bytes:
        raise ValueError(f"Step reply carries {nbytes} bytes of values, expected {dense_bytes}")
    dense = reader.take(nbytes, "values")
    rows = [reader.array(count * dim, _F4, f"rows of table {k}").reshape(count, dim)
            for k, (count, dim) in enumerate(reads)]
    reader.done()
    return StepReply(push_version, staleness, ACTIONS[action], version, clock, dense, rows)
