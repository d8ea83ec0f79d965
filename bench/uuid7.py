"""UUID version 7, time-ordered (RFC 9562 section 5.7), for bench/wal_frames.py ``--ids uuid7``.

Measured, not used by the agent: time-ordered ids would share their first
8-13 hex digits, and operators name rows by 8-digit prefixes
(docs/operations.md#row-ids). A message's id is the key of the queue's primary-key index. A random id
(version 4) puts each new row of a commit on a different leaf page of that
index, so every commit rewrote one page per row; ids that grow with time
append to the last leaf instead. The contract only promises "a UUID",
fixed for life (docs/protocol.md).

Layout (RFC 9562 5.7): 48 bits of Unix time in milliseconds, the version
(0b0111), 12 bits ``rand_a``, the variant (0b10), 62 bits ``rand_b``. Within
one millisecond ``rand_a`` is a counter (RFC 9562 6.2, method 1: a fixed
12-bit counter, seeded at random below its top bit each new millisecond, so
it has at least 2,048 steps left), so ids from one source sort in the order
they were made. When the counter runs out, or the clock steps back, the
timestamp is carried forward by a millisecond (RFC 9562 6.2: monotonicity
over clock accuracy) rather than ever repeating or going back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["Uuid7Source", "format_uuid", "uuid7_int"]

_COUNTER_MAX = 0xFFF
_RAND_B_MASK = (1 << 62) - 1


def uuid7_int(unix_ms: int, rand_a: int, rand_b: int) -> int:
    """The 128-bit UUIDv7 of these fields (RFC 9562 5.7), version and variant bits set."""
    return ((unix_ms & 0xFFFF_FFFF_FFFF) << 80) | (0x7 << 76) | ((rand_a & _COUNTER_MAX) << 64) \
        | (0b10 << 62) | (rand_b & _RAND_B_MASK)


def format_uuid(value: int) -> str:
    """The 8-4-4-4-12 lower-case hex form (RFC 9562 section 4), as ``str(uuid.UUID(int=value))``."""
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Uuid7Source:
    """Makes UUIDv7 strings, each greater than the one before (from this source).

    Meant for one thread (the queue's writer); from several at once ids stay
    unique (62 random bits each) but may leave the order by a step.
    """

    __slots__ = ("_clock_ns", "_counter", "_last_ms", "_random")

    def __init__(
        self, clock_ns: Callable[[], int] = time.time_ns, random: Callable[[int], bytes] = os.urandom
    ) -> None:
        self._clock_ns = clock_ns
        self._random = random
        self._last_ms = -1
        self._counter = 0

    def __call__(self) -> str:
        rand = int.from_bytes(self._random(10), "big")
        ms = self._clock_ns() // 1_000_000
        if ms > self._last_ms:
            self._last_ms = ms
            self._counter = (rand >> 64) & 0x7FF  # seeded below the top bit: room to count
        elif self._counter < _COUNTER_MAX:
            self._counter += 1
        else:  # 4,096 ids in one millisecond, or the clock stepped back: borrow the next one
            self._last_ms += 1
            self._counter = (rand >> 64) & 0x7FF
        return format_uuid(uuid7_int(self._last_ms, self._counter, rand))
