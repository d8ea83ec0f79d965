"""Row ids: the UUID intake gives each new row, its transmit ``id`` for life.

A row's id is the key of the queue's primary-key index, on SQLite and on
PostgreSQL alike. Random ids (version 4) put each row of a commit on another
leaf of that index: a commit of 16 messages wrote 74 pages on a 100,000-row
file, 55 with these ids (bench/wal_frames.py). Ids that grow append to
the index's last leaf instead. Time-ordered ids (version 7) grow, but ids made
within a minute share their first 8 hex digits, and operators name rows by
8-digit prefixes (docs/operations.md#row-ids). So the first 32 bits here are a
counter: consecutive ids grow *and* differ in their first 8 digits, which
stay distinct for 2**32 rows of one process (random prefixes of 8 digits
collide among some 65,000 rows).

Layout, RFC 9562 section 5.8 (version 8, "vendor-specific"): a 32-bit counter
that starts at a random value in each process (again in a forked child) and
steps by one per id, wrapping at 2**32; 16 random bits; the version (8);
12 random bits; the variant (binary 10); 62 random bits. Two ids are equal
only if both the counter and all 90 random bits are; several processes
writing one queue (an upgrade overlap, PostgreSQL hosts) append in places of
their own.
"""

from __future__ import annotations

import itertools
import os

__all__ = ["RowIds", "format_row_id"]

#: Random parts drawn per ``getrandom`` call: one system call per 64 ids, not per id.
_DRAWN_AT_ONCE = 64
#: Hex digits of randomness one id takes (90 bits are used of these 96).
_RANDOM_HEX = 24


def format_row_id(counter: int, random_hex: str) -> str:
    """The id of ``counter`` (mod 2**32) and 24 random hex digits, as ``str(uuid.UUID)`` writes it.

    RFC 9562 section 5.8: version 8 in the high nibble of octet 6, variant
    binary 10 in the top bits of octet 8; the rest is ours.
    """
    h = random_hex
    variant = "89ab"[int(h[7], 16) & 3]
    return f"{counter & 0xFFFF_FFFF:08x}-{h[0:4]}-8{h[4:7]}-{variant}{h[8:11]}-{h[11:23]}"


class RowIds:
    """A source of row ids: the counter and a pool of random parts, both renewed in a forked child.

    A child that kept both would make the very ids its parent makes next.
    """

    def __init__(self) -> None:
        self._renew()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._counter = itertools.count(int.from_bytes(os.urandom(4), "big"))
        self._random: list[str] = []

    def __call__(self) -> str:
        try:
            random_hex = self._random.pop()
        except IndexError:
            raw = os.urandom(_RANDOM_HEX // 2 * _DRAWN_AT_ONCE).hex()
            self._random = [raw[at : at + _RANDOM_HEX] for at in range(0, len(raw), _RANDOM_HEX)]
            random_hex = self._random.pop()
        return format_row_id(next(self._counter), random_hex)
