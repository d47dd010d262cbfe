"""The job's data queue (``psserver.dataqueue``), pure: cutting epochs into tasks, leasing,
finishing (whole and partial), giving back, refusals that change nothing, and checkpoints.

A hypothesis property drives random sequences of leases, partial finishes, releases,
re-registrations and checkpoint round trips by several workers, then drains the queue: the
ranges reported trained cover every example of the job exactly once."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psserver.dataqueue import MAX_HELD, DataQueue
from pswire.data import DataPlan, DataTask
from pswire.errors import InvalidArgumentError, PreconditionError
from pswire.wire import MAX_COUNT

pytestmark = pytest.mark.timeout(120)


def plan(examples: int = 10, task_size: int = 4, total: int | None = None, seed: int = 7) -> DataPlan:
    return DataPlan(examples=examples, task_size=task_size, seed=seed, total=examples if total is None else total)


def drain(queue: DataQueue, holder: str = "drain") -> list[DataTask]:
    """Lease (and finish whole) every task left; returns them in the order leased."""
    leased = []
    while batch := queue.lease(holder, 1, MAX_HELD):
        for task in batch:
            queue.finish(holder, 1, task, task.size)
        leased += batch
    return leased


def state(queue: DataQueue) -> tuple:
    """Everything a refusal must leave as it was."""
    return queue.encode(), queue.status(), {h: queue.held_by(h, g) for h, g, _ in queue.status()["holders"]}


# -- cutting ---------------------------------------------------------------------------------


def test_tasks_are_cut_in_order_with_a_short_last_task_per_epoch():
    queue = DataQueue(plan(examples=10, task_size=4, total=20))
    assert queue.lease("a", 1, 5) == [DataTask(0, 0, 4), DataTask(0, 4, 8), DataTask(0, 8, 10),
                                      DataTask(1, 0, 4), DataTask(1, 4, 8)]
    assert queue.lease("b", 1, 5) == [DataTask(1, 8, 10)]
    assert queue.lease("b", 1, 5) == []  # all leased: nothing free, but not finished either
    assert not queue.finished


def test_a_total_that_ends_mid_epoch_cuts_the_last_epoch_short():
    queue = DataQueue(plan(examples=10, task_size=4, total=23))
    st0 = queue.status()
    assert (st0["epoch"], st0["tasks_queued"], st0["examples_total"]) == (0, 7, 23)
    tasks = drain(queue)
    assert tasks == [DataTask(0, 0, 4), DataTask(0, 4, 8), DataTask(0, 8, 10), DataTask(1, 0, 4),
                     DataTask(1, 4, 8), DataTask(1, 8, 10), DataTask(2, 0, 3)]
    assert sum(t.size for t in tasks) == 23
    done = queue.status()
    assert done["finished"] and done["tasks_done"] == 7 and done["examples_done"] == 23
    assert (done["tasks_queued"], done["tasks_leased"], done["epoch"]) == (0, 0, 2)


def test_a_total_below_one_epoch_and_a_task_larger_than_the_data():
    queue = DataQueue(plan(examples=10, task_size=100, total=7))
    assert queue.status()["tasks_queued"] == 1
    assert drain(queue) == [DataTask(0, 0, 7)]
    queue = DataQueue(plan(examples=3, task_size=100, total=7))
    assert drain(queue) == [DataTask(0, 0, 3), DataTask(1, 0, 3), DataTask(2, 0, 1)]


@pytest.mark.parametrize("examples,task_size,total", [
    (10, 4, 10), (10, 4, 23), (10, 5, 30), (7, 1, 15), (1, 1, 4), (10, 10, 9), (10, 3, 1), (6, 4, 6 * 3 + 5),
])
def test_tasks_queued_counts_exactly_the_tasks_a_drain_leases(examples, task_size, total):
    queue = DataQueue(plan(examples, task_size, total))
    # Counted again after every step of the drain: the count follows the frontier mid-epoch.
    while not queue.finished:
        expected = queue.status()["tasks_queued"]
        assert expected == len(drain(copy.deepcopy(queue)))
        (task,) = queue.lease("a", 1, 1)
        queue.finish("a", 1, task, task.size)
    assert queue.status()["tasks_queued"] == 0


def test_tasks_queued_counts_given_back_remainders():
    queue = DataQueue(plan(examples=10, task_size=4, total=20))
    a = queue.lease("a", 1, 2)
    queue.finish("a", 1, a[0], 1)  # [1, 4) goes back
    st0 = queue.status()
    assert (st0["tasks_queued"], st0["tasks_leased"]) == (1 + 4, 1)  # the remainder, then 4 uncut
    assert st0["tasks_queued"] == len(drain(copy.deepcopy(queue)))  # a's leased one is not free


# -- finishing and giving back ---------------------------------------------------------------


def test_a_whole_finish_counts_the_task_done():
    queue = DataQueue(plan(examples=10, task_size=4))
    (task,) = queue.lease("a", 1, 1)
    queue.finish("a", 1, task, 4)
    st0 = queue.status()
    assert (st0["tasks_done"], st0["examples_done"], st0["tasks_requeued"], st0["tasks_leased"]) == (1, 4, 0, 0)
    assert queue.held_by("a", 1) == []


def test_a_partial_finish_requeues_the_remainder_at_the_front():
    queue = DataQueue(plan(examples=20, task_size=4))
    t0, t1 = queue.lease("a", 1, 2)
    queue.release("b")  # b holds nothing: a no-op
    queue.finish("a", 1, t1, 1)  # [5, 8) goes back, before anything else
    queue.finish("a", 1, t0, 0)  # nothing trained: [0, 4) goes back, in front of that
    st0 = queue.status()
    assert (st0["tasks_done"], st0["examples_done"], st0["tasks_requeued"]) == (0, 1, 2)
    assert queue.lease("b", 1, 3) == [DataTask(0, 0, 4), DataTask(0, 5, 8), DataTask(0, 8, 12)]


def test_release_gives_every_task_back_in_order_and_before_new_ones():
    queue = DataQueue(plan(examples=20, task_size=4))
    held = queue.lease("a", 1, 3)
    other = queue.lease("b", 1, 1)
    assert queue.release("a") == held
    st0 = queue.status()
    assert (st0["tasks_leased"], st0["tasks_requeued"]) == (1, 3)
    assert queue.held_by("a", 1) == [] and queue.held_by("b", 1) == other
    assert queue.lease("c", 1, 4) == [*held, DataTask(0, 16, 20)]
    with pytest.raises(PreconditionError, match="not leased to a"):
        queue.finish("a", 1, held[0], 4)  # given back: no longer a's to report


def test_release_below_a_generation_keeps_the_new_registrations_tasks():
    queue = DataQueue(plan(examples=20, task_size=4))
    old = queue.lease("a", 1, 2)
    new = queue.lease("a", 2, 1)
    assert queue.release("a", below=2) == old
    assert queue.held_by("a", 2) == new and queue.held_by("a", 1) == []
    assert queue.status()["holders"] == [("a", 2, new[0])]


def test_a_worker_holds_at_most_max_held_tasks():
    queue = DataQueue(plan(examples=100, task_size=1))
    assert len(queue.lease("a", 1, MAX_HELD)) == MAX_HELD
    assert queue.lease("a", 1, 1) == []  # full: not refused, just nothing
    assert queue.lease("a", 2, MAX_HELD) == []  # per worker, across its generations
    assert len(queue.lease("b", 1, MAX_HELD)) == MAX_HELD
    first = queue.held_by("a", 1)[0]
    queue.finish("a", 1, first, 1)
    assert queue.lease("a", 1, MAX_HELD) == [DataTask(0, 2 * MAX_HELD, 2 * MAX_HELD + 1)]


@pytest.mark.parametrize("want", [-1, MAX_HELD + 1, 1 << 40])
def test_asking_for_an_impossible_number_of_tasks_is_refused(want):
    queue = DataQueue(plan())
    queue.lease("a", 1, 1)
    before = state(queue)
    with pytest.raises(InvalidArgumentError, match=f"0..{MAX_HELD}"):
        queue.lease("a", 1, want)
    assert state(queue) == before


# -- refused finishes change nothing ---------------------------------------------------------


def _held_queue() -> tuple[DataQueue, DataTask]:
    queue = DataQueue(plan(examples=20, task_size=4))
    task, _ = queue.lease("a", 3, 2)
    queue.lease("b", 1, 1)
    return queue, task


@pytest.mark.parametrize("holder,generation,task,trained,error,needle", [
    ("b", 1, DataTask(0, 0, 4), 4, PreconditionError, "not leased to b"),  # another worker's
    ("a", 2, DataTask(0, 0, 4), 4, PreconditionError, "generation 2"),  # an older registration's
    ("a", 4, DataTask(0, 0, 4), 4, PreconditionError, "generation 4"),
    ("a", 3, DataTask(0, 12, 16), 4, PreconditionError, "never this worker's"),  # not cut yet
    ("a", 3, DataTask(0, 0, 3), 3, PreconditionError, "not leased"),  # the right start, the wrong end
    ("a", 3, DataTask(5, 0, 4), 4, PreconditionError, "not leased"),
    ("a", 3, DataTask(0, 0, 4), 5, InvalidArgumentError, "4 examples; 5 cannot"),
    ("a", 3, DataTask(0, 0, 4), -1, InvalidArgumentError, "-1 cannot"),
])
def test_a_refused_finish_raises_and_changes_nothing(holder, generation, task, trained, error, needle):
    queue, _ = _held_queue()
    before = state(queue)
    with pytest.raises(error, match=needle):
        queue.check_finish(holder, generation, task, trained)
    with pytest.raises(error, match=needle):
        queue.finish(holder, generation, task, trained)
    assert state(queue) == before
    queue.finish("a", 3, DataTask(0, 0, 4), 4)  # and the real holder still can


def test_a_task_cannot_be_finished_twice():
    queue, task = _held_queue()
    queue.finish("a", 3, task, 2)
    before = state(queue)
    with pytest.raises(PreconditionError):
        queue.finish("a", 3, task, 2)
    assert state(queue) == before


# -- the finished flag and the status --------------------------------------------------------


def test_finished_only_when_every_example_is_trained():
    queue = DataQueue(plan(examples=4, task_size=2, total=6))
    tasks = queue.lease("a", 1, 3)
    assert [t.size for t in tasks] == [2, 2, 2]
    assert not queue.finished  # everything cut, but leased
    queue.finish("a", 1, tasks[0], 2)
    queue.finish("a", 1, tasks[1], 2)
    queue.finish("a", 1, tasks[2], 1)  # one example goes back
    assert not queue.finished
    st0 = queue.status()
    assert (st0["examples_done"], st0["tasks_queued"], st0["epoch"]) == (5, 1, 1)
    (rest,) = queue.lease("b", 1, 2)
    assert rest == DataTask(1, 1, 2)
    queue.release("b")
    assert not queue.finished
    drain(queue)
    assert queue.finished and queue.status()["finished"]


def test_status_reports_the_oldest_epoch_still_open_and_who_holds_what():
    queue = DataQueue(plan(examples=4, task_size=2, total=12))
    a = queue.lease("a", 1, 1)
    b = queue.lease("b", 2, 3)  # cuts into epoch 1
    st0 = queue.status()
    assert st0["epoch"] == 0 and st0["active"] and st0["plan"] == queue.plan
    assert st0["holders"] == [("a", 1, a[0]), *(("b", 2, t) for t in b)]
    queue.finish("a", 1, a[0], 2)
    queue.finish("b", 2, b[0], 2)
    assert queue.status()["epoch"] == 1  # epoch 0 is all trained
    queue.finish("b", 2, b[1], 0)  # an epoch 1 task back in the queue keeps epoch 1 open
    assert queue.status()["epoch"] == 1
    queue.release("b")
    drain(queue)
    assert queue.status()["epoch"] == 2  # the last epoch, once finished


# -- checkpoints -----------------------------------------------------------------------------


def test_encode_decode_round_trip_queues_the_leased_tasks():
    queue = DataQueue(plan(examples=10, task_size=4, total=25, seed=3))
    held = queue.lease("a", 1, 3)
    queue.finish("a", 1, held[0], 4)
    queue.finish("a", 1, held[1], 1)  # [5, 8) queued
    other = queue.lease("b", 1, 2)  # [5, 8) again, then epoch 1's first
    doc = json.loads(json.dumps(queue.encode()))  # as a checkpoint's metadata holds it
    restored = DataQueue.decode(doc)
    assert restored.plan == queue.plan
    before, after = queue.status(), restored.status()
    for key in ("epoch", "tasks_done", "examples_done", "tasks_requeued", "examples_total", "finished"):
        assert after[key] == before[key], key
    assert after["tasks_leased"] == 0 and after["holders"] == []
    assert after["tasks_queued"] == before["tasks_queued"] + before["tasks_leased"]
    # Nobody's old lease is good any more; the tasks that were leased come first, then the rest.
    for holder, task in (("a", held[2]), ("b", other[0]), ("b", other[1])):
        with pytest.raises(PreconditionError):
            restored.finish(holder, 1, task, task.size)
    leased_then = [held[2], *other]
    assert restored.lease("c", 1, 3) == leased_then
    for task in leased_then:
        restored.finish("c", 1, task, task.size)
    assert sum(t.size for t in drain(restored)) + 4 + 1 + sum(t.size for t in leased_then) == 25
    assert restored.finished and restored.status()["examples_done"] == 25
    # encode of a decoded queue is stable
    assert DataQueue.decode(DataQueue.decode(doc).encode()).encode() == DataQueue.decode(doc).encode()


def _doc(**changes) -> dict:
    queue = DataQueue(plan(examples=10, task_size=4, total=20))
    queue.lease("a", 1, 3)
    doc = queue.encode()
    for key, value in changes.items():
        doc[key] = value
    return doc


@pytest.mark.parametrize("doc,needle", [
    (None, "malformed|bad plan"),
    ([], "malformed|bad plan"),
    ({}, "bad plan"),
    (_doc(plan={"examples": 10, "task_size": 4, "seed": 1}), "bad plan"),
    (_doc(plan={"examples": 0, "task_size": 4, "seed": 1, "total": 20}), "examples"),
    (_doc(plan={"examples": 10, "task_size": 4, "seed": -1, "total": 20}), "seed"),
    (_doc(plan={"examples": 10, "task_size": "4", "seed": 1, "total": 20}), "task_size"),
    (_doc(plan={"examples": 10, "task_size": 4, "seed": 1, "total": MAX_COUNT + 1}), "total"),
    (_doc(plan={"examples": True, "task_size": 4, "seed": 1, "total": 20}), "examples"),
    (_doc(frontier=-1), "frontier"),
    (_doc(frontier=1.5), "frontier"),
    ({k: v for k, v in _doc().items() if k != "frontier"}, "malformed"),
    ({k: v for k, v in _doc().items() if k != "queued"}, "malformed"),
    (_doc(leased=None), "malformed"),
    (_doc(queued=[[0, 0]]), "malformed"),
    (_doc(queued=[[0, 0, 4, 1]]), "malformed"),
    (_doc(queued=[7]), "malformed"),
    (_doc(queued=[[0, -1, 4]]), "task bound"),
    (_doc(queued=[[0, "0", 4]]), "task bound"),
    (_doc(tasks_done=-3), "tasks_done"),
    (_doc(examples_done=2.0), "examples_done"),
    # Out of range: empty, reversed, past the epoch's end, or beyond what was cut.
    (_doc(leased=[], queued=[[0, 4, 4]]), "outside"),
    (_doc(leased=[], queued=[[0, 4, 2]]), "outside"),
    (_doc(leased=[], queued=[[0, 8, 11]]), "outside"),
    (_doc(leased=[], queued=[[1, 0, 4]]), "outside"),
    (_doc(leased=[], queued=[[0, 8, 10]], frontier=9), "outside"),
    # Overlapping: the same task twice, or two ranges sharing positions.
    (_doc(queued=[[0, 0, 4]]), "overlaps"),
    (_doc(queued=[[0, 2, 6]]), "overlaps"),
    (_doc(leased=[[0, 0, 8]], queued=[[0, 4, 6]]), "overlaps"),
])
def test_decode_refuses_a_malformed_document_naming_the_problem(doc, needle):
    with pytest.raises(ValueError, match=needle):
        DataQueue.decode(doc)


def test_decode_accepts_tasks_at_the_edges_of_what_was_cut():
    doc = _doc(leased=[[0, 8, 10]], queued=[[0, 0, 1], [0, 7, 8]])  # end of epoch 0, adjacent ranges
    queue = DataQueue.decode(doc)
    assert queue.lease("a", 1, 4) == [DataTask(0, 8, 10), DataTask(0, 0, 1), DataTask(0, 7, 8), DataTask(1, 0, 4)]


# -- property: no example lost or trained twice ----------------------------------------------

HOLDERS = ("a", "b", "c")

plans = st.builds(
    lambda examples, task_size, extra: DataPlan(examples=examples, task_size=task_size, seed=0,
                                                total=max(1, examples + extra)),
    st.integers(1, 12), st.integers(1, 6), st.integers(-11, 30),
)
ops = st.lists(st.tuples(st.sampled_from(["lease", "finish", "release", "reregister", "checkpoint"]),
                         st.sampled_from(HOLDERS), st.integers(0, 1 << 16)), max_size=60)


def _check_counts(queue: DataQueue) -> None:
    s = queue.status()
    outstanding = sum(t.size for t in queue._queued) + sum(lease.task.size for lease in queue._leased.values())
    assert s["examples_done"] + outstanding + (s["examples_total"] - queue._frontier) == s["examples_total"]
    assert s["tasks_leased"] == len(s["holders"])
    for holder in HOLDERS:
        assert sum(1 for h, _, _ in s["holders"] if h == holder) <= MAX_HELD


@settings(max_examples=150, deadline=None)
@given(plan_=plans, steps=ops)
def test_no_example_is_lost_or_trained_twice(plan_, steps):
    queue = DataQueue(plan_)
    generation = dict.fromkeys(HOLDERS, 1)
    trained: list[tuple[int, int, int]] = []  # (epoch, start, end) reported trained

    for op, holder, n in steps:
        gen = generation[holder]
        if op == "lease":
            got = queue.lease(holder, gen, n % (MAX_HELD + 1))
            assert all(t.size > 0 for t in got)
        elif op == "finish":
            held = queue.held_by(holder, gen)
            if held:
                task = held[n % len(held)]
                done = n % (task.size + 1)
                queue.finish(holder, gen, task, done)
                trained.append((task.epoch, task.start, task.start + done))
        elif op == "release":
            queue.release(holder)
        elif op == "reregister":
            generation[holder] += 1
            queue.release(holder, below=generation[holder])
        else:  # a checkpoint, then a restore: every lease is void
            queue = DataQueue.decode(json.loads(json.dumps(queue.encode())))
            generation = {h: g + 1 for h, g in generation.items()}
        _check_counts(queue)

    expected_queued = queue.status()["tasks_queued"] + queue.status()["tasks_leased"]
    for holder in HOLDERS:
        queue.release(holder)
    rest = drain(queue)
    assert len(rest) == expected_queued
    trained += [(t.epoch, t.start, t.end) for t in rest]
    assert queue.finished

    covered = Counter((epoch, pos) for epoch, start, end in trained for pos in range(start, end))
    everything = Counter(divmod(i, plan_.examples) for i in range(plan_.total))
    assert covered == everything
    s = queue.status()
    assert s["examples_done"] == plan_.total and s["tasks_queued"] == s["tasks_leased"] == 0
