"""Service tier: the job's data queue (dynamic data) on a real shard in-process on port 0,
driven through raw gRPC ``Data`` calls, as a worker and as a hostile client would make them.

Every refusal is checked for its status code, a message that names the problem, the queue
afterwards (``Status``'s ``data``, unchanged) and that the shard keeps serving. Evictions run on
an injected clock (``ShardStore(clock=...)``, the shard's own reaper off), never on sleeps.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

import grpc
import pytest

from psserver.dataqueue import MAX_HELD
from psserver.store import ShardStore
from pswire.data import DataPlan
from pswire.v1 import ps_pb2, ps_pb2_grpc
from pswire.wire import MAX_COUNT, data_plan_to_proto
from psworker import ctl
from tests.service.shard_harness import (
    RPC_TIMEOUT, Worker, expect_rpc_error, initialize, open_stub, register, started_shards, status,  # noqa: F401
)

pytestmark = pytest.mark.timeout(120)

PLAN = DataPlan(examples=10, task_size=4, seed=1, total=20)
"""Two epochs of 10 examples in tasks [0, 4), [4, 8), [8, 10): six tasks."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def data(stub, worker: Worker, *, plan: DataPlan | None = PLAN, finished=(), want: int = 0,
         session: bytes | None = None) -> ps_pb2.DataResponse:
    """One ``Data`` call; ``finished`` holds ``(DataTask message, trained)`` pairs."""
    request = ps_pb2.DataRequest(
        worker_id=worker.worker_id, generation=worker.generation,
        session=worker.session if session is None else session, want=want,
        finished=[ps_pb2.DataTask(epoch=t.epoch, start=t.start, end=t.end, trained=n) for t, n in finished],
    )
    if plan is not None:
        request.plan.CopyFrom(data_plan_to_proto(plan))
    return stub.Data(request, timeout=RPC_TIMEOUT)


def spans(tasks) -> list[tuple[int, int, int]]:
    return [(t.epoch, t.start, t.end) for t in tasks]


def queue_of(stub) -> ps_pb2.DataQueueStatus | None:
    st = status(stub)
    return st.data if st.HasField("data") else None


@dataclass
class Job:
    stub: ps_pb2_grpc.ParameterServerStub
    w0: Worker
    w1: Worker
    store: ShardStore | None = None
    clock: FakeClock | None = None
    shard: object = None


@pytest.fixture
def make_shard():
    with started_shards() as make:
        yield make


def start_job(make_shard, open_stub, **config) -> Job:
    """A ready one-shard job with two registered workers and no data plan yet."""
    shard = make_shard(**config)
    stub = open_stub(shard.address)
    w0, _ = register(stub, "worker-0")
    w1, _ = register(stub, "worker-1")
    assert initialize(stub, w0).applied
    return Job(stub, w0, w1, shard=shard)


@pytest.fixture
def job(make_shard, open_stub) -> Job:
    return start_job(make_shard, open_stub)


@pytest.fixture
def leased(job) -> Job:
    """``job`` with the plan set: worker-0 holds [0, 4) and [4, 8), worker-1 holds [8, 10)."""
    assert spans(data(job.stub, job.w0, want=2).tasks) == [(0, 0, 4), (0, 4, 8)]
    assert spans(data(job.stub, job.w1, want=1).tasks) == [(0, 8, 10)]
    return job


def assert_unchanged_and_serving(job: Job, before: ps_pb2.DataQueueStatus | None) -> None:
    """The refused call changed nothing, and both workers' calls are still served."""
    assert queue_of(job.stub) == before
    held = data(job.stub, job.w0, want=0)
    assert held.plan == data_plan_to_proto(PLAN)
    assert held.queue == queue_of(job.stub)


# -- the plan --------------------------------------------------------------------------------


