"""A bound on the bytes of pushes a shard holds received but not yet applied.

Every push takes its byte count from one budget before its bytes are read (a gRPC stream's
chunks, or a bulk lane's staged bytes) and gives it back once applied or refused. A push that
does not fit waits, and while it waits its bytes stay in the sender's socket: gRPC's flow control
or TCP's window holds the worker back, so overload never becomes an unbounded queue in the shard.
A push is always admitted when none is in flight, so one larger than the budget still goes
through (``--max-request-bytes`` bounds each push).
"""

from __future__ import annotations

import threading
import time

__all__ = ["InflightBudget"]


class InflightBudget:
    """``limit`` bytes (0: no bound) shared by every push of one shard."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._held = 0
        self._peak = 0

    def acquire(self, nbytes: int, timeout: float) -> bool:
        """Take ``nbytes``, waiting up to ``timeout`` seconds for room; False if none came."""
        deadline = time.monotonic() + timeout
        with self._freed:
            while self.limit and self._held and self._held + nbytes > self.limit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._freed.wait(remaining)
            self._held += nbytes
            self._peak = max(self._peak, self._held)
            return True

    def release(self, nbytes: int) -> None:
        with self._freed:
            self._held -= nbytes
            self._freed.notify_all()

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    @property
    def peak(self) -> int:
        """The most bytes ever held at once."""
        with self._lock:
            return self._peak
