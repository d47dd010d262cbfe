"""A data exchange riding on a step (``PushPullRequest.data``): a dynamic-data worker's request to
the job's data queue travels in its push-and-pull to shard 0 and the reply brings the leased
tasks, so asking for data costs no call of its own. Checked on both transports (a call whole on a
bulk lane, and gRPC): the queue answers as a ``Data`` call would; its refusal fails only the
exchange, never the push; an exchange naming another registration is refused before the push;
one offered by an older registration, or withdrawn, rides on nothing and changes nothing. And
``psworker.elastic.DataFeed`` on top: its prefetching exchanges ride on steps, are made as calls
of their own when no step comes, and never keep the training side waiting for a step."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from psserver.config import ServerConfig
from psserver.server import create_server
from pswire import errors
from pswire.data import DataPlan
from pswire.dtypes import FLOAT32
from pswire.optim import OptimizerConfig
from pswire.placement import VariableSpec
from pswire.v1 import ps_pb2
from pswire.wire import data_plan_to_proto
from psworker import elastic
from psworker.client import ClientOptions, DataRider, PSClient
from psworker.elastic import DataFeed

pytestmark = pytest.mark.timeout(120)

WAIT = 20.0
PLAN = data_plan_to_proto(DataPlan(examples=10, task_size=4, seed=1, total=20))
"""Two epochs of 10 examples in tasks [0, 4), [4, 8), [8, 10): six tasks."""
TRANSPORTS = pytest.mark.parametrize("lane_calls", [True, False], ids=["lane-calls", "grpc"])


@contextlib.contextmanager
def _client(lane_calls: bool, name: str = "w0"):
    shard = create_server(ServerConfig(port=0, shard_index=0, num_shards=1))
    client = PSClient([shard.address], ClientOptions(timeout=WAIT, connect_timeout=WAIT, lane_calls=lane_calls))
    try:
        client.wait_connected()
        client.register([VariableSpec("w", (4,), FLOAT32)], OptimizerConfig(name="sgd", lr=0.5), worker_name=name,
                        initial_values={"w": torch.zeros(4)})
        yield client
    finally:
        client.close()
        shard.stop(grace=0)


def _step(client: PSClient) -> None:
    client.push_pull({"w": torch.ones(4)}, {"w": torch.zeros(4)})


def _spans(tasks) -> list[tuple[int, int, int]]:
    return [(t.epoch, t.start, t.end) for t in tasks]


def _queue(client: PSClient) -> ps_pb2.DataQueueStatus:
    (status,) = client.status()
    return status.data


@TRANSPORTS
def test_an_exchange_rides_on_the_next_step_and_the_queue_answers_it(lane_calls):
    with _client(lane_calls) as client:
        rider = client.offer_data(PLAN, want=2)
        assert not rider.done.is_set()
        _step(client)
        assert rider.done.is_set() and rider.refused is None
        assert _spans(rider.reply.tasks) == [(0, 0, 4), (0, 4, 8)]
        assert rider.reply.plan == PLAN and rider.registration == client.registration()
        queue = _queue(client)
        assert (queue.tasks_leased, queue.tasks_queued) == (2, 4)
        (status,) = client.status()
        assert status.pushes_applied == 1
        # The next step's exchange reports a task and leases another: one call each step, no more.
        done = ps_pb2.DataTask(epoch=0, start=0, end=4, trained=4)
        rider = client.offer_data(PLAN, [done], want=1)
        _step(client)
        assert _spans(rider.reply.tasks) == [(0, 4, 8), (0, 8, 10)]
        assert rider.reply.queue.tasks_done == 1 and rider.reply.queue.examples_done == 4
        # A step with no exchange offered carries none.
        _step(client)
        assert _queue(client) == rider.reply.queue


@TRANSPORTS
def test_a_refused_exchange_fails_only_itself_and_the_push_is_applied(lane_calls):
    with _client(lane_calls) as client:
        client.data(PLAN, want=1)  # holds epoch 0 [0, 4)
        before = _queue(client)
        # A report of a task this worker does not hold: what a retried call whose first copy was applied sends.
        rider = client.offer_data(PLAN, [ps_pb2.DataTask(epoch=0, start=4, end=8, trained=4)], want=1)
        _step(client)
        assert rider.reply is None and isinstance(rider.refused, errors.PreconditionError)
        assert "not leased to w0" in str(rider.refused) and "FAILED_PRECONDITION" in str(rider.refused)
        assert _queue(client) == before  # nothing reported, nothing leased
        (status,) = client.status()
        assert (status.version, status.pushes_applied) == (1, 1)
        # A different plan: refused too, with the difference named, and the shard serves on.
        rider = client.offer_data(data_plan_to_proto(DataPlan(examples=11, task_size=4, seed=1, total=20)))
        _step(client)
        assert isinstance(rider.refused, errors.PreconditionError) and "examples" in str(rider.refused)
        assert client.status()[0].pushes_applied == 2
        assert _spans(client.data(PLAN, want=0)[1].tasks) == [(0, 0, 4)]


@TRANSPORTS
def test_an_exchange_naming_another_registration_is_refused_before_the_push(lane_calls):
    with _client(lane_calls) as client:
        (session,) = client._require_sessions()
        message = client._push_message(session, {"w": torch.ones(4)}, None)
        request, dest, nbytes = client._pull_request(session, {"w": torch.zeros(4)}, skip_unchanged=False,
                                                     may_wait=False, clock=session.clock + 1)
        for who in ({"generation": session.generation + 1}, {"session": b"x" * 16}, {"worker_id": 999}):
            named = {"worker_id": session.worker_id, "generation": session.generation, "session": session.secret}
            rider = DataRider(ps_pb2.DataRequest(plan=PLAN, want=1, **{**named, **who}), client.registration())
            with pytest.raises((errors.InvalidArgumentError, errors.PermissionDeniedError),
                               match="same registration|session"):
                session.client.push_pull(*message, request, dest, nbytes, data=rider)
            (status,) = client.status()
            assert (status.version, status.pushes_applied) == (0, 0)  # the push was not applied
            assert not status.data.active  # and no plan was set
        assert client.status()[0].pushes_applied == 0
        _step(client)  # the shard serves on
        assert client.status()[0].pushes_applied == 1


def test_a_withdrawn_exchange_rides_on_nothing():
    with _client(lane_calls=True) as client:
        rider = client.offer_data(PLAN, want=2)
        client.withdraw_data(rider)
        assert rider.done.is_set() and rider.reply is None and rider.refused is None
        _step(client)
        assert not _queue(client).active  # nothing reached the queue
        # A newer offer replaces one not yet taken, which ends unanswered.
        first, second = client.offer_data(PLAN, want=1), client.offer_data(PLAN, want=2)
        assert first.done.is_set() and first.reply is None
        _step(client)
        assert _spans(second.reply.tasks) == [(0, 0, 4), (0, 4, 8)]


def test_an_exchange_offered_before_the_worker_registered_again_rides_on_nothing():
    with _client(lane_calls=True) as client:
        client.data(PLAN, want=1)
        rider = client.offer_data(PLAN, want=2)
        client.register([VariableSpec("w", (4,), FLOAT32)], OptimizerConfig(name="sgd", lr=0.5), worker_name="w0")
        _step(client)
        assert rider.done.is_set() and rider.reply is None and rider.refused is None
        # The old registration's task went back when it registered again; the new one leases afresh.
        queue = _queue(client)
        assert (queue.tasks_leased, queue.tasks_requeued) == (0, 1)


@dataclass
class _Session:
    """What a ``DataFeed`` uses of ``psworker.api.Session``: an async worker that stays registered."""

    client: PSClient
    worker_name: str = "w0"
    left: bool = False


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        threading.Event().wait(0.01)


@contextlib.contextmanager
def _exchange_due():
    """A feed whose tasks in hand were all handed out (each finished but the first): the background
    thread's exchange is due."""
    with _client(lane_calls=True) as client:
        feed = DataFeed(_Session(client), DataPlan(examples=10, task_size=2, seed=1, total=20), prefetch=2)
        try:
            feed.next_task()
            while feed._ready:
                feed.finish(feed.next_task())
            yield client, feed
        finally:
            feed.close()