def test_the_first_request_sets_the_plan_and_every_reply_describes_the_queue(job):
    assert queue_of(job.stub) is None  # no dynamic data yet
    expect_rpc_error(lambda: data(job.stub, job.w0, plan=None, want=1), grpc.StatusCode.FAILED_PRECONDITION,
                     "no data plan yet")
    assert queue_of(job.stub) is None

    reply = data(job.stub, job.w0, want=2)
    assert spans(reply.tasks) == [(0, 0, 4), (0, 4, 8)]
    assert reply.plan == data_plan_to_proto(PLAN)
    q = reply.queue
    assert (q.active, q.epoch, q.tasks_done, q.tasks_leased, q.tasks_queued) == (True, 0, 0, 2, 4)
    assert (q.examples_done, q.examples_total, q.finished, q.tasks_requeued) == (0, 20, False, 0)
    assert [(h.worker_name, h.generation, spans([h.task])[0]) for h in q.holders] == [
        ("worker-0", 1, (0, 0, 4)), ("worker-0", 1, (0, 4, 8))]
    assert q.plan == data_plan_to_proto(PLAN)
    assert queue_of(job.stub) == q  # Status carries the same

    # Later requests give the same plan, or none at all.
    assert spans(data(job.stub, job.w1, plan=None, want=1).tasks) == [(0, 8, 10)]
    assert spans(data(job.stub, job.w1, want=1).tasks) == [(0, 8, 10), (1, 0, 4)]
    # Finishing: a task trained whole is done; the rest of one trained in part goes back first.
    reply = data(job.stub, job.w0, finished=[(reply.tasks[0], 4), (reply.tasks[1], 1)], want=1)
    assert spans(reply.tasks) == [(0, 5, 8)]
    q = reply.queue
    assert (q.tasks_done, q.examples_done, q.tasks_requeued, q.tasks_leased, q.tasks_queued) == (1, 5, 1, 3, 2)


@pytest.mark.parametrize("field,value,needle", [
    ("seed", 2, "seed 2"),
    ("task_size", 5, "tasks of 5"),
    ("examples", 11, "of 11"),
    ("total", 30, "30 examples"),
])
def test_a_different_plan_is_refused_naming_the_difference(leased, field, value, needle):
    other = DataPlan(**{**PLAN.to_dict(), field: value})
    before = queue_of(leased.stub)
    err = expect_rpc_error(lambda: data(leased.stub, leased.w1, plan=other, want=1),
                           grpc.StatusCode.FAILED_PRECONDITION, "the job's data plan is", needle, "worker-1")
    assert PLAN.describe() in err.details() and other.describe() in err.details()
    assert_unchanged_and_serving(leased, before)


def test_the_queue_lives_on_shard_0_only(make_shard, open_stub):
    stub = open_stub(make_shard().address)
    worker, _ = register(stub, "worker-0", shard_index=1, num_shards=2)
    expect_rpc_error(lambda: data(stub, worker, want=1), grpc.StatusCode.UNAVAILABLE, "not initialised")
    assert initialize(stub, worker).applied
    expect_rpc_error(lambda: data(stub, worker, want=1), grpc.StatusCode.FAILED_PRECONDITION,
                     "lives on shard 0", "this is shard 1")
    assert queue_of(stub) is None


def test_before_initialisation_the_queue_is_not_served(make_shard, open_stub):
    stub = open_stub(make_shard().address)
    worker, _ = register(stub, "worker-0")
    expect_rpc_error(lambda: data(stub, worker, want=1), grpc.StatusCode.UNAVAILABLE, "not initialised")
    assert initialize(stub, worker).applied
    assert len(data(stub, worker, want=1).tasks) == 1


# -- refusals that change nothing ------------------------------------------------------------


def _plan_proto(**fields) -> ps_pb2.DataPlan:
    return ps_pb2.DataPlan(**{**PLAN.to_dict(), **fields})


