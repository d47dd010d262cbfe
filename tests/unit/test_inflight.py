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


def test_a_transfer_that_completes_the_oldest_shares_its_place_so_staged_pushes_cannot_deadlock():
    """Two pushes staged on two lanes fill the budget, and each is freed only once the call read
    after it on its lane (budgeted too) claims it: the calls share their pushes' places in line,
    so the older push's call goes on at once, and the younger's follows once that push is freed."""
    budget = InflightBudget(100)
    older, younger = budget.transfer(), budget.transfer()
    assert younger.acquire(70, timeout=0)  # the younger took its bytes first, on an empty budget
    assert older.acquire(70, timeout=0)  # the oldest goes on over the limit
    younger_call = budget.transfer(completes=younger)
    assert not younger_call.acquire(40, timeout=0.05)  # 180 > 100, and not the oldest's
    older_call = budget.transfer(completes=older)
    assert older_call.acquire(40, timeout=0)  # in the oldest's place: no wait
    assert budget.held == 180
    older_call.close()
    older.close()  # claimed and applied
    assert younger_call.acquire(40, timeout=0)  # 110 > 100, but now first in line
    younger_call.close()
    younger.close()
    assert (budget.held, budget.peak) == (0, 180)


def test_completing_a_closed_transfer_takes_a_place_of_its_own():
    budget = InflightBudget(100)
    gone, waiting = budget.transfer(), budget.transfer()
    gone.close()
    assert waiting.acquire(90, timeout=0)
    late = budget.transfer(completes=gone)
    assert not late.acquire(20, timeout=0.05)  # behind ``waiting``, which is older
    waiting.close()
    assert late.acquire(20, timeout=0)
