"""Keeping the queue file healthy: retention, room for intake, free pages, the WAL, statistics.

The service's maintenance task calls these functions through the writer or
the reader (``await writer.call(maintenance.reclaim, now)``); intake calls
:func:`over_limits` for every message it is about to insert.

Room for intake (docs/queue.md#backpressure): intake (messages and audit
rows) may only use the disk down to ``min_free_disk_bytes``; everything below
that floor is a reserve for the writes that free space or must never stop:
claim, inflight, settle, lease, purges, vacuum, checkpoints. Free space is
measured by the first intake of a commit batch, and each intake is charged
its estimated size (a deliberate over-estimate) against that measurement —
across batches too: a measurement serves the batches that follow it for at
most ``SPACE_RECHECK_SECONDS`` or until ``SPACE_RECHECK_BYTES`` have been
charged to it, and an intake is only ever refused on a measurement taken in
its own batch. So a burst can overshoot the floor by at most one estimate's
error, what others write in between is seen within a tenth of a second, and
a commit of one message does not pay for two stat calls, a statvfs and two
PRAGMAs.

The room and file functions are SQLite-specific (PRAGMAs, the -wal file);
the retention sweep (:func:`purge_retention`, :func:`reclaim`) runs named
queries and so works on every backend. A store on a database server has no
limits here (``Space`` all zero: the server keeps its own disk), so intake
measures nothing, and the service runs only the retention sweep for it.

About 400 lines on purpose: measuring the room, refusing for it and making it
(purges, free pages, the WAL) are one budget and read best together.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import StorageError
from agent.storage.sqlite import AUTO_VACUUM_INCREMENTAL, WAL_SIZE_LIMIT

if TYPE_CHECKING:
    from agent.storage.store_base import StoreBase

__all__ = [
    "FREE_PAGE_SLACK",
    "Space",
    "auto_vacuum",
    "checkpoint",
    "disk_tight",
    "enforce_size_cap",
    "free_pages",
    "group_cost",
    "intake_cost",
    "make_room",
    "optimize",
    "over_limits",
    "pressure",
    "purge_retention",
    "reclaim",
    "release_free_pages",
    "room_problem",
    "used_bytes",
]

#: How long one free-space measurement serves the commit batches after it
#: (what other processes and dispatch write meanwhile is seen this late)…
SPACE_RECHECK_SECONDS = 0.1
#: … and how many bytes of intake may be charged to it before the next batch
#: measures again.
SPACE_RECHECK_BYTES = 16 * 1024 * 1024

#: The message the readiness checks ask room for: a short one. Intake charges
#: every message its pages besides its bytes (:func:`intake_cost`), so a check
#: for zero bytes passes on a file that refuses every real message.
PROBE_MESSAGE_BYTES = 256

#: How long a message refused for room keeps readiness down while it still would not fit
#: (docs/operations.md#healthz-and-readyz): a sender resending it every few seconds keeps
#: the node "in backpressure"; one that gave up for good stops counting after this.
REFUSAL_SHOWN_S = 60.0

#: Why intake refuses when the file reached its cap (room_problem's first answer).
AT_MAX_DB_BYTES = "the queue database is at queue.max_db_bytes"

#: Free pages a file keeps for its next rows rather than handing them back at
#: once (4 MiB of 4 KiB pages): steady intake after a retention sweep reuses
#: them instead of shrinking and regrowing the file. Under backpressure all go.
FREE_PAGE_SLACK = 1024


@dataclass
class Space:
    """A store's limits, the last free-space measurement and what intake has charged to it."""

    max_db_bytes: int = 0
    min_free_disk_bytes: int = 0
    disk_free: int | None = None  # usable disk space when last measured (None: measure)
    measured_at: float = field(default=float("-inf"))  # time.monotonic() of that measurement
    fresh: bool = False  # measured during the current batch
    spent: int = 0  # bytes charged to the measurement since it was taken
    batch_cost: int = 0  # bytes the intakes of this batch may have added
    page_size: int = 0
    #: time.monotonic() of the last intake refused for room.
    refused_at: float = field(default=float("-inf"))
    #: Which limit refused it: "size" (max_db_bytes) or "disk" (min_free_disk_bytes).
    refused_for: str = ""
    #: What it would have cost (intake_cost, group_cost); 0 once that much fits again.
    refused_cost: int = 0

    def begin_batch(self) -> None:
        """A commit batch starts: its intakes are charged anew; measure again if the last one is old."""
        self.batch_cost = 0
        self.fresh = False
        if self.disk_free is not None and (
                self.spent >= SPACE_RECHECK_BYTES
                or time.monotonic() - self.measured_at >= SPACE_RECHECK_SECONDS):
            self.disk_free = None

    def forget(self) -> None:
        """The next check measures the disk afresh."""
        self.disk_free = None

    def measured(self, usable: int) -> None:
        """A measurement taken now: what this batch has charged so far is not on the disk yet."""
        self.disk_free = usable
        self.measured_at = time.monotonic()
        self.fresh = True
        self.spent = self.batch_cost

    def charge(self, cost: int) -> None:
        self.batch_cost += cost
        self.spent += cost


