"""Log lines that read as something they are not: a worker's clock on a shard taken for its
step count when it leaves, and matplotlib's news (via mnist1d) taken for the worker's own."""

from __future__ import annotations

import logging

import pytest

from psworker.tasks import _quiet
from tests.unit.test_shard_metrics import ONES, PART, job, registration

pytestmark = pytest.mark.timeout(60)


def _push(store, reg, sequence: int, clock: int, step: int | None = None) -> None:
    data = {"step": step, "epoch": 0, "position": 0} if step is not None else None
    store.apply_push(reg.worker_id, reg.generation, sequence, 0, [PART], [ONES], clock=clock, data=data)


def test_a_late_joiner_leaves_with_its_pushes_and_its_clock_told_apart(caplog):
    store, workers = job("early")
    early = workers["early"]
    for i in range(35):
        _push(store, early, i + 1, early.clock + i, step=i + 1)
    late = store.register(registration("late"))
    assert late.clock == 35  # it starts at the shard's clock, not at 0
    for i in range(100):
        _push(store, late, i + 1, late.clock + i, step=i + 1)
    with caplog.at_level(logging.INFO, logger="psserver.store"):
        store.leave(late.worker_id, late.generation)
    assert ("late left the job at its step 100, after 100 pushes to this shard in 1 registration(s); its clock "
            "here is 135 (the shard's clock when it last registered, plus one per push since)") in caplog.messages


def test_a_worker_without_a_reported_step_leaves_with_its_pushes(caplog):
    store, workers = job("dynamic")
    w = workers["dynamic"]
    _push(store, w, 1, 0)
    again = store.register(registration("dynamic"))  # a second registration: pushes count on
    _push(store, again, 1, again.clock)
    with caplog.at_level(logging.INFO, logger="psserver.store"):
        store.leave(again.worker_id, again.generation)
    assert any(m.startswith("dynamic left the job after 2 pushes to this shard in 2 registration(s); its clock here "
                            "is 2 ") for m in caplog.messages), caplog.messages


def test_quiet_holds_a_loggers_info_back_only_while_it_runs_and_only_if_nobody_set_its_level():
    logger = logging.getLogger("tests.quiet")
    assert logger.level == logging.NOTSET
    with _quiet("tests.quiet"):
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)
    assert logger.level == logging.NOTSET
    logger.setLevel(logging.DEBUG)
    try:
        with _quiet("tests.quiet"):
            assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(logging.NOTSET)
