"""The job's consistency setting, shared by workers (who choose it) and shards (who enforce it).

The decisions that enforce it live in ``psserver.consistency``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Consistency", "Mode", "StalePolicy"]


class Mode(str, enum.Enum):
    ASYNC = "async"
    SSP = "ssp"
    SYNC = "sync"


class StalePolicy(str, enum.Enum):
    DROP = "drop"
    """Refuse a push whose staleness exceeds the bound (counted as dropped)."""
    SCALE = "scale"
    """Apply it with learning rate / staleness (staleness-aware async SGD, Zhang et al. 2016)."""


@dataclass(frozen=True, kw_only=True)
class Consistency:
    """The job's consistency setting, chosen by the first worker to register."""

    mode: Mode = Mode.ASYNC
    staleness: int = 0
    """SSP bound S (clocks); ignored by async, 0 for sync."""
    backup_workers: int = 0
    """Sync only: apply once live - B gradients of a clock have arrived; later ones are dropped."""
    stale_policy: StalePolicy = StalePolicy.DROP
    """What happens to an SSP push whose measured staleness exceeds S."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "stale_policy", StalePolicy(self.stale_policy))
        if self.staleness < 0:
            raise ValueError(f"staleness bound must be >= 0, got {self.staleness}")
        if self.backup_workers < 0:
            raise ValueError(f"backup workers must be >= 0, got {self.backup_workers}")
        if self.mode is not Mode.SYNC and self.backup_workers:
            raise ValueError("backup workers apply to sync mode only")
        if self.mode is not Mode.SSP and self.staleness:
            raise ValueError("a staleness bound applies to ssp mode only (sync is S=0)")

    @property
    def bound(self) -> int | None:
        """The staleness bound in clocks, or None when unbounded (async)."""
        return {Mode.ASYNC: None, Mode.SSP: self.staleness, Mode.SYNC: 0}[self.mode]

    def describe(self) -> str:
        if self.mode is Mode.SSP:
            return f"ssp (S={self.staleness}, stale pushes: {self.stale_policy.value})"
        if self.mode is Mode.SYNC:
            return f"sync (backup workers: {self.backup_workers})"
        return "async"
