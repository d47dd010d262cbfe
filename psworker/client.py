"""The worker's side of the wire: a ``PSClient`` that talks to every shard of a job at once,
through one ``psworker.shard.ShardClient`` per shard. It is a ``psworker.admin.AdminClient``
(status, checkpoint, end-job, health, waiting for the shards) that registers, here, and moves
tensors (``psworker.stepcalls.StepCalls`` over ``psworker.exchange.Exchange``, its bases).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pswire import errors
from pswire.consistency import Consistency
from pswire.codec import Part
from pswire.optim import OptimizerConfig
from pswire.placement import Placement, VariableSpec, place
from pswire.tables import TableSpec
from pswire.v1 import ps_pb2
from pswire.wire import consistency_from_proto, consistency_to_proto, optimizer_to_proto, table_to_proto
from psworker.admin import AdminClient
from psworker.exchange import ROWS_PER_CALL, _rows
from psworker.stepcalls import StepCalls
from psworker.options import ClientOptions, parse_addresses
from psworker.retry import retrying
from psworker.shard import ShardClient
from psworker.tensors import tensor_bytes

__all__ = ["ClientOptions", "DataRider", "PSClient", "ROWS_PER_CALL", "ShardClient", "parse_addresses"]

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


class DataRider:
    """A data exchange (:meth:`PSClient.data`'s request) offered to the next step's push-and-pull
    to shard 0 (:meth:`PSClient.offer_data`): the queue answers it in that call's reply, so the
    worker's data requests cost no call of their own. It ends :attr:`done` answered
    (:attr:`reply`), refused (:attr:`refused`, the error a Data call would have raised), or
    neither: it was withdrawn, or the step's call did not carry it or failed, and the caller
    makes the exchange as a call of its own."""

    def __init__(self, request: ps_pb2.DataRequest, registration: int) -> None:
        self.request = request
        self.registration = registration
        """:meth:`PSClient.registration` when the request was made (as :meth:`PSClient.data` returns it)."""
        self.reply: ps_pb2.DataResponse | None = None
        self.refused: errors.PSError | None = None
        self.done = threading.Event()

    def answer(self, reply: ps_pb2.DataResponse | None, refused: errors.PSError | None) -> None:
        """The step's call came back: the queue's reply or refusal (both None: it carried none)."""
        if not self.done.is_set():
            self.reply, self.refused = reply, refused
            self.done.set()

    def unanswered(self) -> None:
        """The step's call ended without an answer to it (or never took it)."""
        self.answer(None, None)


class PSClient(StepCalls, AdminClient):
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
        self._rider: DataRider | None = None
        """A data exchange waiting for the next push-and-pull to shard 0 (``offer_data``)."""
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

    def offer_data(
        self, plan: ps_pb2.DataPlan | None, finished: Sequence[ps_pb2.DataTask] = (), want: int = 0
    ) -> DataRider:
        """:meth:`data`'s exchange, to ride on the next step's push-and-pull to shard 0 instead
        of a call of its own: wait on the rider's ``done``, and :meth:`withdraw_data` it when no
        step comes soon enough. One at a time: a new offer replaces one not yet taken (which
        ends unanswered)."""
        registration = self._registrations
        session = self._require_sessions()[0]
        rider = DataRider(ps_pb2.DataRequest(
            worker_id=session.worker_id, generation=session.generation, session=session.secret, plan=plan,
            finished=finished, want=want,
        ), registration)
        with self._lock:
            replaced, self._rider = self._rider, rider
        if replaced is not None:
            replaced.unanswered()
        return rider

    def withdraw_data(self, rider: DataRider) -> None:
        """Take back ``rider`` if no step's call has taken it yet: it ends unanswered at once.
        Else the call that took it settles it when it ends."""
        with self._lock:
            if self._rider is not rider:
                return
            self._rider = None
        rider.unanswered()

    def _take_rider(self, session: _ShardSession) -> DataRider | None:
        # The offered exchange, for a push-and-pull to ``session`` (shard 0's, of the registration
        # the request names: one made before this worker registered again ends unanswered).
        if self._rider is None:  # every step asks: no lock when nothing is offered (the usual case)
            return None
        with self._lock:
            rider = self._rider
            if rider is None or not self._sessions or session is not self._sessions[0]:
                return None
            self._rider = None
        if (rider.request.worker_id, rider.request.generation, rider.request.session) != (
                session.worker_id, session.generation, session.secret):
            rider.unanswered()
            return None
        return rider

    def registration(self) -> int:
        """How many times this client has registered: it changes with every registration, where
        a shard's generation may repeat one given out before a restore from a checkpoint."""
        return self._registrations

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        super().close()