def _pragma(store: StoreBase, name: str) -> int:
    return int(store.conn.execute(f"PRAGMA {name}").fetchone()[0])


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def wal_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + "-wal")


# -- measuring -------------------------------------------------------------------


def page_size(store: StoreBase) -> int:
    space = store.space
    if not space.page_size:
        space.page_size = _pragma(store, "page_size")
    return space.page_size


def intake_cost(store: StoreBase, nbytes: int) -> int:
    """Disk bytes one intake may take: its pages in the WAL and again in the file, plus the
    index, counter and dedupe pages it touches (a deliberate over-estimate).

    0 when the store has no limits to charge it to (always so on a database
    server, which keeps its own disk): then nothing is measured at all.
    """
    space = store.space
    if not (space.max_db_bytes or space.min_free_disk_bytes):
        return 0
    return 2 * nbytes + 12 * page_size(store)


#: What a batch member beyond the first adds besides its bytes: its index and
#: dedupe entries (measured: about 0.8 KiB of file per small member, as much
#: again in the WAL; :func:`group_cost` adds how rows pack into pages).
ROW_OVERHEAD_BYTES = 1024


def group_cost(store: StoreBase, sizes: Sequence[int]) -> int:
    """Disk bytes one intake group (an HL7 batch: one commit) may take, its members' ``sizes`` given.

    The first member costs what a single message does (:func:`intake_cost`:
    the commit's touched pages are counted there); each further one twice its
    bytes plus its entries, plus as much again (up to a page) for how rows
    pack into pages: a row just over half a page takes a page of its own.
    Charging every member a single message's 12 pages had a 500-member
    batch of 40 KB refused as 24 MB, and one over ``max_db_bytes / 48 KiB``
    members refused for ever ("resend later") on an empty queue.
    """
    if not sizes:
        return 0
    first = intake_cost(store, sizes[0])
    if not first:
        return 0
    page = page_size(store)
    return first + sum(2 * (n + ROW_OVERHEAD_BYTES + min(n, page)) for n in sizes[1:])


def free_pages(store: StoreBase) -> int:
    """Pages inside the file that hold no data: new rows reuse them before the file grows."""
    return _pragma(store, "freelist_count")


def used_bytes(store: StoreBase) -> int:
    """Database size without free pages (docs/queue.md#backpressure)."""
    return (_pragma(store, "page_count") - free_pages(store)) * page_size(store)


def free_disk_bytes(store: StoreBase) -> int:
    st = os.statvfs(store.db_path.parent)
    return int(st.f_bavail * st.f_frsize)


def _usable_disk_bytes(store: StoreBase) -> int:
    """Free disk space minus what is already promised: the WAL regrows to its
    regular size (WAL_SIZE_LIMIT) after every truncation, and pages that so
    far live only in the WAL extend the file when they are checkpointed."""
    wal = _file_size(wal_path(store.db_path))
    logical = _pragma(store, "page_count") * page_size(store)
    pending = max(0, logical - _file_size(store.db_path))
    return free_disk_bytes(store) - max(0, WAL_SIZE_LIMIT - wal) - pending


