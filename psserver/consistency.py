"""The consistency dial, as pure decisions over clocks, membership and staleness.

A worker's *clock* is its count of completed steps: it pulls at clock ``c``, computes the
gradient of step ``c`` and pushes it tagged with ``c``; the shard then counts it at clock ``c+1``.
The shard's clock is the minimum clock over its live members: every member has pushed every
step below it. Staleness of a push is measured by the shard:

- ``async``: in versions, ``version at apply - version pulled`` (updates applied in between);
- ``ssp`` and ``sync``: in clocks, ``shard clock at apply - shard clock pulled``, the unit in
  which the bound ``S`` is stated (SSP, Ho et al. 2013).

Nothing here reads a clock, takes a lock or touches a tensor: the store feeds the facts in and
acts on the decision, and the tests drive these functions over arbitrary interleavings.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from pswire.consistency import Consistency, Mode, StalePolicy

__all__ = [
    "Consistency",
    "Mode",
    "PullDecision",
    "PushAction",
    "PushDecision",
    "StalePolicy",
    "decide_pull",
    "decide_push",
    "shard_clock",
    "sync_quorum",
]


def shard_clock(member_clocks: Mapping[str, int], floor: int = 0) -> int:
    """Minimum clock over live members; ``floor`` (the last value) when there are none, so the
    clock never moves backwards when the last member leaves."""
    return max(floor, min(member_clocks.values())) if member_clocks else floor


@dataclass(frozen=True)
class PullDecision:
    proceed: bool
    reason: str
    waiting_for: str | None = None
    """The slowest member holding this pull back, when it must wait."""


def decide_pull(
    consistency: Consistency, worker_clock: int, member_clocks: Mapping[str, int], applied_clock: int
) -> PullDecision:
    """May a worker at ``worker_clock`` read now?

    ``member_clocks`` are the live members' clocks; ``applied_clock`` is the clock up to which
    the shard has applied updates (sync applies one aggregate per clock).
    """
    if consistency.mode is Mode.ASYNC:
        return PullDecision(True, "async: reads never wait")
    if consistency.mode is Mode.SYNC:
        if applied_clock >= worker_clock:
            return PullDecision(True, f"sync: clock {worker_clock} is open")
        pending = {n: c for n, c in member_clocks.items() if c < worker_clock}
        slowest = min(pending, key=lambda n: (pending[n], n)) if pending else None
        return PullDecision(
            False,
            f"sync: clock {worker_clock} opens once clock {worker_clock - 1} is applied",
            slowest,
        )
    need = worker_clock - consistency.staleness
    behind = {n: c for n, c in member_clocks.items() if c < need}
    if not behind:
        return PullDecision(True, f"ssp: every live worker has reached clock {need}")
    slowest = min(behind, key=lambda n: (behind[n], n))
    return PullDecision(
        False,
        f"ssp: clock {worker_clock} needs every worker at clock >= {need} (S={consistency.staleness}); "
        f"{slowest} is at {behind[slowest]}",
        slowest,
    )


class PushAction(str, enum.Enum):
    APPLY = "apply"
    SCALE = "scale"
    DROP = "drop"
    ACCUMULATE = "accumulate"


@dataclass(frozen=True)
class PushDecision:
    action: PushAction
    reason: str
    lr_scale: float = 1.0


def decide_push(
    consistency: Consistency,
    staleness: int,
    *,
    push_clock: int = 0,
    open_clock: int = 0,
    received: int = 0,
    quorum: int = 1,
) -> PushDecision:
    """What to do with a push of measured ``staleness``.

    Sync: ``push_clock`` is the clock the gradient belongs to, ``open_clock`` the clock the
    shard is collecting, ``received`` how many gradients it has for it and ``quorum`` how many
    it needs; a gradient for a closed clock (a backup worker's late one) is dropped.
    """
    if consistency.mode is Mode.ASYNC:
        return PushDecision(PushAction.APPLY, "async: applied on arrival")
    if consistency.mode is Mode.SYNC:
        if push_clock != open_clock or received >= quorum:
            return PushDecision(
                PushAction.DROP, f"sync: clock {push_clock} is closed (collecting {open_clock})"
            )
        return PushDecision(PushAction.ACCUMULATE, f"sync: gradient {received + 1} of {quorum} for clock {open_clock}")
    if staleness <= consistency.staleness:
        return PushDecision(PushAction.APPLY, f"ssp: staleness {staleness} <= S={consistency.staleness}")
    if consistency.stale_policy is StalePolicy.DROP:
        return PushDecision(PushAction.DROP, f"ssp: staleness {staleness} > S={consistency.staleness}: dropped")
    return PushDecision(
        PushAction.SCALE,
        f"ssp: staleness {staleness} > S={consistency.staleness}: learning rate / {staleness}",
        lr_scale=1.0 / staleness,
    )


def sync_quorum(consistency: Consistency, live_members: int) -> int:
    """Gradients a sync clock needs: the live members less the backup workers, at least one."""
    return max(1, live_members - consistency.backup_workers)
