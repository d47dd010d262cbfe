"""Ending a job (``ShardStore.end_job``, ``psctl end-job``): the shard is empty and takes a new
job; every call of the ended job's workers, and their sessions registering again, are refused
for good with an error that says so (never "register again", which would start the old model
as a new job); a final checkpoint that fails leaves the job running unchanged."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from pswire.codec import Part
from pswire.consistency import Consistency
from pswire.dtypes import FLOAT32
from pswire.errors import FencedError, NotReadyError, PreconditionError
from psserver.store import ShardState, ShardStore
from tests.unit.test_shard_metrics import ONES, PART, job, registration

pytestmark = pytest.mark.timeout(60)

ENDED = "was ended on this shard"


def _ended(call) -> PreconditionError:
    with pytest.raises(PreconditionError, match=ENDED) as info:
        call()
    assert not isinstance(info.value, FencedError), "a fenced worker would register the old model again"
    return info.value


def test_every_call_of_an_ended_jobs_worker_is_refused_for_good_and_a_new_job_starts():
    store, w = job("a", "b")
    a = w["a"]
    store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [ONES], session=a.session)
    ended = store.end_job()
    assert (ended.job_fingerprint, ended.version, ended.workers_live) == ("job", 1, 2)
    status = store.status()
    assert (status["state"], status["version"], status["workers"], status["parts"]) == ("empty", 0, [], [])

    _ended(lambda: store.apply_push(a.worker_id, a.generation, 2, 1, [PART], [ONES], session=a.session))
    _ended(lambda: store.check_session(a.worker_id, a.generation, a.session))
    _ended(lambda: store.heartbeat(a.worker_id, a.generation, session=a.session))
    _ended(lambda: store.leave(a.worker_id, a.generation, session=a.session))
    _ended(lambda: store.pull({}, timeout=1, worker_id=a.worker_id, generation=a.generation, clock=1,
                              session=a.session))
    _ended(lambda: store.data(a.worker_id, a.generation, plan=None, session=a.session))
    _ended(lambda: store.register(registration("a"), session=a.session))  # its session, re-registering

    # A different model on the same shard: a new job, with ids the old job never had.
    other = Part("v", (3,), FLOAT32, 0, 3)
    new = store.register(replace(registration("a"), parts=(other,), job_fingerprint="job-2"))
    assert new.must_initialize and new.worker_id > w["b"].worker_id
    assert store.initialize(new.worker_id, new.generation, [np.zeros(3, np.float32)]) == (True, 0)
    store.apply_push(new.worker_id, new.generation, 1, 0, [other], [np.ones(3, np.float32)], session=new.session)
    assert store.status()["job_fingerprint"] == "job-2" and store.status()["version"] == 1
    # The old job's worker is still refused, now that a new job runs.
    _ended(lambda: store.heartbeat(a.worker_id, a.generation, session=a.session))


def test_a_final_checkpoint_that_fails_leaves_the_job_running_unchanged():
    store, w = job("a")
    a = w["a"]

    def failing(exported):
        version, tensors, metadata = exported
        assert version == 0 and np.array_equal(tensors["var/w"], np.zeros(2))
        assert store.status()["state"] == "ending"
        with pytest.raises(NotReadyError, match="being ended"):  # the job's calls wait meanwhile
            store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [ONES], session=a.session)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.end_job(failing)
    assert store.status()["state"] == ShardState.READY.value
    store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [ONES], session=a.session)
    assert store.status()["version"] == 1


def test_the_final_checkpoint_sees_the_last_push_and_is_returned():
    store, w = job("a")
    a = w["a"]
    store.apply_push(a.worker_id, a.generation, 1, 0, [PART], [ONES], session=a.session)
    seen = []
    ended = store.end_job(lambda exported: seen.append(exported) or "written")
    assert ended.final == "written" and seen[0][0] == 1
    assert not np.array_equal(seen[0][1]["var/w"], np.zeros(2))


def test_end_job_checks_the_fingerprint_and_does_nothing_without_a_job():
    assert ShardStore().end_job() is None
    store, _ = job("a")
    with pytest.raises(PreconditionError, match="holds job 'job', not 'other'"):
        store.end_job(job_fingerprint="other")
    assert store.status()["state"] == "ready"
    assert store.end_job(job_fingerprint="job") is not None


def test_a_pull_waiting_on_the_bound_is_told_at_once_that_the_job_ended():
    store, w = job("fast", "slow", consistency=Consistency(mode="ssp", staleness=0))
    fast = w["fast"]
    store.apply_push(fast.worker_id, fast.generation, 1, 0, [PART], [ONES], clock=1, session=fast.session)
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            store.pull({}, timeout=30, worker_id=fast.worker_id, generation=fast.generation, clock=1,
                       session=fast.session)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    waiter = threading.Thread(target=pull)
    waiter.start()
    deadline = threading.Event()
    for _ in range(200):  # until the pull waits on "slow" (the store counts waiting pulls)
        if store.status()["pulls_waiting"]:
            break
        deadline.wait(0.05)
    assert store.status()["pulls_waiting"] == 1
    store.end_job()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "the waiting pull was not woken by the job's end"
    assert isinstance(errors[0], PreconditionError) and ENDED in str(errors[0])


def test_a_restore_never_brings_an_ended_job_back_but_its_checkpoints_stay_readable(tmp_path):
    from psserver.checkpoint import CheckpointError, CheckpointStore, ShardPart

    files = CheckpointStore(tmp_path)
    for cid in (1, 2):
        files.write(cid, 0, 1, ShardPart({"var/w": np.full(2, float(cid))}, {"job": "old"}))
    assert files.load(0, 1)[0] == 2
    assert files.mark_ended("task=old") == 2
    assert files.mark_ended("task=old") == 2  # idempotent
    with pytest.raises(CheckpointError, match="belongs to job 'task=old', ended by psctl end-job"):
        files.load(0, 1)
    assert files.load_all()[0] == 2 and files.load_all(1)[0] == 1  # export still reads them
    files.write(3, 0, 1, ShardPart({"var/w": np.full(2, 3.0)}, {"job": "new"}))  # the next job's
    cid, part = files.load(0, 1)
    assert cid == 3 and part.metadata == {"job": "new"}
