"""A bound on the bytes of pushes a shard holds received but not yet applied.

Every push takes its byte count from one budget before its bytes are read (a gRPC stream's
chunks, or a bulk lane's staged bytes) and gives it back once applied or refused. A push that
does not fit waits, and while it waits its bytes stay in the sender's socket: gRPC's flow control
or TCP's window holds the worker back, so overload never becomes an unbounded queue in the shard.
A push is always admitted when none is in flight, so one larger than the budget still goes
through (``--max-request-bytes`` bounds each push).

The budget counts bytes received, not bytes announced: a transfer (:meth:`InflightBudget.transfer`)
takes its bytes piece by piece just before reading each piece, so a sender that announces 8 GiB
and trickles holds only what it sent. Pieces could deadlock (every open transfer holding part of
the budget and waiting for more), so the oldest open transfer is always admitted: it finishes,
frees its bytes, and the next oldest goes on. A transfer that cannot free its bytes until another
is done (a push staged on a bulk lane waits for the call read after it, whose body is budgeted too)
lends that one its place in line (``transfer(completes=...)``): when two staged pushes filled the
budget, their calls would otherwise each wait for room only the other's push could free. The bound
is then ``limit`` plus one transfer and the one completing it.
"""

from __future__ import annotations

import itertools
import threading
import time

__all__ = ["InflightBudget", "Transfer"]


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
        self._tickets = itertools.count(1)
        self._open: dict[int, int] = {}  # open transfers' tickets -> their place in line

    def acquire(self, nbytes: int, timeout: float) -> bool:
        """Take ``nbytes``, waiting up to ``timeout`` seconds for room; False if none came."""
        return self._take(None, nbytes, timeout)

    def transfer(self, completes: "Transfer | None" = None) -> "Transfer":
        """A transfer that takes its bytes as they arrive; close it (or use it as a context
        manager) once its bytes are applied or dropped. ``completes``: an open transfer that
        cannot be freed before this one is done, whose place in line this one shares (its own
        place if that one has closed already)."""
        with self._lock:
            ticket = next(self._tickets)
            self._open[ticket] = ticket if completes is None else self._open.get(completes._ticket, ticket)
        return Transfer(self, ticket)

    def _take(self, ticket: int | None, nbytes: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._freed:
            while self.limit and self._held and self._held + nbytes > self.limit and (
                ticket is None or self._open.get(ticket) != min(self._open.values())  # the oldest never waits
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._freed.wait(remaining)
            self._held += nbytes
            self._peak = max(self._peak, self._held)
            return True

    def _close(self, ticket: int, nbytes: int) -> None:
        with self._freed:
            self._open.pop(ticket, None)
            self._held -= nbytes
            self._freed.notify_all()

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


class Transfer:
    """One push's share of an :class:`InflightBudget`, taken piece by piece as bytes arrive."""

    def __init__(self, budget: InflightBudget, ticket: int) -> None:
        self._budget = budget
        self._ticket = ticket
        self.held = 0
        self._closed = False

    def acquire(self, nbytes: int, timeout: float) -> bool:
        """Take ``nbytes`` more, waiting up to ``timeout`` seconds for room (never when this is
        the oldest open transfer, or completes it); False if none came."""
        if self._closed:
            raise RuntimeError("transfer already closed")
        if not self._budget._take(self._ticket, nbytes, timeout):
            return False
        self.held += nbytes
        return True

    def close(self) -> None:
        """Give every byte back; idempotent."""
        if not self._closed:
            self._closed = True
            self._budget._close(self._ticket, self.held)
            self.held = 0

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