def test_the_feeds_prefetching_exchange_rides_on_the_next_step():
    with _client(lane_calls=True) as client:
        feed = DataFeed(_Session(client), DataPlan(examples=10, task_size=2, seed=1, total=20), prefetch=2)
        try:
            first = feed.next_task()  # no task in hand: the training side's own exchange (a stall)
            assert first is not None and feed.stalls == 1
            feed.finish(first)
            finished = 1
            while feed._ready:  # hand out the prefetched ones: the last one makes an exchange due
                lease = feed.next_task()
                if feed._ready:
                    feed.finish(lease)
                    finished += 1
            _wait(lambda: feed._riding is not None)  # offered, waiting for a step
            assert _queue(client).tasks_done == 0
            _step(client)
            _wait(lambda: feed.rides == 1 and len(feed._ready) >= 2)  # as many as it leases ahead
            assert feed.stalls == 1 and _queue(client).tasks_done == finished  # the reports rode along
        finally:
            feed.close()


def test_without_a_step_the_feeds_exchange_is_a_call_of_its_own(monkeypatch):
    monkeypatch.setattr(elastic, "RIDE_SECONDS", 0.05)
    with _exchange_due() as (_, feed):
        _wait(lambda: len(feed._ready) >= 2)  # no step came: it did not wait for one
        assert feed.rides == 0 and feed._riding is None


def test_the_training_side_needing_a_task_never_waits_for_a_step(monkeypatch):
    monkeypatch.setattr(elastic, "RIDE_SECONDS", 60.0)  # a step would be a long time coming
    with _exchange_due() as (client, feed):
        _wait(lambda: feed._riding is not None)
        started = time.monotonic()
        lease = feed.next_task()  # withdraws the ride; the exchange is made at once
        assert lease is not None and time.monotonic() - started < 10.0
        assert feed.rides == 0 and feed.stalls == 2
        _step(client)  # carries nothing now
        assert feed.rides == 0
