"""Summaries of repeated measurements: the median for throughputs, percentiles for latencies.

Medians, not means: on a shared machine one repetition that lost its core to another process
should not move the figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LatencySummary", "median", "median_ratio", "percentile", "repetitions"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default). Raises ``ValueError`` for no values or ``q`` outside 0..100."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def repetitions(seconds: Sequence[float]) -> list[float]:
    """Every repetition's seconds as the JSON keeps them: to the microsecond."""
    return [round(s, 6) for s in seconds]


def median(values: Sequence[float]) -> float:
    """The median; raises ``ValueError`` for no values."""
    return percentile(values, 50.0)


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of ``numerators[i] / denominators[i]``: of pairs measured side by side, so
    that each ratio compares two figures taken under about the same load. Raises ``ValueError``
    for no pairs, sequences of different lengths or a zero denominator."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators against {len(denominators)} denominators")
    if not all(denominators):
        raise ValueError("a ratio with a zero denominator")
    return median([a / b for a, b in zip(numerators, denominators)])


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles of many timed calls, in seconds."""

    calls: int
    p50_seconds: float
    p90_seconds: float
    p99_seconds: float
    min_seconds: float
    max_seconds: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> "LatencySummary":
        """Raises ``ValueError`` for no values."""
        return cls(
            calls=len(seconds),
            p50_seconds=percentile(seconds, 50.0),
            p90_seconds=percentile(seconds, 90.0),
            p99_seconds=percentile(seconds, 99.0),
            min_seconds=min(seconds),
            max_seconds=max(seconds),
        )