def room_problem(store: StoreBase, cost: int) -> tuple[str, bool] | None:
    """Why ``cost`` more intake bytes do not fit now, and whether purging rows would help."""
    space = store.space
    if space.max_db_bytes and used_bytes(store) + cost > space.max_db_bytes:
        return AT_MAX_DB_BYTES, True
    floor = space.min_free_disk_bytes
    if not floor:
        return None
    if space.disk_free is None:
        space.measured(_usable_disk_bytes(store))
    problem = _disk_problem(store, floor, cost)
    if problem is not None and not space.fresh:
        # Never refuse on an older measurement: the charges since are an
        # over-estimate, and others may have freed space meanwhile.
        space.measured(_usable_disk_bytes(store))
        problem = _disk_problem(store, floor, cost)
    return problem


def _disk_problem(store: StoreBase, floor: int, cost: int) -> tuple[str, bool] | None:
    space = store.space
    assert space.disk_free is not None
    disk = space.disk_free - space.spent - cost
    if disk >= floor:
        return None
    # Half the floor always stays really free on the disk: the WAL that
    # dispatch writes lives outside the file's free pages.
    if disk < floor // 2:
        return "free disk space is below queue.min_free_disk_bytes", False
    # The file's own free pages count as room: new rows reuse them first
    # (and a file with auto_vacuum hands them back to the filesystem).
    if disk + free_pages(store) * page_size(store) < floor:
        return "free disk space is below queue.min_free_disk_bytes", True
    return None


def over_limits(store: StoreBase, now: float, cost: int = 0) -> bool:
    """Backpressure (docs/queue.md#backpressure): purge what the limits allow first, then refuse.

    ``cost`` (see :func:`intake_cost`) is charged to this batch when it fits.
    """
    space = store.space
    if not (space.max_db_bytes or space.min_free_disk_bytes):
        return False
    if room_problem(store, cost) is not None:
        make_room(store, now, cost)
        problem = room_problem(store, cost)
        if problem is not None:
            space.refused_at = time.monotonic()
            space.refused_for = "size" if problem[0] == AT_MAX_DB_BYTES else "disk"
            space.refused_cost = cost
            return True
    space.charge(cost)
    if cost >= space.refused_cost:
        space.refused_cost = 0  # as much as was refused fits again
    return False


def pressure(store: StoreBase) -> str | None:
    """Why intake would refuse a short message now (a fresh measurement), or None."""
    store.space.forget()
    problem = room_problem(store, intake_cost(store, PROBE_MESSAGE_BYTES))
    return problem[0] if problem else None


def disk_tight(store: StoreBase) -> bool:
    """The disk alone, without the file's free pages, is below the floor: give those back."""
    floor = store.space.min_free_disk_bytes
    return bool(floor and _usable_disk_bytes(store) < floor)


def check_room(store: StoreBase) -> None:
    """Raise StorageError while intake is in backpressure, after purging what it may.

    In backpressure: a short message would be refused now, or a message was
    refused for room within ``REFUSAL_SHOWN_S`` and one of its size would
    still be. Room for a short message alone is not enough: the queue may
    refuse every message of the size its senders send.
    """
    for cost in (intake_cost(store, PROBE_MESSAGE_BYTES), _recent_refusal(store)):
        if not cost:
            continue
        if room_problem(store, cost) is not None:
            make_room(store, store.clock(), cost)
            problem = room_problem(store, cost)
            if problem is not None:
                raise StorageError(f"backpressure: {problem[0]}")
    store.space.refused_cost = 0


def _recent_refusal(store: StoreBase) -> int:
    """The cost of the message last refused for room, if that was within REFUSAL_SHOWN_S; else 0."""
    space = store.space
    if space.refused_cost and time.monotonic() - space.refused_at < REFUSAL_SHOWN_S:
        return space.refused_cost
    return 0


# -- purging ---------------------------------------------------------------------


def purge_retention(store: StoreBase, now: float, batch: int = 1000) -> int:
    """Delete purgeable terminal rows older than ``retention`` and expired dedupe keys.

    ``failed`` rows are never purged automatically: they are undelivered messages.
    """
    store.conn.execute(store.q["purge_expired_dedupe_keys"], {"now": now})
    cur = store.conn.execute(
        store.q["purge_terminal_older_than"], {"cutoff": now - store.retention, "limit": batch}
    )
    return int(cur.rowcount)


def _purge_oldest(store: StoreBase, limit: int = 500) -> int:
    """Size cap: the oldest purgeable terminal rows go first."""
    return int(store.conn.execute(store.q["purge_oldest_terminal"], {"limit": limit}).rowcount)


