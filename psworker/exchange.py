"""How a registered worker's tensors cross the wire: ``Exchange``, the base of
``psworker.client.PSClient`` that pulls, pushes, makes a step's push-and-pull and reads table
rows, on every shard at once, with the retries and the timings each reports.

Kept apart from joining the job (``psworker.client``: placement, registration, heartbeats,
leaving, the data queue) because the two are read for different things: membership is a few
calls per job whose order the shards' leases and generations decide; the exchange runs every
step, and what matters there is what a step costs (one call per shard where its push, pull and
the next step's rows fit; calls sent whole on the lanes before any reply is read) and that a
retried push repeats its sequence number. It has no state of its own: it works on the sessions
``PSClient.register`` set up, advancing their sequence numbers and clocks and recording the
versions each pull got.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import TYPE_CHECKING

import numpy as np
import torch

from pswire import errors
from pswire.consistency import Consistency, Mode
from pswire.codec import Part, dtype_to_wire, on_wire
from pswire.dtypes import dtype_of
from pswire.tables import TableSpec
from pswire.v1 import ps_pb2
from psworker.options import ClientOptions
from psworker.retry import retrying
from psworker.rowreads import Identity, PlannedTable, RowsCall, plan_rows, row_blocks, rows_calls, write_rows
from psworker.tensors import tensor_bytes, torch_dtype

if TYPE_CHECKING:
    from psworker.client import DataRider, _ShardSession

__all__ = ["Exchange", "ROWS_PER_CALL"]

ROWS_PER_CALL = 16 << 20
"""The most bytes of rows one PullRows asks a shard for (below the shards' limit on a reply)."""

# The client's log lines keep the client's logger, whichever of its modules writes them: a
# logging setup that names psworker.client still gets the "pull ... waits on shard" lines.
log = logging.getLogger("psworker.client")


def _identity(session: _ShardSession) -> Identity:
    return Identity(session.worker_id, session.generation, session.secret)


def _sent_first(pending, finish: Callable, again: Callable) -> Callable:
    """A call for ``retrying`` whose first attempt reads the reply of the call already sent on a
    lane (``pending``: ``finish(pending)``), and any later one calls ``again()``; without a
    pending call, every attempt is ``again()``."""
    def attempt():
        nonlocal pending
        if pending is not None:
            sent, pending = pending, None
            return finish(sent)
        return again()

    return attempt


def _every_one(jobs: Sequence[Callable]) -> list:
    """Run every job in turn, even after one failed (each finishes a call already under way),
    then raise the first error; else their results."""
    results, failed = [], None
    for job in jobs:
        try:
            results.append(job())
        except BaseException as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
    return results


class Exchange:
    """The tensor traffic of a ``psworker.client.PSClient`` (its base, before ``AdminClient``).
    Never made alone: it works on the state ``PSClient.__init__`` sets up (declared below;
    ``options`` and ``_pool`` come from ``AdminClient.__init__``, which it calls) and uses
    ``AdminClient``'s ``_fan_out`` and ``num_shards``. ``_lock`` guards ``_sessions``.
    """

    options: ClientOptions
    _pool: futures.ThreadPoolExecutor
    _lock: threading.Lock
    _sessions: list[_ShardSession]
    consistency: Consistency
    tables: dict[str, TableSpec]
    _take_rider: Callable[[_ShardSession], DataRider | None]
    """The data exchange offered to the next push-and-pull to this shard, if any (``PSClient``)."""

    def _header(self, session: _ShardSession, base_version: int, parts: Sequence[Part] | None = None) -> ps_pb2.TensorHeader:
        return ps_pb2.TensorHeader(
            worker_id=session.worker_id, generation=session.generation, sequence=session.sequence,
            session=session.secret, base_version=base_version, parts=[p.spec for p in (session.parts if parts is None else parts)],
            clock=session.clock, base_clock=session.base_clock,
        )

    def _pull_request(
        self, session: _ShardSession, destinations: Mapping[str, torch.Tensor], *, skip_unchanged: bool,
        may_wait: bool, clock: int,
    ) -> tuple[ps_pb2.PullRequest, dict[str, torch.Tensor], int]:
        dest = {p.key: _rows(destinations[p.name], p) for p in session.parts}
        known = {}
        if skip_unchanged:
            for p in session.parts:
                version, ref, ptr = session.known.get(p.key, (0, None, 0))
                tensor = destinations[p.name]
                if ref is not None and ref() is tensor and tensor.data_ptr() == ptr:
                    known[p.key] = version
        wire = self.options.wire_dtype
        request = ps_pb2.PullRequest(worker_id=session.worker_id, generation=session.generation, session=session.secret,
                                     known_versions=known, clock=clock if may_wait else -1,
                                     wire_dtype=dtype_to_wire(wire) if wire is not None else 0)
        return request, dest, sum(on_wire(p, wire).nbytes for p in session.parts)

    @staticmethod
    def _pulled(
        session: _ShardSession, header: ps_pb2.PullHeader, written: Mapping[str, int],
        destinations: Mapping[str, torch.Tensor],
    ) -> int:
        names = {p.key: p.name for p in session.parts}
        for key, part_version in written.items():
            tensor = destinations[names[key]]
            session.known[key] = (part_version, weakref.ref(tensor), tensor.data_ptr())
        session.version, session.base_clock = header.version, header.clock
        return header.version

    def _push_message(
        self, session: _ShardSession, grads: Mapping[str, torch.Tensor], data: Mapping[str, int] | None,
        base_version: int | None = None, rows: Sequence[ps_pb2.RowBlock] = (), again: bool = False,
    ) -> tuple[ps_pb2.TensorHeader, list[memoryview]] | None:
        """The next push to ``session`` (None when it holds none of ``grads`` and no ``rows``
        and, in async, needs no clock tick); takes the next sequence number, or with ``again``
        keeps the last one (the push last sent, made again). ``base_version``: the version the
        gradient was computed from, when not that of the last pull. ``rows``: this shard's blocks
        of table rows (``psworker.rowreads.row_blocks``)."""
        parts = [p for p in session.parts if p.name in grads]
        if not parts and not rows and self.consistency.mode is Mode.ASYNC:
            return None
        if not again:
            session.sequence += 1
        header = self._header(session, session.version if base_version is None else base_version, parts)
        header.rows.extend(rows)
        if data:
            header.data.CopyFrom(ps_pb2.DataPosition(**data))
        wire = self.options.wire_dtype
        if wire is None:
            return header, [tensor_bytes(_rows(grads[p.name], p)) for p in parts]
        header.wire_dtype = dtype_to_wire(wire)
        buffers = []
        for part in parts:
            grad, sent = _rows(grads[part.name], part), on_wire(part, wire)
            if sent is not part:  # compressed into a buffer reused step after step
                narrow = session.narrow.get(part.key)
                if narrow is None:
                    narrow = session.narrow[part.key] = torch.empty(sent.shape, dtype=torch_dtype(wire))
                grad = narrow.copy_(grad)
            buffers.append(tensor_bytes(grad))
        return header, buffers

    def pull(
        self, destinations: Mapping[str, torch.Tensor], *, skip_unchanged: bool = True, wait: bool = True
    ) -> list[int]:
        """Write every shard's current values into ``destinations`` (variable name -> contiguous
        CPU tensor of the full shape). Returns each shard's version.

        In ssp/sync a registered worker's pull waits as the bound requires (``wait=False`` reads
        at once: for evaluation, never for training steps)."""
        sessions = self._require_sessions()
        may_wait = wait and self.consistency.mode is not Mode.ASYNC
        timings: list[tuple[float, float, float]] | None = [] if self.options.on_exchange is not None else None

        def one(session: _ShardSession) -> int:
            if not session.parts and not may_wait:  # a shard holding none of the model (a packed one)
                return session.version
            started = time.monotonic()
            request, dest, nbytes = self._pull_request(
                session, destinations, skip_unchanged=skip_unchanged, may_wait=may_wait, clock=session.clock
            )
            header, written = retrying(
                lambda: session.client.pull(request, dest, nbytes, may_wait=may_wait),
                self.options, session.client.address, "pull",
            )
            version = self._pulled(session, header, written, destinations)
            if timings is not None:
                timings.append(_phases(time.monotonic() - started, 0, 0, may_wait))
            return version

        versions = self._fan_out_waiting(one, sessions, may_wait)
        self._report(timings)
        return versions

    def _fan_out_waiting(self, fn, sessions: list[_ShardSession], may_wait: bool) -> list:
        """``_fan_out``, logging every few seconds which worker a waiting call is held back by."""
        if not may_wait:
            return self._fan_out(fn, sessions)
        futs = {self._pool.submit(fn, s): s for s in sessions}
        _, pending = futures.wait(futs, timeout=0.5)
        while pending:
            for fut in pending:
                self._log_wait(futs[fut])
            _, pending = futures.wait(pending, timeout=5.0)
        return [f.result() for f in futs]

    def _log_wait(self, session: _ShardSession) -> None:
        """Say which worker a waiting pull is held back by (the slowest live one)."""
        try:
            status = session.client.status()
        except errors.PSError:
            return
        live = [w for w in status.workers if w.live]
        if live:
            slowest = min(live, key=lambda w: (w.clock, w.worker_name))
            log.info(
                "pull at clock %d waits on shard %s (%s) for %s at clock %d",
                session.clock, session.client.address, self.consistency.describe(),
                slowest.worker_name, slowest.clock,
            )

    def push(
        self, grads: Mapping[str, torch.Tensor], *, data: Mapping[str, int] | None = None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> list[ps_pb2.PushResponse | None]:
        """Push gradients (variable name -> contiguous CPU tensor) to the shards holding them,
        computed from the versions of the last pull. In async, shards with none of the variables
        are skipped (``None`` in the result); in ssp/sync they get an empty push, which advances
        this worker's clock there. ``rows``: table -> ``(ids, gradients)`` of this step's rows
        (each id once), pushed with the gradients to the shards holding them."""
        sessions = self._require_sessions()
        blocks = dict(zip(map(id, sessions), row_blocks(self.tables, self.num_shards, rows)))
        timings: list[tuple[float, float, float]] | None = [] if self.options.on_exchange is not None else None

        def one(session: _ShardSession) -> ps_pb2.PushResponse | None:
            started = time.monotonic()
            message = self._push_message(session, grads, data, rows=blocks[id(session)])
            if message is None:
                return None
            reply = retrying(lambda: session.client.push(*message), self.options, session.client.address, "push")
            session.clock += 1
            if timings is not None:
                timings.append((time.monotonic() - started, 0.0, 0.0))
            return reply

        replies = self._fan_out(one, sessions)
        self._report(timings)
        return replies

    def push_pull(
        self, grads: Mapping[str, torch.Tensor], destinations: Mapping[str, torch.Tensor], *,
        data: Mapping[str, int] | None = None, base_versions: Sequence[int] | None = None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        read_rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> list[ps_pb2.PushResponse | None]:
        """One training step's traffic: :meth:`push`, then :meth:`pull` into ``destinations``
        (waiting on the bound in ssp/sync). A shard whose push and pull both fit in
        ``inline_bytes``, or whose bulk lanes are open, gets them as one call; the others as two.
        A retried call repeats the push's sequence number, so the shard applies it once.
        ``base_versions`` (one per shard): the versions the gradients were computed from, when
        not those of the last pull (a worker that overlaps steps computes on older weights).
        ``rows`` as in :meth:`push`.

        ``read_rows`` (table -> (int64 ids, each once; a float32 ``(len(ids), dim)`` array the
        values are written into)): rows read once the push is applied, the next step's. In async
        jobs they ride on the step's calls (one call per shard for the step and the next one's
        rows, where a pull of rows after the step would be a second); otherwise, or when a
        shard's share is larger than one reply carries, they are read by :meth:`pull_rows` after
        the step (at once, not waiting on a bound).

        ``psworker.stepcalls.StepCalls`` makes an async step as one ``Step`` per shard instead,
        when it can."""
        return self._push_pull(self._require_sessions(), grads, destinations, data=data,
                               base_versions=base_versions, rows=rows, read_rows=read_rows)

    def _push_pull(
        self, every: list[_ShardSession], grads: Mapping[str, torch.Tensor], destinations: Mapping[str, torch.Tensor],
        *, data: Mapping[str, int] | None, base_versions: Sequence[int] | None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None,
        read_rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None, again: _ShardSession | None = None,
    ) -> list[ps_pb2.PushResponse | None]:
        """:meth:`push_pull` in ``PushPull`` calls. ``again``: the step of that shard alone,
        its push the one last sent there (its sequence number kept: a ``Step`` that failed as a
        call that may be retried)."""
        may_wait = self.consistency.mode is not Mode.ASYNC
        bases = dict(zip(map(id, every), base_versions)) if base_versions is not None else {}
        blocks = dict(zip(map(id, every), row_blocks(self.tables, self.num_shards, rows)))
        # In async a shard holding none of the model (a packed one) and no rows of this step has
        # nothing to apply or send back; in ssp/sync its empty push still advances the clock.
        sessions = every if may_wait else [s for s in every if s.parts or blocks[id(s)]]
        if again is not None:
            sessions = [again]
        timings: list[tuple[float, float, float]] | None = [] if self.options.on_exchange is not None else None
        plan, reads = self._step_reads(read_rows, every, sessions, may_wait)
        row_outs = {table: out for table, (_, out) in (read_rows or {}).items()}

        def prepare(session: _ShardSession) -> tuple:
            message = self._push_message(session, grads, data, bases.get(id(session)), blocks[id(session)],
                                         again=session is again)
            if message is not None and not session.parts and reads and id(session) in reads:
                # A shard holding only table rows: the rows read with the step gives its version
                # and clock, and a pull of no variables would cost the call a second read.
                request, dest, nbytes = None, None, 0
            else:
                request, dest, nbytes = self._pull_request(
                    session, destinations, skip_unchanged=True, may_wait=may_wait,
                    clock=session.clock + (message is not None),
                )
            # A data exchange waiting for a step rides on this one's call to shard 0.
            rider = self._take_rider(session) if message is not None else None
            if rider is not None:
                riders.append(rider)
            return message, request, dest, nbytes, rider

        def complete(session: _ShardSession, prepared: tuple, started: float, pending=None) -> ps_pb2.PushResponse | None:
            message, request, dest, nbytes, rider = prepared
            address = session.client.address
            reply = None
            read = reads.get(id(session)) if reads else None
            if message is not None:
                attempt = _sent_first(
                    pending, lambda sent: session.client.finish_push_pull(sent, dest, rider),
                    lambda: session.client.push_pull(*message, request, dest, nbytes, may_wait=may_wait,
                                                     rows=read.request if read else None,
                                                     rows_bytes=read.nbytes if read else 0, data=rider))
                reply, header, written, rows_reply = retrying(attempt, self.options, address, "push and pull")
                session.clock += 1
                if read:
                    if rows_reply is None:
                        raise errors.PSError(f"shard {address} answered a push-and-pull without the table rows it "
                                             "asked for (a shard older than this worker?)")
                    write_rows(address, rows_reply, read, row_outs)
            else:
                header, written = retrying(
                    lambda: session.client.pull(request, dest, nbytes, may_wait=may_wait), self.options, address, "pull"
                )
                if read:  # nothing to push here after all: the rows alone
                    rows_reply = retrying(lambda: session.client.pull_rows(read.request, read.nbytes, may_wait=False),
                                          self.options, address, "pull rows")
                    write_rows(address, rows_reply, read, row_outs)
            if header is not None:
                self._pulled(session, header, written, destinations)
            else:  # no pull (see prepare): the rows read after the push says where the shard is
                session.version, session.base_clock = rows_reply.version, rows_reply.clock
            if timings is not None:
                pushed = sum(len(b) for b in message[1]) if message is not None else 0
                timings.append(_phases(time.monotonic() - started, pushed, nbytes, may_wait))
            return reply

        riders: list[DataRider] = []
        try:
            if may_wait or len(sessions) == 1 or not self.options.lane_calls:
                replies = self._fan_out_waiting(lambda s: complete(s, prepare(s), time.monotonic()), sessions,
                                                may_wait)
            else:
                replies = self._push_pull_whole(sessions, prepare, complete, reads)
        finally:
            for rider in riders:  # the reply answered it; else (a failure, or no call carried it) unanswered
                rider.unanswered()
        self._report(timings)
        if read_rows and reads is None:
            got = self.pull_rows({table: ids for table, (ids, _) in read_rows.items()}, wait=False)
            for table, out in row_outs.items():
                out[...] = got[table]
        if len(sessions) < len(every):
            answered = dict(zip(map(id, sessions), replies))
            replies = [answered.get(id(s)) for s in every]
        return replies

    def _step_reads(self, read_rows, every: list[_ShardSession], sessions: list[_ShardSession], may_wait: bool,
                    ) -> tuple[list[PlannedTable], dict[int, RowsCall] | None]:
        """``push_pull``'s rows to read with the step: their plan and, as session id -> the
        ``PullRows`` its call carries, the reads; None when they are read after the step instead
        (not async, a shard with rows to read but no call in the step, or a share above one reply)."""
        if not read_rows or may_wait:
            return [], None
        plan = plan_rows(self.tables, self.num_shards, {table: ids for table, (ids, _) in read_rows.items()})
        calling = set(map(id, sessions))
        reads = {}
        for k, session in enumerate(every):
            calls = rows_calls(plan, k, identity=_identity(session), clock=-1, limit=ROWS_PER_CALL)
            if not calls:
                continue
            if len(calls) > 1 or id(session) not in calling:
                return plan, None
            reads[id(session)] = calls[0]
        return plan, reads

    def _push_pull_whole(self, sessions: list[_ShardSession], prepare, complete,
                         reads=None) -> list[ps_pb2.PushResponse | None]:
        """An async step's push-and-pull to several shards on one thread: every small call sent
        whole on its lane first, then each reply read in turn (the shards work meanwhile), where
        the fan-out would hand each call to a thread of its own. Shards whose calls cannot go
        whole on a lane (large ones) get theirs in the fan-out, after the lane calls are sent.
        Every call is finished before an error is raised (the first)."""
        started = time.monotonic()
        prepared = [prepare(s) for s in sessions]

        def start(session: _ShardSession, p: tuple):
            if p[0] is None:
                return None
            read = reads.get(id(session)) if reads else None
            return session.client.start_push_pull(p[0][0], p[0][1], p[1], p[3], rows=read.request if read else None,
                                                  rows_bytes=read.nbytes if read else 0, data=p[4])

        pending = [start(s, p) for s, p in zip(sessions, prepared)]
        rest = [i for i, p in enumerate(pending) if p is None]
        if len(rest) == len(sessions):
            return self._fan_out(lambda i: complete(sessions[i], prepared[i], started), rest)
        later = self._pool.submit(self._fan_out, lambda i: complete(sessions[i], prepared[i], started), rest) \
            if rest else None
        replies: list[ps_pb2.PushResponse | None] = [None] * len(sessions)

        def finish(i: int) -> None:
            replies[i] = complete(sessions[i], prepared[i], started, pending[i])

        def gather() -> None:
            for i, reply in zip(rest, later.result()):
                replies[i] = reply

        _every_one([functools.partial(finish, i) for i, sent in enumerate(pending) if sent is not None]
                   + ([gather] if later is not None else []))
        return replies

    def pull_rows(
        self, requests: Mapping[str, np.ndarray], *, wait: bool = True, as_reader: bool = False
    ) -> dict[str, np.ndarray]:
        """Rows of the job's tables: table -> int64 ``ids`` (each once) in, table -> float32
        ``(len(ids), dim)`` values out, from every shard at once. In ssp/sync a training read
        waits on the bound as :meth:`pull` does (``wait=False`` reads at once). ``as_reader``:
        read without this worker's registration (one the shards fenced off, say)."""
        sessions = self._require_sessions()
        may_wait = wait and not as_reader and self.consistency.mode is not Mode.ASYNC
        plan = plan_rows(self.tables, self.num_shards, requests)
        out = {t.table: np.empty((t.ids.size, t.spec.dim), dtype=np.float32) for t in plan}

        def read(shard: int, call: RowsCall, pending=None) -> None:
            client = sessions[shard].client
            attempt = _sent_first(pending, client.finish_pull_rows,
                                  lambda: client.pull_rows(call.request, call.nbytes, may_wait=may_wait))
            write_rows(client.address, retrying(attempt, self.options, client.address, "pull rows"), call, out)

        planned = [rows_calls(plan, k, identity=None if as_reader else _identity(session),
                              clock=session.clock if may_wait else -1, limit=ROWS_PER_CALL)
                   for k, session in enumerate(sessions)]
        if self.options.lane_calls and len(sessions) > 1 and all(len(c) <= 1 for c in planned):
            # One call per shard: all of them sent on their lanes first, then each reply read.
            pending = [sessions[k].client.start_pull_rows(c[0].request, c[0].nbytes, may_wait=may_wait) if c else None
                       for k, c in enumerate(planned)]
            _every_one([functools.partial(read, k, c[0], sent)
                        for k, (c, sent) in enumerate(zip(planned, pending)) if c])
        else:
            self._fan_out(lambda k: [read(k, c) for c in planned[k]], range(len(sessions)))
        return out

    def _report(self, timings: list[tuple[float, float, float]] | None) -> None:
        """Hand the phases of the slowest shard's call to ``options.on_exchange``."""
        if timings:
            self.options.on_exchange(*max(timings, key=sum))

    def versions(self) -> list[int]:
        """Each shard's version as of this worker's last pull."""
        return [session.version for session in self._require_sessions()]

    def _require_sessions(self) -> list[_ShardSession]:
        with self._lock:
            if not self._sessions:
                raise errors.PreconditionError("register (or set_placement) before pull and push")
            return list(self._sessions)


def _phases(seconds: float, pushed: int, pulled: int, may_wait: bool) -> tuple[float, float, float]:
    """``(push, pull, wait)`` of one shard's call of ``seconds`` that sent ``pushed`` bytes and
    asked for ``pulled``: all wait when the shard may hold it on the bound, else split by bytes
    (a pull alone, ``pushed == 0``, is all pull)."""
    if may_wait:
        return 0.0, 0.0, seconds
    push = seconds * pushed / (pushed + pulled) if pushed else 0.0
    return push, seconds - push, 0.0


def _rows(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """The rows of ``tensor`` that ``part`` covers, as a view (``tensor`` must be contiguous)."""
    dtype = dtype_of(tensor.dtype)
    if tensor.shape != part.full_shape or (dtype is not part.dtype and dtype != part.dtype):  # torch.Size is a tuple
        raise ValueError(
            f"tensor for {part.name!r} is {tensor.dtype}{list(tensor.shape)}, "
            f"expected {part.dtype}{list(part.full_shape)}"
        )
    return tensor if part.is_whole else tensor[part.row_start : part.row_end]
