"""Worker leases as a pure decision: who has been silent past the lease timeout."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["expired"]


def expired(heard_at: Mapping[str, float], now: float, timeout: float | None) -> list[str]:
    """Names of workers last heard from more than ``timeout`` seconds before ``now``, most
    silent first (ties by name). ``timeout`` None disables leases."""
    if timeout is None:
        return []
    late = [(t, name) for name, t in heard_at.items() if now - t > timeout]
    return [name for _, name in sorted(late)]