def make_room(store: StoreBase, now: float, cost: int = 0, max_steps: int = 20) -> int:
    """Purge for room: what retention allows, then the oldest delivered rows first.

    Only ``processed``, ``rejected`` and ``nacked`` rows go (never live or
    ``failed`` ones), at most ``max_steps`` batches of 500 per call so one
    intake never holds the write lock for long; the next call goes on.
    """
    purged = purge_retention(store, now)
    for _ in range(max_steps):
        problem = room_problem(store, cost)
        if problem is None or not problem[1]:
            break
        step = _purge_oldest(store)
        if step == 0:
            break
        purged += step
    return purged


def enforce_size_cap(store: StoreBase) -> int:
    purged = 0
    cap = store.space.max_db_bytes
    while cap and used_bytes(store) >= cap:
        step = _purge_oldest(store)
        if step == 0:
            break
        purged += step
    return purged


def headroom_short(store: StoreBase) -> bool:
    """Free space is within half the floor of ``min_free_disk_bytes`` (free pages counted).

    The maintenance then purges delivered rows early (:func:`purge_for_headroom`),
    so the disk does not hover at the floor with intake refusing on and off.
    """
    floor = store.space.min_free_disk_bytes
    if not floor:
        return False
    return _usable_disk_bytes(store) + free_pages(store) * page_size(store) < floor + floor // 2


def purge_for_headroom(store: StoreBase, max_steps: int = 20) -> int:
    """The oldest delivered rows, until half the floor is free above it again (bounded per call).

    Only what backpressure would purge anyway: ``processed``, ``rejected`` and
    ``nacked`` rows, never live or ``failed`` ones.
    """
    purged = 0
    for _ in range(max_steps):
        if not headroom_short(store):
            break
        step = _purge_oldest(store)
        if step == 0:
            break
        purged += step
    return purged


def reclaim(store: StoreBase, now: float) -> int:
    """The retention sweep: retention, room for intake, then the size cap. Rows purged."""
    return make_room(store, now) + enforce_size_cap(store)


# -- the file and the WAL ----------------------------------------------------------


def auto_vacuum(store: StoreBase) -> int:
    """The file's PRAGMA auto_vacuum (AUTO_VACUUM_NONE or AUTO_VACUUM_INCREMENTAL)."""
    return _pragma(store, "auto_vacuum")


def release_free_pages(store: StoreBase, keep: int = 0, limit: int = 2048) -> int:
    """Hand free pages beyond ``keep`` back to the filesystem, at most ``limit`` per call.

    Needs auto_vacuum = INCREMENTAL (files created since this version).
    The file itself shrinks at the next complete checkpoint. Returns the
    number of pages released.
    """
    if auto_vacuum(store) != AUTO_VACUUM_INCREMENTAL:
        return 0
    count = min(free_pages(store) - keep, limit)
    if count <= 0:
        return 0
    before = free_pages(store)
    # Python's sqlite3 steps a statement without result columns only
    # once, and each step of incremental_vacuum releases one page.
    for _ in range(count):
        store.conn.execute("PRAGMA incremental_vacuum")
    return before - free_pages(store)


def checkpoint(store: StoreBase, mode: str, wait: float = 0.1) -> tuple[int, int, int]:
    """``PRAGMA wal_checkpoint(mode)`` waiting at most ``wait`` s for locks: (busy, log, done).

    TRUNCATE takes the write lock for a moment: run a PASSIVE one first
    (it copies without blocking anybody) so little is left to copy while
    the lock is held, and give up rather than queue behind a writer.
    """
    if mode not in ("PASSIVE", "TRUNCATE"):
        raise ValueError(f"unknown checkpoint mode {mode!r}")
    conn = store.conn
    if mode == "TRUNCATE":
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    previous = _pragma(store, "busy_timeout")
    conn.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
    try:
        row = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    finally:
        conn.execute(f"PRAGMA busy_timeout = {previous}")
    return int(row[0]), int(row[1]), int(row[2])


def optimize(store: StoreBase) -> None:
    """Refresh the planner's statistics, as long-lived connections should (SQLite's PRAGMA optimize)."""
    store.conn.execute("PRAGMA optimize").fetchall()
