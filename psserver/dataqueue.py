"""The job's data queue (dynamic data): which examples are trained, being trained, and waiting.

Every epoch is a seeded permutation of the example indices, the same on every worker (the
worker computes it; the queue deals only in positions). An epoch's positions are cut into data
tasks of ``task_size`` contiguous positions, leased to workers on request. A worker reports each
task finished with how much of it it trained (every push of those examples acknowledged); what
it did not train goes back to the queue, as do the tasks of a worker that leaves, is evicted or
registers again. Tasks given back are leased again before new ones are cut.

Pure Python with no lock of its own: the store calls it under its lock, so that a checkpoint
holds the queue exactly as it was when the variables were copied. State is O(tasks held and
given back), never O(examples): the tasks not yet cut are one frontier.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pswire.errors import InvalidArgumentError, PreconditionError
from pswire.data import MAX_HELD, DataPlan, DataTask
from pswire.wire import MAX_COUNT

__all__ = ["DataQueue", "MAX_HELD"]

@dataclass
class _Lease:
    task: DataTask
    holder: str
    generation: int
    since: float = field(default_factory=time.time)


class DataQueue:
    """The queue of one job's data tasks. Every method either completes or raises a
    ``pswire.errors`` error with the queue unchanged."""

    def __init__(self, plan: DataPlan) -> None:
        self.plan = plan
        self._frontier = 0
        """Examples cut into tasks so far, counted across epochs (epoch = frontier // examples)."""
        self._queued: deque[DataTask] = deque()
        """Tasks given back, leased again before new ones are cut (oldest first)."""
        self._leased: dict[tuple[int, int], _Lease] = {}
        self.tasks_done = 0
        self.examples_done = 0
        self.tasks_requeued = 0

    # -- leasing ------------------------------------------------------------------------------

    @classmethod
    def for_plan(cls, queue: "DataQueue | None", plan: DataPlan | None, who: str) -> "DataQueue":
        """The job's queue for a request carrying ``plan`` (None: whatever the job's is): a new
        one when the job has none yet. Raises ``PreconditionError`` without a plan to start
        from, or for a plan that differs from the job's (naming both)."""
        if queue is None:
            if plan is None:
                raise PreconditionError("this job has no data plan yet: the first worker's request sets it")
            return cls(plan)
        if plan is not None and plan != queue.plan:
            raise PreconditionError(
                f"the job's data plan is {queue.plan.describe()}; {who} asks for {plan.describe()} "
                "(every worker of the job must use the same dataset, task size, seed and length)"
            )
        return queue

    def exchange(
        self, holder: str, generation: int, finished: Sequence[tuple[DataTask, int]], want: int
    ) -> list[DataTask]:
        """One request of ``holder``'s registration ``generation``: stop holding each ``(task,
        trained)`` of ``finished`` (:meth:`finish`), then lease up to ``want`` more. Every part
        is checked before anything changes. Returns every task the registration holds now.
        Raises as :meth:`finish` and :meth:`lease` do, and ``InvalidArgumentError`` for a task
        reported twice."""
        self._check_want(want)
        keys = [(t.epoch, t.start) for t, _ in finished]
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("a data task is reported finished twice in one request")
        for task, trained in finished:
            self.check_finish(holder, generation, task, trained)
        for task, trained in finished:
            self.finish(holder, generation, task, trained)
        self.lease(holder, generation, want)
        return self.held_by(holder, generation)

    @staticmethod
    def _check_want(want: int) -> None:
        if not 0 <= want <= MAX_HELD:
            raise InvalidArgumentError(f"a worker may ask for 0..{MAX_HELD} data tasks at once, not {want}")

    def lease(self, holder: str, generation: int, want: int) -> list[DataTask]:
        """Lease up to ``want`` tasks to ``holder`` (generation ``generation``), given-back ones
        first, never taking it above ``MAX_HELD``. Returns fewer (or none) when the queue has
        nothing free: the rest is leased to others, or the job's data is done."""
        self._check_want(want)
        room = MAX_HELD - sum(1 for lease in self._leased.values() if lease.holder == holder)
        tasks = []
        while len(tasks) < min(want, room):
            task = self._queued.popleft() if self._queued else self._cut()
            if task is None:
                break
            self._leased[(task.epoch, task.start)] = _Lease(task, holder, generation)
            tasks.append(task)
        return tasks

    def _cut(self) -> DataTask | None:
        plan = self.plan
        if self._frontier >= plan.total:
            return None
        epoch, start = divmod(self._frontier, plan.examples)
        end = min(plan.examples, start + plan.task_size, start + plan.total - self._frontier)
        self._frontier += end - start
        return DataTask(epoch, start, end)

    def check_finish(self, holder: str, generation: int, task: DataTask, trained: int) -> None:
        """Raise as :meth:`finish` would, changing nothing."""
        lease = self._leased.get((task.epoch, task.start))
        if lease is None or lease.task != task or lease.holder != holder or lease.generation != generation:
            raise PreconditionError(
                f"data task {task} is not leased to {holder} (generation {generation}): it went back to the "
                "queue when this registration ended, or was never this worker's"
            )
        if not 0 <= trained <= task.size:
            raise InvalidArgumentError(f"data task {task} has {task.size} examples; {trained} cannot have been trained")

    def finish(self, holder: str, generation: int, task: DataTask, trained: int) -> None:
        """``holder`` stops holding ``task`` having trained its first ``trained`` examples: all
        of them, and the task is done; fewer, and the rest goes back to the front of the queue.
        Raises ``PreconditionError`` when the task is not leased to this registration (it was
        given back when the worker was evicted or registered again), ``InvalidArgumentError``
        when ``trained`` is not in 0..size."""
        self.check_finish(holder, generation, task, trained)
        del self._leased[(task.epoch, task.start)]
        self.examples_done += trained
        if trained == task.size:
            self.tasks_done += 1
        else:
            self._queued.appendleft(DataTask(task.epoch, task.start + trained, task.end))
            self.tasks_requeued += 1

    def release(self, holder: str, *, below: int | None = None) -> list[DataTask]:
        """Give every task ``holder`` holds (of generations below ``below``, when given) back
        to the front of the queue: the worker left, was evicted or registered again. Returns
        them."""
        gone = [key for key, lease in self._leased.items()
                if lease.holder == holder and (below is None or lease.generation < below)]
        tasks = [self._leased.pop(key).task for key in gone]
        self._queued.extendleft(reversed(tasks))
        self.tasks_requeued += len(tasks)
        return tasks

    # -- views ---------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every example of the job trained."""
        return self._frontier >= self.plan.total and not self._queued and not self._leased

    def held_by(self, holder: str, generation: int) -> list[DataTask]:
        """The tasks leased to ``holder``'s registration ``generation``, oldest first."""
        return [lease.task for lease in self._leased.values()
                if lease.holder == holder and lease.generation == generation]

    def _uncut_tasks(self) -> int:
        plan, left = self.plan, self.plan.total - self._frontier
        if left <= 0:
            return 0
        start = self._frontier % plan.examples
        first = min(left, plan.examples - start)  # the rest of the current epoch
        tasks = -(-first // plan.task_size)
        left -= first
        whole, rest = divmod(left, plan.examples)
        return tasks + whole * -(-plan.examples // plan.task_size) + -(-rest // plan.task_size)

    def status(self) -> dict[str, Any]:
        """Plain data for Status and metrics."""
        epochs = [t.epoch for t in self._queued] + [lease.task.epoch for lease in self._leased.values()]
        if self._frontier < self.plan.total:
            epochs.append(self._frontier // self.plan.examples)
        return {
            "active": True,
            "plan": self.plan,
            "epoch": min(epochs, default=(self.plan.total - 1) // self.plan.examples),
            "tasks_done": self.tasks_done,
            "tasks_leased": len(self._leased),
            "tasks_queued": len(self._queued) + self._uncut_tasks(),
            "tasks_requeued": self.tasks_requeued,
            "examples_done": self.examples_done,
            "examples_total": self.plan.total,
            "finished": self.finished,
            "holders": [(lease.holder, lease.generation, lease.task) for lease in self._leased.values()],
        }

    # -- checkpoints --------------------------------------------------------------------------

    def encode(self) -> dict[str, Any]:
        """The queue as JSON-ready data for a checkpoint's metadata."""
        return {
            "plan": self.plan.to_dict(),
            "frontier": self._frontier,
            "queued": [[t.epoch, t.start, t.end] for t in self._queued],
            "leased": [[lease.task.epoch, lease.task.start, lease.task.end] for lease in self._leased.values()],
            "tasks_done": self.tasks_done,
            "examples_done": self.examples_done,
            "tasks_requeued": self.tasks_requeued,
        }

    @classmethod
    def decode(cls, doc: Any) -> "DataQueue":
        """A queue from :meth:`encode`'s data, with the tasks that were leased queued again
        (their holders are fenced by the restore). Raises ``ValueError`` naming the first
        problem: a task outside the plan, overlapping another, or ahead of the frontier."""
        try:
            plan = DataPlan(**{k: _count(doc["plan"][k], f"plan's {k}")
                               for k in ("examples", "task_size", "seed", "total")})
        except (InvalidArgumentError, KeyError, TypeError) as exc:
            raise ValueError(f"data queue: bad plan: {exc}") from None
        queue = cls(plan)
        try:
            queue._frontier = _count(doc["frontier"], "frontier")
            tasks = [DataTask(*(_count(v, "task bound") for v in t)) for t in doc["leased"] + doc["queued"]]
            for name in ("tasks_done", "examples_done", "tasks_requeued"):
                setattr(queue, name, _count(doc.get(name, 0), name))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"data queue: malformed: {exc}") from None
        if queue._frontier > plan.total:
            raise ValueError(f"data queue: frontier {queue._frontier} is beyond the plan's {plan.total} examples")
        for task in tasks:
            first = task.epoch * plan.examples + task.start
            if not (task.start < task.end <= plan.examples and first + task.size <= queue._frontier):
                raise ValueError(f"data queue: task {task} lies outside the data cut so far")
        ordered = sorted(tasks, key=lambda t: (t.epoch, t.start))
        for before, after in zip(ordered, ordered[1:]):
            if before.epoch == after.epoch and after.start < before.end:
                raise ValueError(f"data queue: task {after} overlaps {before}")
        queue._queued.extend(tasks)
        return queue


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"data queue: {what} is {value!r}, not a count in 0..{MAX_COUNT}")
    return value
