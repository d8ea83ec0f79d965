"""Whether a lease holder may still write to the server, by its own clock (docs/queue.md#fencing).

The epoch fences database writes, not the wire: a holder frozen (SIGSTOP, a
VM pause) between committing ``inflight`` and writing the frame could wake
after its successor took over and write a stale frame. So before every write
to the server the holder checks that its last successful renewal *began* less
than ``LEASE_WRITE_FRACTION`` x ``lease_ttl`` ago. A successor can take over
only after the full TTL has passed on the wall clock; the rest is margin for
a wall-clock step and for the write itself.

Pure: the clock is a parameter (``lease_clock`` by default), so the rule is
tested with a clock the test moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["LEASE_WRITE_FRACTION", "LeaseValidity", "lease_clock"]

#: A holder writes to the server only while its last successful renewal
#: began less than this share of lease_ttl ago.
LEASE_WRITE_FRACTION = 0.8


def lease_clock() -> float:
    """Seconds on CLOCK_BOOTTIME where there is one, else the monotonic clock.

    Both never go back and ignore wall-clock steps; BOOTTIME also counts the
    time the host was suspended, which is time a successor may have used.
    """
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is not None:
        return time.clock_gettime(boottime)
    return time.monotonic()


class LeaseValidity:
    """Whether this process may still write to the server under its lease, by its own clock.

    ``renewed(started_at)`` after each successful take or renewal, with the
    clock read *before* that transaction began (so the age is never
    under-counted); ``valid()`` before each write.
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = lease_clock) -> None:
        self.limit = ttl * LEASE_WRITE_FRACTION
        self.clock = clock
        self._since: float | None = None

    def renewed(self, started_at: float) -> None:
        if self._since is None or started_at > self._since:
            self._since = started_at

    def age(self) -> float | None:
        """Seconds since the last successful renewal began; None before the first."""
        return None if self._since is None else self.clock() - self._since

    def valid(self) -> bool:
        age = self.age()
        return age is not None and age < self.limit
