"""Property tests of the pure consistency decisions in ``psserver.consistency``.

Every property is stated independently of the implementation (from the module docstring and
DESIGN.md §4) and checked over arbitrary clocks, memberships and settings.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psserver.consistency import (
    Consistency,
    Mode,
    PushAction,
    StalePolicy,
    decide_pull,
    decide_push,
    shard_clock,
    sync_quorum,
)

pytestmark = pytest.mark.timeout(120)

PROPERTY = settings(max_examples=200, deadline=None)

clocks = st.integers(min_value=0, max_value=50)
names = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
member_clocks = st.dictionaries(names, clocks, max_size=6)
bounds = st.integers(min_value=0, max_value=10)
policies = st.sampled_from(list(StalePolicy))


@st.composite
def consistencies(draw, modes=tuple(Mode)) -> Consistency:
    mode = draw(st.sampled_from(modes))
    if mode is Mode.SSP:
        return Consistency(mode=mode, staleness=draw(bounds), stale_policy=draw(policies))
    if mode is Mode.SYNC:
        return Consistency(mode=mode, backup_workers=draw(st.integers(0, 4)))
    return Consistency(mode=mode)


# -- decide_pull ------------------------------------------------------------------------------


@PROPERTY
@given(consistencies(modes=(Mode.ASYNC,)), clocks, member_clocks, clocks)
def test_async_pull_always_proceeds(consistency, clock, members, applied):
    decision = decide_pull(consistency, clock, members, applied)
    assert decision.proceed
    assert decision.waiting_for is None


@PROPERTY
@given(bounds, policies, clocks, member_clocks, clocks)
def test_ssp_pull_proceeds_iff_every_member_is_within_the_bound(bound, policy, clock, members, applied):
    consistency = Consistency(mode=Mode.SSP, staleness=bound, stale_policy=policy)
    decision = decide_pull(consistency, clock, members, applied)
    need = clock - bound
    assert decision.proceed == (not members or min(members.values()) >= need)
    if decision.proceed:
        assert decision.waiting_for is None
        return
    # The slowest member below the bound, ties broken by name, is the one named.
    slowest = sorted(members.items(), key=lambda item: (item[1], item[0]))[0]
    assert slowest[1] < need
    assert decision.waiting_for == slowest[0]
    assert slowest[0] in decision.reason
    assert f"is at {slowest[1]}" in decision.reason


@PROPERTY
@given(bounds, clocks, member_clocks)
def test_ssp_pull_ignores_the_applied_clock(bound, clock, members):
    consistency = Consistency(mode=Mode.SSP, staleness=bound)
    assert decide_pull(consistency, clock, members, 0) == decide_pull(consistency, clock, members, 10**6)


@PROPERTY
@given(st.integers(0, 4), clocks, member_clocks, clocks)
def test_sync_pull_proceeds_iff_the_previous_clock_is_applied(backup, clock, members, applied):
    consistency = Consistency(mode=Mode.SYNC, backup_workers=backup)
    decision = decide_pull(consistency, clock, members, applied)
    assert decision.proceed == (applied >= clock)
    if decision.proceed:
        assert decision.waiting_for is None
        return
    behind = sorted((c, n) for n, c in members.items() if c < clock)
    assert decision.waiting_for == (behind[0][1] if behind else None)
    assert str(clock) in decision.reason


@PROPERTY
@given(bounds, clocks, member_clocks)
def test_ssp_pull_is_monotone_in_the_members_clocks(bound, clock, members):
    """Once a pull may proceed, members advancing never make it wait again."""
    consistency = Consistency(mode=Mode.SSP, staleness=bound)
    if decide_pull(consistency, clock, members, 0).proceed:
        advanced = {n: c + 1 for n, c in members.items()}
        assert decide_pull(consistency, clock, advanced, 0).proceed
        assert decide_pull(consistency, max(0, clock - 1), members, 0).proceed


# -- decide_push ------------------------------------------------------------------------------


@PROPERTY
@given(consistencies(modes=(Mode.ASYNC,)), st.integers(0, 10**6), clocks, clocks, st.integers(0, 5))
def test_async_push_is_always_applied_unscaled(consistency, staleness, push_clock, open_clock, received):
    decision = decide_push(consistency, staleness, push_clock=push_clock, open_clock=open_clock, received=received)
    assert decision.action is PushAction.APPLY
    assert decision.lr_scale == 1.0


@PROPERTY
@given(bounds, policies, st.integers(0, 100))
def test_ssp_push_applied_iff_within_the_bound(bound, policy, staleness):
    consistency = Consistency(mode=Mode.SSP, staleness=bound, stale_policy=policy)
    decision = decide_push(consistency, staleness)
    if staleness <= bound:
        assert decision.action is PushAction.APPLY
        assert decision.lr_scale == 1.0
    elif policy is StalePolicy.DROP:
        assert decision.action is PushAction.DROP
    else:
        assert decision.action is PushAction.SCALE
        assert decision.lr_scale == 1.0 / staleness
        assert 0 < decision.lr_scale <= 1.0
    assert str(staleness) in decision.reason


@PROPERTY
@given(st.integers(0, 4), clocks, clocks, clocks, st.integers(0, 6), st.integers(1, 6))
def test_sync_push_accumulates_iff_for_the_open_clock_below_quorum(
    backup, staleness, push_clock, open_clock, received, quorum
):
    consistency = Consistency(mode=Mode.SYNC, backup_workers=backup)
    decision = decide_push(
        consistency, staleness, push_clock=push_clock, open_clock=open_clock, received=received, quorum=quorum
    )
    accumulate = push_clock == open_clock and received < quorum
    assert decision.action is (PushAction.ACCUMULATE if accumulate else PushAction.DROP)
    assert decision.lr_scale == 1.0


@PROPERTY
@given(st.integers(0, 4), clocks, st.integers(1, 6))
def test_sync_push_for_the_open_clock_is_accumulated_exactly_quorum_times(backup, open_clock, quorum):
    consistency = Consistency(mode=Mode.SYNC, backup_workers=backup)
    actions = [
        decide_push(consistency, 0, push_clock=open_clock, open_clock=open_clock, received=r, quorum=quorum).action
        for r in range(quorum + 3)
    ]
    assert actions.count(PushAction.ACCUMULATE) == quorum
    assert actions[:quorum] == [PushAction.ACCUMULATE] * quorum


# -- sync_quorum and shard_clock --------------------------------------------------------------


@PROPERTY
@given(st.integers(0, 6), st.integers(1, 12))
def test_sync_quorum_is_live_less_backups_within_one_and_live(backup, live):
    quorum = sync_quorum(Consistency(mode=Mode.SYNC, backup_workers=backup), live)
    assert 1 <= quorum <= live
    assert quorum == max(1, live - backup)


def test_sync_quorum_with_no_live_member_is_one():
    assert sync_quorum(Consistency(mode=Mode.SYNC, backup_workers=2), 0) == 1


@PROPERTY
@given(member_clocks, clocks)
def test_shard_clock_is_the_slowest_member_never_below_the_floor(members, floor):
    clock = shard_clock(members, floor)
    assert clock >= floor
    if not members:
        assert clock == floor
    elif min(members.values()) >= floor:
        assert clock == min(members.values())
    else:
        assert clock == floor


@PROPERTY
@given(member_clocks.filter(bool))
def test_shard_clock_default_floor_is_the_minimum(members):
    assert shard_clock(members) == min(members.values())


# -- Consistency validation -------------------------------------------------------------------


@PROPERTY
@given(st.sampled_from(list(Mode)), st.integers(max_value=-1))
def test_negative_staleness_is_refused(mode, staleness):
    with pytest.raises(ValueError, match="staleness bound must be >= 0"):
        Consistency(mode=mode, staleness=staleness)


@PROPERTY
@given(st.integers(max_value=-1))
def test_negative_backup_workers_are_refused(backup):
    with pytest.raises(ValueError, match="backup workers must be >= 0"):
        Consistency(mode=Mode.SYNC, backup_workers=backup)


@PROPERTY
@given(st.sampled_from([Mode.ASYNC, Mode.SSP]), st.integers(1, 10))
def test_backup_workers_outside_sync_are_refused(mode, backup):
    with pytest.raises(ValueError, match="sync mode only"):
        Consistency(mode=mode, backup_workers=backup)


@PROPERTY
@given(st.sampled_from([Mode.ASYNC, Mode.SYNC]), st.integers(1, 10))
def test_staleness_outside_ssp_is_refused(mode, staleness):
    with pytest.raises(ValueError, match="ssp mode only"):
        Consistency(mode=mode, staleness=staleness)


@PROPERTY
@given(consistencies())
def test_valid_settings_round_trip_from_strings(consistency):
    again = Consistency(
        mode=consistency.mode.value,
        staleness=consistency.staleness,
        backup_workers=consistency.backup_workers,
        stale_policy=consistency.stale_policy.value,
    )
    assert again == consistency
    assert again.bound == {Mode.ASYNC: None, Mode.SSP: consistency.staleness, Mode.SYNC: 0}[consistency.mode]


def test_unknown_mode_and_policy_are_refused():
    with pytest.raises(ValueError):
        Consistency(mode="eventual")
    with pytest.raises(ValueError):
        Consistency(mode=Mode.SSP, stale_policy="ignore")
