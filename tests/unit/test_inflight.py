"""The shard's bound on push bytes in flight (``psserver.inflight``)."""

from __future__ import annotations

import threading

import pytest

from psserver.inflight import InflightBudget

pytestmark = pytest.mark.timeout(30)


def test_a_push_waits_for_room_and_gets_it_when_another_is_applied():
    budget = InflightBudget(100)
    assert budget.acquire(60, timeout=0)
    assert not budget.acquire(60, timeout=0.05)  # 120 > 100: no room within the timeout
    admitted = threading.Event()
    waiter = threading.Thread(target=lambda: budget.acquire(60, timeout=10) and admitted.set())
    waiter.start()
    assert not admitted.wait(0.1)
    budget.release(60)
    waiter.join(timeout=10)
    assert admitted.is_set()
    assert (budget.held, budget.peak) == (60, 60)


def test_one_push_larger_than_the_budget_is_admitted_alone():
    budget = InflightBudget(100)
    assert budget.acquire(500, timeout=0)
    assert not budget.acquire(1, timeout=0)
    budget.release(500)
    assert budget.acquire(1, timeout=0)
    assert budget.peak == 500


def test_zero_means_no_bound():
    budget = InflightBudget(0)
    assert all(budget.acquire(1 << 40, timeout=0) for _ in range(3))
    assert budget.held == 3 << 40
    with pytest.raises(ValueError):
        InflightBudget(-1)


def test_a_transfer_holds_only_the_bytes_it_received():
    budget = InflightBudget(100)
    trickle = budget.transfer()
    assert trickle.acquire(1, timeout=0)  # announced 8 GiB, sent one byte
    assert budget.held == 1
    with budget.transfer() as real:
        assert real.acquire(90, timeout=0)
        assert budget.held == 91
    assert budget.held == 1
    trickle.close()
    trickle.close()
    assert budget.held == 0


def test_the_oldest_transfer_is_always_admitted_so_pieces_cannot_deadlock():
    budget = InflightBudget(100)
    old, young = budget.transfer(), budget.transfer()
    assert young.acquire(60, timeout=0)
    assert old.acquire(60, timeout=0)  # over the limit, but the oldest open transfer goes on
    assert not young.acquire(60, timeout=0.05)  # the younger one waits for room
    freed = threading.Event()
    waiter = threading.Thread(target=lambda: young.acquire(30, timeout=10) and freed.set())
    waiter.start()
    old.close()
    waiter.join(timeout=10)
    assert freed.is_set() and budget.held == 90
    young.close()
    assert budget.held == 0
