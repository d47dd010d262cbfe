"""Dynamic data on the worker's side: identical workers, no indices, the data shared exactly.

The job's data queue lives on shard 0 (``psserver.dataqueue``). A :class:`DataFeed` leases data
tasks from it (ranges of an epoch's seeded permutation) ``prefetch`` at a time, ahead of need, so
that asking never stalls a step: when the tasks in hand run out, one exchange, prepared on a
background thread while the worker trains, leases the next ones and carries the reports of the
tasks finished meanwhile (each reported once every push of its examples was acknowledged). The
exchange rides on the worker's next step (``PSClient.offer_data``: its push-and-pull to shard 0
carries it), so it costs no call of its own: as calls of their own, exchanges every two tasks
cost a 15K-parameter model about 4% of its throughput on 2 busy cores (psbench, side by side).
It hands back what it has not trained when it closes.

In PyTorch's own terms, :class:`ElasticSampler` is the ``Sampler`` that plays for a parameter
server job the role ``DistributedSampler`` plays for torchrun::

    session = psworker.connect("ps0:7000,ps1:7000")
    model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sampler = psworker.ElasticSampler(session, len(dataset), seed=0, epochs=2)
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)
    while not sampler.finished:       # until the job's data is done, whoever trains it
        for x, y in loader:
            loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
    session.close()   # reports the last task, hands back anything unfinished, leaves
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pswire import errors
from pswire.consistency import Mode
from pswire.data import MAX_HELD, DataPlan, DataTask
from pswire.v1 import ps_pb2
from pswire.wire import data_plan_to_proto, data_task_to_proto

if TYPE_CHECKING:
    from psworker.api import Session
    from psworker.client import DataRider

__all__ = ["DataFeed", "ElasticSampler", "LEASE_AHEAD_SECONDS", "Lease", "RIDE_SECONDS", "default_task_size",
           "epoch_order"]

LEASE_AHEAD_SECONDS = 0.05
"""A worker leases enough tasks ahead to train this long (at least ``DataFeed``'s ``prefetch``, at
most what a worker may hold, and no more than its share of the tasks left): fast steps then ask
for data less often. As calls of their own, exchanges cost a call of the worker and of shard 0
whatever they leased: psbench's side-by-side runs of the 15K MLP (whose whole model lives on
shard 0, beside the queue) measured dynamic / static at a median 0.96 with 0.05 s (two tasks
ahead at the 28 ms a task takes there) and 0.98-1.00 with 0.15 s (six), docs/benchmarks.md;
riding on the steps (``RIDE_SECONDS``), 0.99 with 0.05 s. Up to 31 ahead since
a worker may hold 32 tasks. Not longer than 0.05 s: every task a worker holds spreads the job's
order over more of the epochs (tasks of later epochs trained beside earlier ones). On a small
dataset 0.2 s (5 tasks ahead for mnist1d-cnn's 43 ms tasks, 4 workers holding some 1.8 of its
4,000-example epochs) ended the job a median 1.7 points lower than 0.05 s over 6 seeds, and
with 0.15 s (4 ahead) the compose cluster's crashed-shard run ended at 0.915 against 0.95
uninterrupted, outside its 2-point band (one CI run): the cheaper exchange came from riding on
the push instead, not from holding more."""

RIDE_SECONDS = 0.2
"""How long an exchange due on the background thread waits for a step's push-and-pull to shard 0
to carry it before it is made as a call of its own. A step comes well within it while the worker
trains (the tasks in hand last longer); when steps are slower than this, one call more per
exchange is nothing beside them. The training side never waits for a ride: when it needs a task
now, the ride is withdrawn and the exchange made at once."""

log = logging.getLogger(__name__)

TASK_EXAMPLES = 256
"""The default data task's size, rounded to whole batches: large enough that one exchange per
task is nothing beside its steps, small enough that a lost worker costs little to redo."""


def epoch_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s permutation of ``range(size)``: the same on every worker and every run."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=gen)


def default_task_size(batch_size: int) -> int:
    """About ``TASK_EXAMPLES`` examples, in whole batches."""
    return batch_size * max(1, round(TASK_EXAMPLES / batch_size))


@dataclass(frozen=True)
class Lease:
    """A data task leased to this worker's ``registration`` (``PSClient.registration()``): a
    task leased before the worker registered again went back to the queue."""

    task: DataTask
    registration: int


class DataFeed:
    """A worker's side of the job's data queue.

    :meth:`next_task` hands out the next leased task (waiting while the tasks left are held by
    other workers), :meth:`finish` reports one, :meth:`close` hands back the rest. While it
    waits in an ssp or sync job the worker leaves the membership, so that no clock waits on it,
    and registers again when a task comes free. Thread-safe; exchanges run one at a time.
    """

    def __init__(self, session: "Session", plan: DataPlan, *, prefetch: int = 2, poll_seconds: float = 0.25) -> None:
        if not 0 <= prefetch < MAX_HELD:
            raise ValueError(f"prefetch must be in 0..{MAX_HELD - 1} (a worker holds at most {MAX_HELD} tasks), "
                             f"got {prefetch}")
        self.plan = plan
        self._session = session
        self._prefetch = prefetch
        self._task_seconds: float | None = None
        """How long a task takes this worker to train (a moving average), once two were handed out."""
        self._handed_at: float | None = None
        self._poll = poll_seconds
        self._lock = threading.Lock()
        self._kick = threading.Condition(self._lock)
        self._exchanging = threading.Lock()
        self._ready: deque[Lease] = deque()
        self._held: set[Lease] = set()
        """Every task this worker holds: ready, in training, or reported and not yet acknowledged."""
        self._reports: list[tuple[Lease, int]] = []
        self._fenced = False
        self._finished = False
        self._closed = False
        self.queue: ps_pb2.DataQueueStatus | None = None
        """The queue as the last reply described it."""
        self.tasks = 0
        self.examples = 0
        """Tasks finished, and examples trained, by this worker."""
        self.wait_seconds = 0.0
        """Time :meth:`next_task` spent waiting for a task to come free."""
        self.stalls = 0
        self.stall_seconds = 0.0
        """Exchanges :meth:`next_task` made itself, having no task ready (the prefetch late or
        none free), and the time they took."""
        self.rides = 0
        """Exchanges that rode on a step's push-and-pull (the others were calls of their own)."""
        self._riding: DataRider | None = None
        """The background exchange's rider while it waits for a step to carry it."""
        self._needed = False
        """The training side is making an exchange itself (no task ready): none rides meanwhile."""
        self.current: tuple[Lease, int] | None = None
        """The task in training and how many of its examples are trained (kept by the caller,
        for :meth:`close`)."""
        self._thread = threading.Thread(target=self._background, name="psworker-data", daemon=True)
        self._thread.start()

    # -- the training side ----------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The job's data is done, as the last reply said."""
        return self._finished

    def next_task(self, stop: threading.Event | None = None, *, wait: bool = True) -> Lease | None:
        """The next task to train, or None once the job's data is done (or ``stop`` is set),
        or, with ``wait`` False, when no task is free now (:attr:`finished` tells which).
        Raises ``pswire.errors.PSError`` when the queue refuses (a different plan, say)."""
        waited_from = None
        try:
            while stop is None or not stop.is_set():
                registration = self._session.client.registration()
                with self._lock:
                    stale = [lease for lease in self._ready if lease.registration != registration]
                    for lease in stale:  # they went back to the queue when this worker re-registered
                        self._ready.remove(lease)
                        self._held.discard(lease)
                    if self._ready:
                        lease = self._ready.popleft()
                        self._timed()
                        if self._due():  # prefetch the next ones meanwhile (waking the thread only then)
                            self._kick.notify_all()
                        return lease
                    fenced, self._fenced = self._fenced, False
                if self._session.left and not fenced:
                    fenced = self._parked_may_resume()
                    if not fenced:
                        waited_from = waited_from or time.monotonic()
                        self._pause(stop)
                        continue
                if fenced:
                    self._session.rejoin()
                    continue
                exchanged_from = time.monotonic()
                self._exchange(target=1 + self._ahead(), needed=True)
                with self._lock:
                    self.stall_seconds += time.monotonic() - exchanged_from
                    self.stalls += 1
                    if self._ready or self._fenced:
                        continue
                    if self._finished or not wait:
                        return None
                # Nothing free: the tasks left are leased to others (and come back if they die).
                waited_from = waited_from or time.monotonic()
                if self._session.client.consistency.mode is not Mode.ASYNC and not self._session.left:
                    log.info("%s: no data task free (the rest are held by other workers); leaving the %s "
                             "membership while it waits", self._session.worker_name,
                             self._session.client.consistency.mode.value)
                    self._session.leave()
                self._pause(stop)
            return None
        finally:
            if waited_from is not None:
                self.wait_seconds += time.monotonic() - waited_from

    def _parked_may_resume(self) -> bool:
        # A worker that left to wait asks (want 0) whether a task came free or the job ended:
        # then, or when the shard fenced it meanwhile, it registers again.
        status = self._exchange(target=0)
        with self._lock:
            self._fenced = False
        return status is None or status.tasks_queued > 0 or status.finished

    def _pause(self, stop: threading.Event | None) -> None:
        (stop or threading.Event()).wait(self._poll)

    def finish(self, lease: Lease, trained: int | None = None) -> None:
        """``lease``'s task is done (``trained`` None: all of it), or only its first ``trained``
        examples are: the rest goes back to the queue. Reported with the next exchange: at once
        on the background thread when one is due (see ``_due``), else with the one that leases
        the next tasks."""
        trained = lease.task.size if trained is None else trained
        if not 0 <= trained <= lease.task.size:
            raise ValueError(f"{trained} examples of {lease.task} cannot have been trained")
        with self._lock:
            self._reports.append((lease, trained))
            self.examples += trained
            self.tasks += trained == lease.task.size
            if self._due():  # else the report rides on the exchange that leases the next tasks
                self._kick.notify_all()

    def close(self, *, current: tuple[Lease, int] | None = None) -> None:
        """Hand back what this worker holds, ``current`` with what was trained of it and the
        prefetched tasks whole, then wait for the report to reach the queue (best effort: a
        worker that cannot report has its tasks given back when it leaves or is evicted)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if current is not None:
                lease, trained = current
                self._reports.append((lease, trained))
                self.examples += trained
            self._reports.extend((lease, 0) for lease in self._ready)
            self._ready.clear()
            self._kick.notify_all()
            rider = self._riding
        if rider is not None:  # no step will carry it now
            self._session.client.withdraw_data(rider)
        self._thread.join(timeout=self._session.client.options.timeout)
        if self._reports and not self._session.left:
            try:
                self._exchange(target=0)
            except errors.PSError as exc:
                log.warning("%s: handing back data tasks: %s", self._session.worker_name, exc)

    # -- exchanges ------------------------------------------------------------------------------

    def _timed(self) -> None:
        # Caller holds _lock. A task was handed out: how long the last one took to train.
        now = time.monotonic()
        if self._handed_at is not None:
            took = now - self._handed_at
            self._task_seconds = took if self._task_seconds is None else 0.8 * self._task_seconds + 0.2 * took
        self._handed_at = now

    def _ahead(self) -> int:
        # Caller holds _lock, or reads a stale figure harmlessly. How many tasks to lease ahead:
        # ``prefetch``, or as many as LEASE_AHEAD_SECONDS of training when tasks go faster (an
        # exchange costs a call of the worker and of shard 0 whatever it leases: at a thousand
        # small steps a second, two tasks ahead meant an exchange every 8 ms), up to what a worker
        # may hold and no more than its share of what is left, so that the job's end is not
        # held up by tasks waiting in one worker's hands.
        if not self._prefetch or self._task_seconds is None:
            return self._prefetch
        ahead = min(MAX_HELD - 1, math.ceil(LEASE_AHEAD_SECONDS / max(self._task_seconds, 1e-6)))
        queue = self.queue
        if queue is not None:
            workers = max(1, len({h.worker_name for h in queue.holders}))
            ahead = min(ahead, queue.tasks_queued // (2 * workers))
        return max(self._prefetch, ahead)

    def _leasing(self) -> bool:
        # Caller holds _lock. Whether this worker leases now (not done, fenced off or waiting outside).
        return not (self._finished or self._fenced or self._session.left)

    def _due(self) -> bool:
        # Caller holds _lock. An exchange is due when the prefetched tasks ran out (it leases the
        # next ``prefetch`` at once, and carries the reports gathered meanwhile: one exchange per
        # ``prefetch`` tasks), or, with no prefetching, as soon as there is a report.
        if self._prefetch and self._leasing():
            return not self._ready
        return bool(self._reports)

    def _background(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._due():
                    self._kick.wait()
                if self._closed:
                    return
                leasing = self._leasing()
                target = self._ahead() if leasing else 0
            try:
                self._exchange(target=target, ride=leasing)
            except errors.PSError as exc:
                # The training side meets the same refusal on its next exchange and raises it.
                log.warning("%s: data exchange failed: %s", self._session.worker_name, exc)
            with self._lock:
                if not self._closed and self._due():  # nothing free (or a refusal): look again later
                    self._kick.wait(self._poll)

    def _ask(self, finished: list[ps_pb2.DataTask], want: int, *, ride: bool) -> tuple[int, ps_pb2.DataResponse]:
        # The exchange's call: on the next step's push-and-pull when ``ride`` and one comes soon
        # enough, else (or when that call did not carry it) a call of its own. Returns
        # ``PSClient.data``'s (registration, reply); raises the queue's refusal as it does.
        client = self._session.client
        plan = data_plan_to_proto(self.plan)
        with self._lock:
            rider = client.offer_data(plan, finished, want) if ride and not self._needed else None
            self._riding = rider
        if rider is not None:
            try:
                if not rider.done.wait(RIDE_SECONDS):
                    client.withdraw_data(rider)  # ends it, unless a step's call has it: then that call does
                    rider.done.wait(client.options.timeout + client.options.retry_timeout)
            finally:
                with self._lock:
                    self._riding = None
            if rider.refused is not None:
                raise rider.refused
            if rider.reply is not None:
                self.rides += 1
                return rider.registration, rider.reply
        return client.data(plan, finished, want)

    def _exchange(self, *, target: int, ride: bool = False, needed: bool = False) -> ps_pb2.DataQueueStatus | None:
        """One request: send the pending reports, lease enough to have ``target`` tasks ready.
        ``ride``: on the next step's push-and-pull to shard 0 when one comes within
        ``RIDE_SECONDS`` (else as a call of its own). ``needed``: the training side has no task,
        so a ride under way gives up at once, and none is made when one brought tasks meanwhile.
        Returns the queue's status, or None when this worker was fenced (its tasks went back;
        it must re-register)."""
        if not needed:
            return self._exchange_now(target, ride, needed)
        with self._lock:
            self._needed = True  # an exchange the background thread starts meanwhile does not ride
            rider = self._riding
        if rider is not None:
            self._session.client.withdraw_data(rider)
        try:
            return self._exchange_now(target, ride, needed)
        finally:
            with self._lock:
                self._needed = False

    def _exchange_now(self, target: int, ride: bool, needed: bool) -> ps_pb2.DataQueueStatus | None:
        with self._exchanging:
            registration = self._session.client.registration()
            with self._lock:
                if needed and self._ready:
                    return self.queue
                want = max(0, target - len(self._ready))
                dropped = [r for r in self._reports if r[0].registration != registration]
                self._reports = [r for r in self._reports if r[0].registration == registration]
                sent = list(self._reports)
                for lease, _ in dropped:  # given back when this worker re-registered
                    self._held.discard(lease)
                    log.info("%s: %s went back to the queue when this worker re-registered",
                             self._session.worker_name, lease.task)
            refused: list[tuple[Lease, int]] = []
            try:
                try:
                    registration, reply = self._ask(
                        [data_task_to_proto(lease.task, n) for lease, n in sent], want, ride=ride,
                    )
                except errors.PreconditionError as exc:
                    if not sent:
                        raise
                    # A report the queue does not match: a retried request whose first copy was
                    # applied, or a task that went back; the request changed nothing. Ask again
                    # without the reports; those of tasks the reply still names as held are sent
                    # again next time, the others are not this worker's any more.
                    log.warning("%s: data report refused (%s)", self._session.worker_name, exc)
                    refused, sent = sent, []
                    with self._lock:
                        self._reports = [r for r in self._reports if r not in refused]
                    registration, reply = self._session.client.data(data_plan_to_proto(self.plan), [], want)
            except errors.FencedError as exc:
                log.warning("%s: the data queue fenced this worker off (%s); its tasks went back",
                            self._session.worker_name, exc)
                with self._lock:
                    self._fenced = True
                    self._held -= {lease for lease, _ in sent}
                    self._reports = [r for r in self._reports if r not in sent]
                return None
            with self._lock:
                self._reports = [r for r in self._reports if r not in sent]
                self._held -= {lease for lease, _ in sent}
                held = {Lease(DataTask(t.epoch, t.start, t.end), registration) for t in reply.tasks}
                for lease, trained in refused:
                    if lease in held:
                        self._reports.append((lease, trained))
                    else:
                        self._held.discard(lease)
                for proto in reply.tasks:
                    lease = Lease(DataTask(proto.epoch, proto.start, proto.end), registration)
                    if lease not in self._held:
                        self._held.add(lease)
                        self._ready.append(lease)
                self.queue = reply.queue
                self._finished = reply.queue.finished
                self._kick.notify_all()
            return reply.queue


class ElasticSampler(torch.utils.data.Sampler[int]):
    """A ``Sampler`` over ``size`` examples whose indices come from the data tasks the job leases
    to this worker: identical workers share the job's data exactly, however many there are and
    whenever they join or leave.

    Iterating yields every index of each leased task, epoch by epoch in the job's seeded order
    (every worker must give the same ``size``, ``seed``, ``task_size`` and length: ``epochs`` or
    ``total`` examples across all workers). A pass ends when the job's data is done, or when no
    task is free while indices this worker took are still on their way through the loader (the
    job cannot finish before they are trained, so the pass ends rather than waits). To stay
    until the job is done, and pick up tasks that other workers give back::

        while not sampler.finished:
            for x, y in loader:
                ...

    A task counts as trained once the optimizer has stepped after its last index was taken,
    plus ``lag`` steps for a ``DataLoader`` that fetches ahead (``num_workers * prefetch_factor``
    batches; 0 for the default loader), and, in any case, when the next pass starts (the loop
    stepped on every batch of the last one). Then a worker that dies loses no example and
    repeats none of the tasks it reported. ``session.close()`` reports the last tasks, with
    what the lag rule says was trained of them, and hands back the rest.
    """

    def __init__(
        self,
        session: "Session",
        size: int,
        *,
        seed: int = 0,
        task_size: int = TASK_EXAMPLES,
        epochs: float = 1.0,
        total: int | None = None,
        prefetch: int = 2,
        lag: int = 0,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        if total is None:
            if epochs <= 0:
                raise ValueError(f"epochs must be > 0, got {epochs}")
            total = max(1, round(epochs * size))
        plan = DataPlan(examples=size, task_size=task_size, seed=seed, total=total)
        self.session = session
        self.feed = DataFeed(session, plan, prefetch=prefetch)
        self._lag = lag + (1 if session.overlap else 0)  # with overlap a step's push lands one step later
        self._lock = threading.Lock()
        self._taken: list[tuple[Lease, list[int]]] = []
        """Tasks being yielded or trained: the lease and the step count when each index was taken."""
        self._order: tuple[int, torch.Tensor] | None = None
        session.add_step_hook(self._stepped)
        session.add_close_hook(self._close)

    @property
    def finished(self) -> bool:
        """The job's data is done: iterating yields nothing more."""
        return self.feed.finished

    def __iter__(self) -> Iterator[int]:
        # A new pass starts once the loop has stepped on every batch of the last one.
        self._confirm(everything=True)
        while True:
            # Never wait for other workers' tasks while this one's indices are still in the
            # loader: the job cannot finish before they are trained. End the pass instead.
            with self._lock:
                in_hand = bool(self._taken)
            lease = self.feed.next_task(wait=not in_hand)
            if lease is None:
                return
            task = lease.task
            if self._order is None or self._order[0] != task.epoch:
                self._order = (task.epoch, epoch_order(self.feed.plan.examples, self.feed.plan.seed, task.epoch))
            steps: list[int] = []
            with self._lock:
                self._taken.append((lease, steps))
            for index in self._order[1][task.start:task.end].tolist():
                if self.session.client.registration() != lease.registration:
                    with self._lock:  # fenced and registered again: the task went back to the queue
                        self._taken = [(held, taken) for held, taken in self._taken if held != lease]
                    break
                steps.append(self.session.steps)
                yield index

    def _trained(self, steps: list[int]) -> int:
        # Indices are taken in order: those taken more than lag steps before the last step are in.
        now = self.session.steps
        return sum(1 for taken in steps if taken + 1 + self._lag <= now)

    def _stepped(self) -> None:
        self._confirm(everything=False)

    def _confirm(self, *, everything: bool) -> None:
        # Report the tasks whose every index is trained (``everything``: every task taken whole).
        registration = self.session.client.registration()
        with self._lock:
            keep = []
            for lease, steps in self._taken:
                if lease.registration != registration:
                    continue  # went back to the queue when this worker was fenced
                whole = len(steps) == lease.task.size
                if whole and (everything or self._trained(steps) == lease.task.size):
                    self.feed.finish(lease)
                elif not everything or not whole:
                    keep.append((lease, steps))
            self._taken = keep

    def _close(self) -> None:
        registration = self.session.client.registration()
        with self._lock:
            taken, self._taken = self._taken, []
        current = [(lease, self._trained(steps)) for lease, steps in taken if lease.registration == registration]
        for lease, trained in current[:-1]:
            self.feed.finish(lease, trained)
        self.feed.close(current=current[-1] if current else None)