BAD_REQUESTS = {
    "want above MAX_HELD": (dict(want=MAX_HELD + 1), f"0..{MAX_HELD}"),
    "negative want": (dict(want=-1), f"0..{MAX_HELD}"),
    "negative trained": (dict(finished=[(ps_pb2.DataTask(epoch=0, start=0, end=4), -1)]), "-1 cannot"),
    "trained above the size": (dict(finished=[(ps_pb2.DataTask(epoch=0, start=0, end=4), 5)]), "5 cannot"),
    "a task reported twice": (dict(finished=[(ps_pb2.DataTask(epoch=0, start=0, end=4), 4)] * 2), "twice"),
    "no examples": (dict(plan=_plan_proto(examples=0)), "examples is 0"),
    "no task size": (dict(plan=_plan_proto(task_size=0)), "task_size is 0"),
    "no total": (dict(plan=_plan_proto(total=0)), "total is 0"),
    "negative seed": (dict(plan=_plan_proto(seed=-1)), "seed is -1"),
    "negative examples": (dict(plan=_plan_proto(examples=-5)), "examples is -5"),
    "too many examples": (dict(plan=_plan_proto(examples=MAX_COUNT + 1)), f"examples is {MAX_COUNT + 1}"),
}


def raw_data(stub, worker: Worker, *, plan=None, finished=(), want: int = 0) -> ps_pb2.DataResponse:
    request = ps_pb2.DataRequest(
        worker_id=worker.worker_id, generation=worker.generation, session=worker.session, want=want,
        plan=plan if plan is not None else data_plan_to_proto(PLAN),
        finished=[ps_pb2.DataTask(epoch=t.epoch, start=t.start, end=t.end, trained=n) for t, n in finished],
    )
    return stub.Data(request, timeout=RPC_TIMEOUT)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_an_impossible_request_is_invalid_argument_and_changes_nothing(leased, case):
    fields, needle = BAD_REQUESTS[case]
    before = queue_of(leased.stub)
    expect_rpc_error(lambda: raw_data(leased.stub, leased.w0, **fields), grpc.StatusCode.INVALID_ARGUMENT, needle)
    assert_unchanged_and_serving(leased, before)


@pytest.mark.parametrize("case", [c for c in BAD_REQUESTS if "plan" in BAD_REQUESTS[c][0] or "want" in c])
def test_an_impossible_first_request_sets_no_plan(job, case):
    fields, needle = BAD_REQUESTS[case]
    expect_rpc_error(lambda: raw_data(job.stub, job.w0, **fields), grpc.StatusCode.INVALID_ARGUMENT, needle)
    assert queue_of(job.stub) is None
    assert len(data(job.stub, job.w0, want=1).tasks) == 1  # the right plan is still taken


def test_an_impossible_want_beside_valid_reports_changes_nothing(leased):
    held = data(leased.stub, leased.w0).tasks
    before = queue_of(leased.stub)
    expect_rpc_error(lambda: data(leased.stub, leased.w0, finished=[(held[0], 4)], want=MAX_HELD + 1),
                     grpc.StatusCode.INVALID_ARGUMENT, f"0..{MAX_HELD}")
    assert queue_of(leased.stub) == before


def test_finishing_another_workers_task_is_refused_and_changes_nothing(leased):
    theirs = data(leased.stub, leased.w0).tasks[0]
    mine = data(leased.stub, leased.w1).tasks[0]
    before = queue_of(leased.stub)
    expect_rpc_error(lambda: data(leased.stub, leased.w1, finished=[(theirs, 4)]),
                     grpc.StatusCode.FAILED_PRECONDITION, "epoch 0 [0, 4)", "not leased to worker-1")
    # A valid report beside it is not applied either: every report is checked before any is.
    expect_rpc_error(lambda: data(leased.stub, leased.w1, finished=[(mine, 2), (theirs, 4)], want=1),
                     grpc.StatusCode.FAILED_PRECONDITION, "not leased to worker-1")
    # Nor a task never leased, nor one whose end differs from the lease's.
    never = ps_pb2.DataTask(epoch=1, start=0, end=4)
    expect_rpc_error(lambda: data(leased.stub, leased.w1, finished=[(never, 4)]), grpc.StatusCode.FAILED_PRECONDITION)
    wrong_end = ps_pb2.DataTask(epoch=0, start=8, end=9)
    expect_rpc_error(lambda: data(leased.stub, leased.w1, finished=[(wrong_end, 1)]),
                     grpc.StatusCode.FAILED_PRECONDITION)
    assert_unchanged_and_serving(leased, before)
    assert spans(data(leased.stub, leased.w1, finished=[(mine, 2)]).tasks) == []  # its own: fine


