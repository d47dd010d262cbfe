"""An async step as one ``Step`` per shard (``pswire.step``): ``StepCalls``, the layer of
``psworker.client.PSClient`` over ``psworker.exchange.Exchange`` that sends each shard's share of
a step (its push, the variables pulled after it, the next batch's rows) in the fixed binary
layout, whole on the shard's lane, in place of the protobuf ``PushPull``.

Kept apart from the exchange because it is a transport beside it, not a second exchange: it
decides per step whether the step can go as ``Step`` calls, and anything it cannot make (a
compressed or too large step, a data exchange riding on it, no lane) or a call that fails as one
that may be retried goes back to ``Exchange``'s ``PushPull`` path, with the same sequence number.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from pswire import errors, step
from pswire.consistency import Mode
from pswire.tables import owner
from pswire.v1 import ps_pb2
from psworker.exchange import Exchange, _every_one, _phases, _rows
from psworker.retry import TRANSIENT
from psworker.tensors import tensor_bytes, write_bytes

if TYPE_CHECKING:
    from psworker.client import DataRider, _ShardSession

__all__ = ["StepCalls"]

log = logging.getLogger("psworker.client")


class StepCalls(Exchange):
    """``Exchange`` with an async step made as ``Step`` calls where it can be
    (``ClientOptions.step_calls``)."""

    _rider: DataRider | None
    """A data exchange waiting to ride on a step (``PSClient.offer_data``)."""

    def push_pull(
        self, grads: Mapping[str, torch.Tensor], destinations: Mapping[str, torch.Tensor], *,
        data: Mapping[str, int] | None = None, base_versions: Sequence[int] | None = None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        read_rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> list[ps_pb2.PushResponse | None]:
        """:meth:`Exchange.push_pull`, an async step whose calls all fit in ``inline_bytes`` made
        as one ``Step`` per shard, sent whole on the lanes."""
        every = self._require_sessions()
        if (self.options.step_calls and self.options.lane_calls and self.options.wire_dtype is None
                and self.consistency.mode is Mode.ASYNC):
            replies = self._step_calls(every, grads, destinations, data, base_versions, rows, read_rows)
            if replies is not None:
                return replies
        return self._push_pull(every, grads, destinations, data=data, base_versions=base_versions, rows=rows,
                               read_rows=read_rows)

    def _step_calls(
        self, every: list[_ShardSession], grads: Mapping[str, torch.Tensor], destinations: Mapping[str, torch.Tensor],
        data: Mapping[str, int] | None, base_versions: Sequence[int] | None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None,
        read_rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None,
    ) -> list[ps_pb2.PushResponse | None] | None:
        """An async step as one ``Step`` per shard (``pswire.step``): every call sent whole on its
        lane, then each reply read in turn, on this thread. None when the step cannot be made so
        (a variable of a shard missing from ``grads``, a shard with rows to read and nothing to
        push, a data exchange waiting to ride on the step, a call above ``inline_bytes`` either
        way, no lane to the first shard): nothing was sent, and :meth:`push_pull` makes the step
        in ``PushPull`` calls. A shard whose ``Step`` cannot be sent, or fails as a call that may
        be retried (unreachable, too slow, overloaded), gets its step again as ``PushPull``, with
        the same sequence number. Every call is finished before an error is raised (the first)."""
        if self._rider is not None:
            return None
        count = len(every)
        pushed, asked = [], []
        for table, (ids, values) in (rows or {}).items():
            spec = self.tables.get(table)
            if spec is None:
                return None  # refused by name in PushPull's path
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            pushed.append((table, spec, ids, np.ascontiguousarray(values, dtype=np.float32), owner(ids, count)))
        for table, (ids, out) in (read_rows or {}).items():
            spec = self.tables.get(table)
            if spec is None:
                return None
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            asked.append((table, spec, ids, out, owner(ids, count)))
        bases = dict(zip(map(id, every), base_versions)) if base_versions is not None else {}
        calls = []
        for k, session in enumerate(every):
            if not session.parts and not pushed:
                if any((where == k).any() for *_, where in asked):
                    return None  # rows to read but nothing to push: read after the step
                continue
            if any(p.name not in grads for p in session.parts):
                return None
            dense = [tensor_bytes(_rows(grads[p.name], p)) for p in session.parts]
            # Table -> [dim, pushed ids, their gradients, ids to read] (ids None: not pushed).
            tables: dict[str, list] = {}
            reads, sent, received = [], sum(map(len, dense)), sum(p.nbytes for p in session.parts)
            for table, spec, ids, values, where in pushed:
                here = where == k
                tables[table] = [spec.dim, ids[here], values[here], _NO_IDS]
                sent += int(here.sum()) * (8 + spec.row_bytes)
            for table, spec, ids, out, where in asked:
                at = np.flatnonzero(where == k)
                tables.setdefault(table, [spec.dim, None, None, _NO_IDS])[3] = ids[at]
                reads.append((table, spec, out, at))
                sent, received = sent + 8 * at.size, received + at.size * spec.row_bytes
            if max(sent, received) > self.options.inline_bytes:
                return None
            calls.append(_StepCall(session, k, dense, [(name, *entry) for name, entry in tables.items()], reads,
                                   received, sent + received,
                                   bases.get(id(session), session.version)))
        started = time.monotonic()
        pending = []
        for call in calls:
            session = call.session
            pieces = step.encode_request(
                worker_id=session.worker_id, generation=session.generation, sequence=session.sequence + 1,
                base_version=call.base_version, clock=session.clock, base_clock=session.base_clock,
                session=session.secret, data=data, dense=call.dense, tables=call.tables)
            sent = session.client.start_step(pieces, call.nbytes)
            if sent is None and not pending:
                return None
            session.sequence += 1  # sent, or about to be made again as PushPull
            pending.append(sent)
        replies: list[ps_pb2.PushResponse | None] = [None] * count
        timings: list[tuple[float, float, float]] = []

        def finish(call: _StepCall, sent) -> None:
            session = call.session
            if sent is not None:
                try:
                    body = session.client.finish_step(sent)
                except TRANSIENT as exc:
                    log.debug("Step to %s failed (%s): made again as PushPull", session.client.address, exc)
                else:
                    replies[call.shard] = self._stepped(call, body, destinations)
                    timings.append(_phases(time.monotonic() - started, call.nbytes - call.received, call.received,
                                           False))
                    return
            replies[call.shard] = self._push_pull(every, grads, destinations, data=data, base_versions=base_versions,
                                                  rows=rows, read_rows=read_rows, again=session)[call.shard]

        _every_one([functools.partial(finish, call, sent) for call, sent in zip(calls, pending)])
        if self.options.on_exchange is not None:
            self._report(timings)
        return replies

    def _stepped(self, call: "_StepCall", body: bytes, destinations: Mapping[str, torch.Tensor]) -> ps_pb2.PushResponse:
        """A ``Step``'s reply written out: the variables into ``destinations``, the rows read into
        their arrays, the session moved on; raises ``PSError`` for a reply that does not answer
        the call."""
        session = call.session
        address = session.client.address
        try:
            reply = step.decode_reply(body, sum(p.nbytes for p in session.parts),
                                      [(at.size, spec.dim) for _, spec, _, at in call.reads])
        except ValueError as exc:
            raise errors.PSError(f"shard {address} answered a Step with a reply that does not fit it: {exc}") from None
        at = 0
        for part in session.parts:
            write_bytes(_rows(destinations[part.name], part), reply.dense[at:at + part.nbytes])
            at += part.nbytes
            session.known.pop(part.key, None)  # no part's own version comes back
        for (_, _, out, positions), values in zip(call.reads, reply.rows):
            out[positions] = values
        session.clock += 1
        session.version, session.base_clock = reply.version, reply.clock
        return ps_pb2.PushResponse(version=reply.push_version, staleness=reply.staleness, action=reply.action)


_NO_IDS = np.empty(0, dtype=np.int64)


class _StepCall(NamedTuple):
    """One shard's ``Step`` of a step (``StepCalls._step_calls``)."""

    session: "_ShardSession"
    shard: int
    dense: list[memoryview]
    """The gradients of every part the shard holds, in order."""
    tables: list[tuple]
    """``pswire.step.encode_request``'s tables."""
    reads: list[tuple]
    """Per table read: ``(table, spec, the array its values go to, positions there)``."""
    received: int
    """Bytes of the reply's values (variables and rows)."""
    nbytes: int
    """Bytes both ways (for the deadline)."""
    base_version: int
