"""The last hour, per minute, in memory: messages in, messages out, queue depth (the status page's plots).

Why in memory rather than from the database: counting the last hour's rows by
minute scans every one of them (360 000 at 100 messages a second) on each page
load, on the reader thread the dispatcher uses too; and the depth of a past
minute is not in the database at all. Here it costs one increment per message
and stays bounded (``minutes`` buckets, older ones dropped).

What it counts is this process's: ``in`` = messages its listeners committed
and accepted, ``out`` = rows its dispatcher settled (processed, rejected or
failed). It starts empty with the process, and during an upgrade overlap each
process counts its own (the page says since when). ``depth`` is the
database's (every process's rows), sampled a few times a minute by the admin
server: the last sample of each minute is kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from agent.core.timefmt import rfc3339

#: How many minutes are kept (the page plots the last hour).
MINUTES = 60


class MinuteHistory:
    """Per-minute counters over a sliding window; every method is safe from any thread."""

    def __init__(self, minutes: int = MINUTES, clock: Callable[[], float] = time.time) -> None:
        self._minutes = minutes
        self._clock = clock
        self._lock = threading.Lock()
        #: minute number (Unix seconds // 60) -> [in, out, depth or None]
        self._buckets: dict[int, list[Any]] = {}
        self.started_at = clock()
        #: The bucket of the minute ``count_in`` last counted in, and that minute's
        #: bounds: a message per call, so the common case is one comparison.
        self._current: list[Any] = [0, 0, None]
        self._current_from = self._current_to = 0.0

    def _bucket(self, minute: int) -> list[Any]:
        """The bucket of ``minute`` (the lock held); a new minute drops those out of the window."""
        bucket = self._buckets.get(minute)
        if bucket is None:
            bucket = self._buckets[minute] = [0, 0, None]
            oldest = minute - self._minutes
            for old in [m for m in self._buckets if m <= oldest]:
                del self._buckets[old]
            if self._current_from <= oldest * 60:  # count_in's bucket just left the window
                self._current_from = self._current_to = 0.0
        return bucket

    def count_in(self, n: int = 1) -> None:
        """``n`` messages committed and accepted by this process's listeners."""
        now = self._clock()
        with self._lock:
            if self._current_from <= now < self._current_to:
                self._current[0] += n
                return
            minute = int(now // 60)
            bucket = self._current = self._bucket(minute)
            self._current_from, self._current_to = minute * 60, (minute + 1) * 60
            bucket[0] += n

    def count_out(self, n: int = 1) -> None:
        """``n`` rows settled by this process's dispatcher."""
        minute = int(self._clock() // 60)
        with self._lock:
            self._bucket(minute)[1] += n

    def note_depth(self, depth: int) -> None:
        """The queue's depth now (every channel's live rows); the minute keeps its last sample."""
        minute = int(self._clock() // 60)
        with self._lock:
            self._bucket(minute)[2] = int(depth)

    def series(self) -> dict[str, Any]:
        """The window as lists, oldest minute first, the current (partial) minute last.

        ``depth`` is None for a minute without a sample (before the process
        started, or when the database could not be read).
        """
        now = self._clock()
        current = int(now // 60)
        first = current - self._minutes + 1
        with self._lock:
            rows = [list(self._buckets.get(m, (0, 0, None))) for m in range(first, current + 1)]
        return {
            "minute_s": 60,
            "start": rfc3339(first * 60, millis=False),
            "counted_since": rfc3339(self.started_at, millis=False),
            "in": [r[0] for r in rows],
            "out": [r[1] for r in rows],
            "depth": [r[2] for r in rows],
        }