def test_a_call_without_the_sessions_secret_is_unauthenticated_and_changes_nothing(leased):
    held = data(leased.stub, leased.w0).tasks
    before = queue_of(leased.stub)
    w0 = leased.w0
    for forged in (b"", secrets.token_bytes(32), w0.session[:-1] + bytes([w0.session[-1] ^ 1]), leased.w1.session):
        for request in (dict(want=1), dict(finished=[(held[0], 4)]), dict(want=0)):
            expect_rpc_error(lambda: data(leased.stub, w0, session=forged, **request),
                             grpc.StatusCode.UNAUTHENTICATED, "session secret")
    assert_unchanged_and_serving(leased, before)


def test_the_queue_needs_the_worker_role_on_a_shard_that_checks_tokens(make_shard, open_stub, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("reader reader-token-0123456789abcdef\nworker worker-token-0123456789abcdef\n")
    tokens.chmod(0o600)
    stub = open_stub(make_shard(auth_token_file=str(tokens)).address)
    request = ps_pb2.DataRequest(worker_id=1, generation=1, want=1, plan=data_plan_to_proto(PLAN))
    expect_rpc_error(lambda: stub.Data(request, timeout=RPC_TIMEOUT), grpc.StatusCode.UNAUTHENTICATED)
    reader = [("authorization", "Bearer reader-token-0123456789abcdef")]
    expect_rpc_error(lambda: stub.Data(request, timeout=RPC_TIMEOUT, metadata=reader),
                     grpc.StatusCode.PERMISSION_DENIED)
    worker = [("authorization", "Bearer worker-token-0123456789abcdef")]
    # Past the token check, the store answers: no job on this shard yet.
    expect_rpc_error(lambda: stub.Data(request, timeout=RPC_TIMEOUT, metadata=worker), grpc.StatusCode.UNAVAILABLE,
                     "not initialised")


def test_a_stale_generation_is_fenced(leased):
    before = queue_of(leased.stub)
    old = Worker(leased.w0.worker_id, leased.w0.generation - 1, leased.w0.session)
    expect_rpc_error(lambda: data(leased.stub, old, want=1), grpc.StatusCode.ABORTED, "re-register")
    unknown = Worker(999, 1, leased.w0.session)
    expect_rpc_error(lambda: data(leased.stub, unknown, want=1), grpc.StatusCode.ABORTED, "not registered")
    assert_unchanged_and_serving(leased, before)


# -- membership: eviction, re-registration, leaving ------------------------------------------


def test_an_evicted_workers_tasks_go_back_to_the_queue(make_shard, open_stub):
    clock = FakeClock()
    store = ShardStore(lease_timeout=5.0, clock=clock)
    job = start_job(make_shard, open_stub, store=store, lease_timeout=0)  # no reaper: evictions happen here
    w0_tasks = data(job.stub, job.w0, want=2).tasks
    data(job.stub, job.w1, want=1)
    clock.now += 3.0
    data(job.stub, job.w1)  # any call renews worker-1's lease
    clock.now += 3.0
    assert store.evict_expired() == ["worker-0"]

    q = queue_of(job.stub)
    assert (q.tasks_leased, q.tasks_requeued, q.tasks_queued) == (1, 2, 3 + 2)
    assert [h.worker_name for h in q.holders] == ["worker-1"]
    # The evicted registration can report nothing; its tasks are the next ones leased.
    expect_rpc_error(lambda: data(job.stub, job.w0, finished=[(w0_tasks[0], 4)]), grpc.StatusCode.ABORTED,
                     "evicted")
    expect_rpc_error(lambda: data(job.stub, job.w0), grpc.StatusCode.ABORTED, "evicted")
    assert spans(data(job.stub, job.w1, want=3).tasks) == [(0, 8, 10), (0, 0, 4), (0, 4, 8), (1, 0, 4)]
    # Registered again, worker-0 leases afresh.
    w0, reply = register(job.stub, "worker-0")
    assert reply.generation == 2
    assert spans(data(job.stub, w0, want=1).tasks) == [(1, 4, 8)]


def test_registering_again_gives_the_old_generations_tasks_back(leased):
    old = data(leased.stub, leased.w0).tasks
    w0, _ = register(leased.stub, "worker-0", session=leased.w0.session)
    assert w0.generation == leased.w0.generation + 1
    q = queue_of(leased.stub)
    assert (q.tasks_leased, q.tasks_requeued) == (1, 2)
    assert data(leased.stub, w0).tasks == []
    expect_rpc_error(lambda: data(leased.stub, leased.w0, finished=[(old[0], 4)]), grpc.StatusCode.ABORTED)
    assert spans(data(leased.stub, w0, want=2).tasks) == spans(old)


def test_a_worker_that_left_may_ask_but_not_lease_or_report(leased):
    held = data(leased.stub, leased.w0).tasks
    w0 = leased.w0
    leased.stub.Leave(ps_pb2.LeaveRequest(worker_id=w0.worker_id, generation=w0.generation, session=w0.session),
                      timeout=RPC_TIMEOUT)
    q = queue_of(leased.stub)
    assert (q.tasks_leased, q.tasks_requeued) == (1, 2)  # leaving gave its tasks back
    # It waits for a task to come free: asking is allowed, and tells it what is queued.
    reply = data(leased.stub, w0, want=0)
    assert reply.tasks == [] and reply.queue == q and reply.queue.tasks_queued == 3 + 2
    expect_rpc_error(lambda: data(leased.stub, w0, want=1), grpc.StatusCode.ABORTED, "left the job")
    expect_rpc_error(lambda: data(leased.stub, w0, finished=[(held[0], 4)]), grpc.StatusCode.ABORTED, "left")
    # Asking still needs its session.
    expect_rpc_error(lambda: data(leased.stub, w0, session=secrets.token_bytes(32)), grpc.StatusCode.ABORTED)
    assert queue_of(leased.stub) == q


# -- retries ---------------------------------------------------------------------------------


def test_a_lost_reply_is_harmless_the_next_reply_lists_every_task_held(leased):
    first = data(leased.stub, leased.w1, want=2)  # its reply is lost ...
    again = data(leased.stub, leased.w1, want=2)  # ... so the worker asks again
    assert spans(first.tasks) == [(0, 8, 10), (1, 0, 4), (1, 4, 8)]
    assert spans(again.tasks) == [(0, 8, 10), (1, 0, 4), (1, 4, 8), (1, 8, 10)]  # all it holds, none lost
    assert again.queue.tasks_leased == 2 + 4 and again.queue.tasks_queued == 0
    # A worker that learned its tasks from a later reply finishes them all; the job's data is done.
    data(leased.stub, leased.w0, finished=[(t, t.end - t.start) for t in data(leased.stub, leased.w0).tasks])
    done = data(leased.stub, leased.w1, finished=[(t, t.end - t.start) for t in again.tasks])
    assert done.tasks == [] and done.queue.finished and done.queue.examples_done == 20


def test_a_repeated_report_after_a_lost_reply_is_refused_and_changes_nothing(leased):
    # What psworker.elastic relies on: the copy of a report whose first copy was applied is
    # refused as a whole (FAILED_PRECONDITION, nothing applied, nothing leased), and the same
    # request without the reports then names every task the worker holds.
    held = data(leased.stub, leased.w0).tasks
    request = dict(finished=[(held[0], 4)], want=1)
    first = data(leased.stub, leased.w0, **request)  # applied; its reply is lost
    assert spans(first.tasks) == [(0, 4, 8), (1, 0, 4)]
    before = queue_of(leased.stub)
    expect_rpc_error(lambda: data(leased.stub, leased.w0, **request), grpc.StatusCode.FAILED_PRECONDITION,
                     "epoch 0 [0, 4) is not leased to worker-0")
    assert queue_of(leased.stub) == before
    again = data(leased.stub, leased.w0, want=1)
    assert spans(again.tasks) == [*spans(first.tasks), (1, 4, 8)]
    assert (again.queue.tasks_done, again.queue.examples_done) == (1, 4)  # the report counted once


# -- checkpoints -----------------------------------------------------------------------------


def test_a_checkpoint_keeps_the_queue_and_a_restore_queues_the_leased_tasks(make_shard, open_stub, tmp_path):
    job = start_job(make_shard, open_stub, checkpoint_dir=str(tmp_path))
    held = data(job.stub, job.w0, want=2).tasks
    data(job.stub, job.w0, finished=[(held[0], 4), (held[1], 1)])  # [5, 8) back in the queue
    data(job.stub, job.w1, want=2)  # [5, 8) and [8, 10)
    before = queue_of(job.stub)
    assert job.stub.Checkpoint(ps_pb2.CheckpointRequest(checkpoint_id=7), timeout=RPC_TIMEOUT).complete
    job.shard.stop(grace=0)

    restored = make_shard(checkpoint_dir=str(tmp_path), restore=True, shard_index=0, num_shards=1)
    stub = open_stub(restored.address)
    after = queue_of(stub)
    assert after.plan == before.plan == data_plan_to_proto(PLAN)
    for name in ("epoch", "tasks_done", "examples_done", "examples_total", "finished", "tasks_requeued"):
        assert getattr(after, name) == getattr(before, name), name
    assert (after.tasks_leased, list(after.holders)) == (0, [])
    assert after.tasks_queued == before.tasks_queued + before.tasks_leased
    # Every worker was fenced by the restore; registered again, the tasks that were leased come first.
    expect_rpc_error(lambda: data(stub, job.w1), grpc.StatusCode.ABORTED, "restored")
    w1, _ = register(stub, "worker-1")
    assert spans(data(stub, w1, want=3).tasks) == [(0, 5, 8), (0, 8, 10), (1, 0, 4)]


# -- psctl status ----------------------------------------------------------------------------


def test_psctl_status_shows_the_queue_only_for_a_job_with_dynamic_data(leased, capsys):
    address = leased.shard.address
    held = data(leased.stub, leased.w0).tasks
    data(leased.stub, leased.w0, finished=[(held[0], 4), (held[1], 1)])
    # Now worker-1 holds [8, 10), and the rest of [4, 8) is queued with 3 tasks not yet cut.
    assert ctl.main(["status", "--ps", address]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "dynamic data" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    for needle in (f"{address}: dynamic data", "epoch 0", "tasks 1 done, 1 leased, 4 queued (1 requeued)",
                   "examples 5/20 done", "finished no", PLAN.describe(), "worker-1 (gen 1): epoch 0 [8, 10)"):
        assert needle in line, (needle, line)
    assert "worker-0" not in line  # it holds nothing now

    assert ctl.main(["status", "--ps", address, "--json"]) == 0
    (shard,) = json.loads(capsys.readouterr().out)
    q = shard["data"]
    assert (q["tasks_done"], q["tasks_leased"], q["tasks_queued"], q["examples_done"]) == (1, 1, 4, 5)
    assert [(h["worker_name"], h["task"]["start"], h["task"]["end"]) for h in q["holders"]] == [("worker-1", 8, 10)]


def test_psctl_status_of_a_job_without_dynamic_data_has_no_data_line(job, capsys):
    assert ctl.main(["status", "--ps", job.shard.address]) == 0
    assert "dynamic data" not in capsys.readouterr().out
    assert ctl.main(["status", "--ps", job.shard.address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["data"] is None
