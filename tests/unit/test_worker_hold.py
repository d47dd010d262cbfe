"""The hold at step 1 (``--min-workers``, and sync/SSP workers of a static split): which workers
count as joined, so that a worker still holding starts once the others have come, even if they
have already trained and gone."""

from __future__ import annotations

import time

import pytest

from pswire import errors
from pswire.v1 import ps_pb2
from psworker.training import _wait_for_workers

pytestmark = pytest.mark.timeout(60)


def _worker(name: str, *, live: bool = True, pushes: int = 0) -> ps_pb2.WorkerInfo:
    return ps_pb2.WorkerInfo(worker_name=name, live=live, pushes=pushes)


class _Session:
    """Answers ``status()`` with each shard's worker list, the last polls repeating the last."""

    def __init__(self, *polls: list[list[ps_pb2.WorkerInfo]]) -> None:
        self.polls = list(polls)
        self.calls = 0

    def status(self) -> list[ps_pb2.StatusResponse]:
        shards = self.polls[min(self.calls, len(self.polls) - 1)]
        self.calls += 1
        return [ps_pb2.StatusResponse(workers=workers) for workers in shards]


def test_a_worker_that_trained_and_left_between_two_polls_counts_as_joined():
    # The race CI met: "second" joined, trained the whole job and left between two polls of
    # "first", which then saw one live worker and would have held forever.
    session = _Session([[_worker("first")]], [[_worker("first"), _worker("second", live=False, pushes=40)]])
    _wait_for_workers(session, 2, timeout=30, name="first", mode="async")
    assert session.calls == 2


def test_a_worker_evicted_after_training_counts_as_joined():
    session = _Session([[_worker("first"), _worker("second", live=False, pushes=3)]])
    _wait_for_workers(session, 2, timeout=30, name="first", mode="sync")


def test_a_worker_that_gave_up_before_pushing_does_not_count():
    session = _Session([[_worker("early", live=False), _worker("first")]])
    started = time.monotonic()
    with pytest.raises(errors.DeadlineError, match="only 1 of 2 workers joined the async job within 0s"):
        _wait_for_workers(session, 2, timeout=0.3, name="first", mode="async")
    assert time.monotonic() - started >= 0.3 and session.calls > 1  # it kept polling until the deadline


def test_live_workers_count_only_where_every_shard_has_them():
    # "second" has registered with shard 0 only: not yet a member of the job.
    session = _Session([[_worker("first"), _worker("second")], [_worker("first")]])
    with pytest.raises(errors.DeadlineError, match="only 1 of 2"):
        _wait_for_workers(session, 2, timeout=0.2, name="first", mode="ssp")


def test_a_packed_models_worker_gone_after_pushing_to_shard_0_only_counts():
    # A model packed on shard 0 sends shard 1 nothing: its pushes show on shard 0 alone.
    session = _Session([[_worker("first"), _worker("second", live=False, pushes=7)],
                        [_worker("first"), _worker("second", live=False)]])
    _wait_for_workers(session, 2, timeout=30, name="first", mode="async")


def test_enough_live_workers_end_the_hold_at_the_first_poll():
    session = _Session([[_worker("a"), _worker("b"), _worker("c")]] * 2)
    _wait_for_workers(session, 3, timeout=30, name="a", mode="sync")
    assert session.calls == 1
