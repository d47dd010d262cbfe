"""The worker's side of the wire: a ``PSClient`` that talks to every shard of a job at once,
through one ``psworker.shard.ShardClient`` per shard. It is a ``psworker.admin.AdminClient``
(status, checkpoint, end-job, health, waiting for the shards) that registers and moves tensors.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import numpy as np
import torch

from pswire import errors
from pswire.consistency import Consistency, Mode
from pswire.codec import Part, dtype_to_wire, on_wire
from pswire.dtypes import dtype_of
from pswire.optim import OptimizerConfig
from pswire.placement import Placement, VariableSpec, place
from pswire.tables import TableSpec
from pswire.v1 import ps_pb2
from pswire.wire import consistency_from_proto, consistency_to_proto, optimizer_to_proto, table_to_proto
from psworker.admin import AdminClient
from psworker.options import ClientOptions, parse_addresses
from psworker.retry import retrying
from psworker.rowreads import Identity, PlannedTable, RowsCall, plan_rows, row_blocks, rows_calls, write_rows
from psworker.shard import ShardClient
from psworker.tensors import tensor_bytes, torch_dtype

__all__ = ["ClientOptions", "PSClient", "ROWS_PER_CALL", "ShardClient", "parse_addresses"]

ROWS_PER_CALL = 16 << 20
"""The most bytes of rows one PullRows asks a shard for (below the shards' limit on a reply)."""

log = logging.getLogger(__name__)


@dataclass
class _ShardSession:
    client: ShardClient
    parts: tuple[Part, ...]
    worker_id: int = 0
    generation: int = 0
    secret: bytes = field(default=b"", repr=False)
    """The session secret of this registration: every call of it carries it."""
    sequence: int = 0
    version: int = 0
    clock: int = 0
    """This worker's clock on the shard: the step its next push belongs to."""
    base_clock: int = 0
    """The shard clock of the last pull."""
    narrow: dict[str, torch.Tensor] = field(default_factory=dict)
    """Part key -> buffer its gradient is compressed into (``ClientOptions.wire_dtype``)."""
    known: dict[str, tuple[int, weakref.ref, int]] = field(default_factory=dict)
    """Part key -> (version, the tensor it was pulled into, that tensor's data pointer). Both
    must still match for a pull to skip the part: a new tensor can get a freed one's address."""


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


class PSClient(AdminClient):
    """A worker's connection to every shard of a job.

    Calls fan out to all shards concurrently and return when every shard has answered; an error
    from any shard is raised (the first one, as a ``pswire.errors`` error).

    With ``ClientOptions.on_exchange`` set, every push, pull and push-and-pull that succeeds
    reports the seconds of its slowest shard's call (the shards run concurrently, so that call
    is the exchange's length, retries included) as ``(push, pull, wait)``: a push alone is push;
    a pull alone is pull, or wait when the shard may hold it on the ssp/sync bound; a
    push-and-pull in async is split between push and pull by the bytes each way, and in ssp/sync
    is wait. A call's inside is not visible from here, so in ssp/sync "wait" is the time the
    shard held the exchange, the call's own transfer included (an upper bound of the wait on
    the bound); in async nothing waits and it is 0.
    """

    _shard_type = ShardClient
    _clients: list[ShardClient]

    def __init__(self, addresses: str | Sequence[str], options: ClientOptions | None = None) -> None:
        super().__init__(addresses, options)
        self._lock = threading.Lock()  # guards _sessions and placement against concurrent step calls
        self.placement: Placement | None = None
        self.consistency = Consistency()
        """The job's setting, as the shards reported it at registration."""
        self.tables: dict[str, TableSpec] = {}
        """The job's embedding tables, by name (``register``)."""
        self._sessions: list[_ShardSession] = []
        self._secrets: dict[str, bytes] = {}
        """Shard address -> this worker's session secret there (a re-registration proves with it
        that the live registration of its name is its own)."""
        self.lease_seconds = 0.0
        """The shortest lease the shards granted at registration (0: no leases)."""
        self.resume_data: dict[str, int] = {}
        """This worker's progress as the shards last recorded it (empty for a new worker)."""
        self._registrations = 0
        self._left = False
        """Set by :meth:`leave`, cleared by :meth:`register`: no heartbeats meanwhile."""
        self.fenced = threading.Event()
        """Set when a shard says this worker's registration is void (evicted): re-register."""
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def set_placement(self, spec: Sequence[VariableSpec], digest: str | None = None) -> Placement:
        """Compute the placement of ``spec`` on this job's shards (no RPC). With ``digest`` (the
        shards' ``placement_digest``, for a reader): the layout of ``spec`` the shards hold, packed
        as ``ClientOptions.pack_below`` says or spread, whichever has that digest; raises
        ``PreconditionError`` when neither has."""
        placement = place(spec, self.num_shards, pack_below=self.options.pack_below)
        if digest is not None and placement.digest() != digest:
            placement = place(spec, self.num_shards, pack_below=0)
            if placement.digest() != digest:
                raise errors.PreconditionError("the shards hold a different model (their placement digests differ)")
        with self._lock:
            self.placement = placement
            self._sessions = [_ShardSession(c, parts) for c, parts in zip(self._clients, placement.shards)]
        return placement

    def register(
        self,
        spec: Sequence[VariableSpec],
        optimizer: OptimizerConfig,
        *,
        worker_name: str,
        job_fingerprint: str = "",
        initial_values: Mapping[str, torch.Tensor] | None = None,
        consistency: Consistency | None = None,
        tables: Sequence[TableSpec] = (),
    ) -> bool:
        """Join the job on every shard; upload ``initial_values`` where this worker is chosen to
        initialise. Returns True if this worker initialised at least one shard. ``tables``: the
        job's embedding tables (their rows live on the shards, row ``i`` on shard ``i % n``).

        Raises ``PreconditionError`` when the model or settings disagree with the job's.
        """
        placement = self.set_placement(spec)
        wanted = consistency or Consistency()
        self.tables = {t.name: t for t in tables}
        table_protos = [table_to_proto(t) for t in tables]
        leases: list[float] = []
        positions: list[dict[str, int]] = []
        joined: list[tuple[int, int]] = []  # (version, live workers) of each shard

        def one(index: int) -> bool:
            session = self._sessions[index]
            request = ps_pb2.RegisterRequest(
                worker_name=worker_name, shard_index=index, num_shards=self.num_shards,
                placement_digest=placement.digest(), parts=[p.to_proto() for p in session.parts],
                optimizer=optimizer_to_proto(optimizer), job_fingerprint=job_fingerprint,
                consistency=consistency_to_proto(wanted),
                session=self._secrets.get(session.client.address, b""), tables=table_protos,
            )
            reply = retrying(lambda: session.client.register(request), self.options, session.client.address, "register")
            self._secrets[session.client.address] = reply.session
            session.worker_id, session.generation, session.secret = reply.worker_id, reply.generation, reply.session
            session.client.session = (reply.worker_id, reply.generation, reply.session)
            session.version, session.sequence = reply.version, 0
            session.clock = session.base_clock = reply.clock
            self.consistency = consistency_from_proto(reply.consistency)
            leases.append(reply.lease_seconds)
            joined.append((reply.version, reply.workers_live))
            if reply.HasField("data"):
                positions.append({"step": reply.data.step, "epoch": reply.data.epoch, "position": reply.data.position})
            session.known.clear()
            if not reply.must_initialize:
                return False
            if initial_values is None:
                raise errors.PreconditionError(
                    f"shard {session.client.address} asks this worker to initialise it, but no values were given"
                )
            header = self._header(session, 0)
            buffers = [tensor_bytes(_rows(initial_values[p.name], p)) for p in session.parts]
            # Only a refusal by admission control is retried: it comes before the shard reads the
            # stream, whereas a lost reply may leave the variables written (the shard then refuses
            # a second upload, and registering again sorts it out).
            retrying(lambda: session.client.initialize(header, buffers), self.options, session.client.address,
                     "initialize", retry=(errors.OverloadedError,))
            return True

        initialised = any(self._fan_out(one, range(self.num_shards)))
        if not initialised and self._registrations == 0:
            # Shards hold one job at a time: say so when this worker joins one that was running.
            version, live = max(v for v, _ in joined), max(n for _, n in joined)
            if version or live > 1:
                log.info("%s: joining job %r at version %d, %d worker(s) live (to start a new job instead: "
                         "psctl end-job --ps %s)", worker_name, job_fingerprint, version, live,
                         ",".join(c.address for c in self._clients))
        self._registrations += 1
        self._left = False
        self.fenced.clear()
        self.resume_data = max(positions, key=lambda d: d["step"], default={})
        self.lease_seconds = min((lease for lease in leases if lease > 0), default=0.0)
        if self.lease_seconds and self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeats, name="psclient-heartbeat", daemon=True)
            self._heartbeat.start()
        return initialised

    def _heartbeats(self) -> None:
        """Renew the lease on every shard, three times per lease, from its own thread so that a
        long training step never starves it."""
        while not self._heartbeat_stop.wait(timeout=self.lease_seconds / 3):
            with self._lock:
                sessions = [] if self._left else list(self._sessions)  # a left registration has no lease
            for session in sessions:
                request = ps_pb2.HeartbeatRequest(
                    worker_id=session.worker_id, generation=session.generation, session=session.secret
                )
                try:
                    session.client.heartbeat(request, timeout=max(1.0, self.lease_seconds / 3))
                except errors.FencedError as exc:
                    with self._lock:  # a registration renewed or left meanwhile is not fenced
                        current = (not self._left and any(s is session for s in self._sessions)
                                   and session.generation == request.generation)
                    if current and not self.fenced.is_set():
                        log.warning("%s", exc)
                        self.fenced.set()
                except errors.PSError as exc:
                    log.debug("heartbeat to %s failed: %s", session.client.address, exc)

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
        base_version: int | None = None, rows: Sequence[ps_pb2.RowBlock] = (),
    ) -> tuple[ps_pb2.TensorHeader, list[memoryview]] | None:
        """The next push to ``session`` (None when it holds none of ``grads`` and no ``rows``
        and, in async, needs no clock tick); takes the next sequence number. ``base_version``:
        the version the gradient was computed from, when not that of the last pull. ``rows``:
        this shard's blocks of table rows (``psworker.rowreads.row_blocks``)."""
        parts = [p for p in session.parts if p.name in grads]
        if not parts and not rows and self.consistency.mode is Mode.ASYNC:
            return None
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
        the step (at once, not waiting on a bound)."""
        every = self._require_sessions()
        may_wait = self.consistency.mode is not Mode.ASYNC
        bases = dict(zip(map(id, every), base_versions)) if base_versions is not None else {}
        blocks = dict(zip(map(id, every), row_blocks(self.tables, self.num_shards, rows)))
        # In async a shard holding none of the model (a packed one) and no rows of this step has
        # nothing to apply or send back; in ssp/sync its empty push still advances the clock.
        sessions = every if may_wait else [s for s in every if s.parts or blocks[id(s)]]
        timings: list[tuple[float, float, float]] | None = [] if self.options.on_exchange is not None else None
        plan, reads = self._step_reads(read_rows, every, sessions, may_wait)
        row_outs = {table: out for table, (_, out) in (read_rows or {}).items()}

        def prepare(session: _ShardSession) -> tuple:
            message = self._push_message(session, grads, data, bases.get(id(session)), blocks[id(session)])
            request, dest, nbytes = self._pull_request(
                session, destinations, skip_unchanged=True, may_wait=may_wait,
                clock=session.clock + (message is not None),
            )
            return message, request, dest, nbytes

        def complete(session: _ShardSession, prepared: tuple, started: float, pending=None) -> ps_pb2.PushResponse | None:
            message, request, dest, nbytes = prepared
            address = session.client.address
            reply = None
            read = reads.get(id(session)) if reads else None
            if message is not None:
                attempt = _sent_first(
                    pending, lambda sent: session.client.finish_push_pull(sent, dest),
                    lambda: session.client.push_pull(*message, request, dest, nbytes, may_wait=may_wait,
                                                     rows=read.request if read else None,
                                                     rows_bytes=read.nbytes if read else 0))
                reply, header, written, rows_reply = retrying(attempt, self.options, address, "push and pull")
                session.clock += 1
                if read:
                    if rows_reply is None:
                        raise errors.PSError(f"shard {address} answered a push-and-pull without the table rows it "
                                             "asked for (a shard older than this worker?)")
                    write_rows(address, rows_reply, read, plan, row_outs)
            else:
                header, written = retrying(
                    lambda: session.client.pull(request, dest, nbytes, may_wait=may_wait), self.options, address, "pull"
                )
                if read:  # nothing to push here after all: the rows alone
                    rows_reply = retrying(lambda: session.client.pull_rows(read.request, read.nbytes, may_wait=False),
                                          self.options, address, "pull rows")
                    write_rows(address, rows_reply, read, plan, row_outs)
            self._pulled(session, header, written, destinations)
            if timings is not None:
                pushed = sum(len(b) for b in message[1]) if message is not None else 0
                timings.append(_phases(time.monotonic() - started, pushed, nbytes, may_wait))
            return reply

        if may_wait or len(sessions) == 1 or not self.options.lane_calls:
            replies = self._fan_out_waiting(lambda s: complete(s, prepare(s), time.monotonic()), sessions, may_wait)
        else:
            replies = self._push_pull_whole(sessions, prepare, complete, reads)
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
                                                  rows_bytes=read.nbytes if read else 0)

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
            write_rows(client.address, retrying(attempt, self.options, client.address, "pull rows"), call, plan, out)

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

    def leave(self) -> None:
        """Leave the job on every shard (SSP/sync membership shrinks at once). Best effort:
        errors are logged, not raised, as this runs on the way out."""
        sessions = self._require_sessions()
        # Before the first Leave: a heartbeat to a shard already left is refused ("left the job:
        # re-register") while a Leave to another shard is still under way.
        with self._lock:
            self._left = True

        def one(session: _ShardSession) -> None:
            try:
                session.client.leave(ps_pb2.LeaveRequest(
                    worker_id=session.worker_id, generation=session.generation, session=session.secret
                ))
            except errors.PSError as exc:
                log.warning("leaving %s: %s", session.client.address, exc)

        self._fan_out(one, sessions)

    def data(
        self, plan: ps_pb2.DataPlan | None, finished: Sequence[ps_pb2.DataTask] = (), want: int = 0
    ) -> tuple[int, ps_pb2.DataResponse]:
        """One exchange with the job's data queue on shard 0 (``psworker.elastic``): report
        ``finished`` tasks, lease up to ``want`` more. Returns the registration it was made under
        (:meth:`registration`), and the reply."""
        registration = self._registrations  # before the credentials: a race labels new leases old, and
        session = self._require_sessions()[0]  # the next reply, which names every task held, relabels them
        request = ps_pb2.DataRequest(
            worker_id=session.worker_id, generation=session.generation, session=session.secret, plan=plan,
            finished=finished, want=want,
        )
        return registration, session.client.data(request)

    def registration(self) -> int:
        """How many times this client has registered: it changes with every registration, where
        a shard's generation may repeat one given out before a restore from a checkpoint."""
        return self._registrations

    def _require_sessions(self) -> list[_ShardSession]:
        with self._lock:
            if not self._sessions:
                raise errors.PreconditionError("register (or set_placement) before pull and push")
            return list(self._sessions)

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        super().close()


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
