"""The SQLite queue: intake, claim, settle, lease, stats (SPEC section 6).

``SqliteStore`` methods run *inside* a transaction opened by their caller —
the writer thread groups many of them into one ``BEGIN IMMEDIATE … COMMIT``
(group commit), each inside its own SAVEPOINT so one failed operation does not
sink its neighbours. ``transaction()`` is there for single-shot callers
(operator commands, tests).

Every state transition is a guarded UPDATE whose row count is checked; every
dispatch write is fenced on the lease epoch, so a process that lost the lease
cannot change a row even before it notices.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from agent.core import states
from agent.core.timefmt import rfc3339
from agent.errors import LeaseLost, StorageError
from agent.storage.sqlite import WAL_SIZE_LIMIT

#: Free pages a file keeps for its next rows rather than handing them back at
#: once (4 MiB of 4 KiB pages): steady intake after a retention sweep reuses
#: them instead of shrinking and regrowing the file. Under backpressure all go.
FREE_PAGE_SLACK = 1024

AckMode = Literal["commit", "application", "enhanced"]
IntakeOutcome = Literal["accepted", "duplicate", "conflict", "backpressure"]


@dataclass(frozen=True)
class IntakeItem:
    """One framed message that passed the envelope checks, ready to queue."""

    channel: str
    remote: str
    sending_app: str
    sending_facility: str
    control_id: str
    message_type: str
    body: bytes
    encoding: str
    ack_mode: AckMode
    accept_ack_type: str = ""
    application_ack_type: str = ""
    commit_ack: bytes | None = None  # the accept ACK to send (None: not owed)
    received_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class IntakeResult:
    outcome: IntakeOutcome
    message_id: str
    seq: int | None = None
    ack_mode: AckMode = "commit"
    commit_ack: bytes | None = None  # duplicates: the ACK to replay
    app_ack: bytes | None = None  # duplicates: the application ACK, once known
    prior_state: str | None = None  # duplicates: the original row's state


@dataclass(frozen=True)
class AuditItem:
    """A frame intake refused or only recorded: kept as a ``nacked`` row."""

    channel: str
    remote: str
    body: bytes
    error_code: str
    error_text: str
    sending_app: str = ""
    sending_facility: str = ""
    control_id: str = ""
    message_type: str = ""
    ack_sent: bytes | None = None
    received_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class HeadRow:
    """The head of a channel: its lowest-seq live row."""

    id: str
    channel: str
    seq: int
    state: str
    attempts: int
    next_attempt_at: float
    claim_epoch: int | None
    remote: str
    control_id: str
    message_type: str
    encoding: str
    body: bytes
    received_at: float
    ack_mode: AckMode
    redrive_base: int = 0


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds (or wants) the dispatch lease, with what proves it alive."""

    holder: str
    pid: int
    boot_id: str
    pidns: str
    start_ticks: int

    @classmethod
    def for_this_process(cls, agent_id: str) -> LeaseHolder:
        pid = os.getpid()
        return cls(
            holder=f"{agent_id}@{os.uname().nodename}:{pid}:{uuid.uuid4().hex[:8]}",
            pid=pid,
            boot_id=_read_boot_id(),
            pidns=_read_pidns(),
            start_ticks=_process_start_ticks(pid) or 0,
        )


@dataclass(frozen=True)
class Lease:
    holder: str
    epoch: int
    expires_at: float


def _read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _read_pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) from /proc/PID/stat, fields 3 and 22 (proc(5)); None if no such PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot)."""
    found = _process_stat(pid)
    return found[1] if found is not None else None


#: proc(5) states of a process that has exited: Z (zombie: killed or exited,
#: not yet reaped by its parent) and X (dead). A stopped process (T, t) may
#: still resume, so it counts as alive.
_EXITED_STATES = frozenset({"Z", "X"})


def holder_provably_dead(pid: int | None, boot: str | None, pidns: str | None, start: int | None) -> bool:
    """Same boot and PID namespace, and the PID is gone, reused, or has exited unreaped (a zombie).

    A zombie keeps its /proc entry and start time until its parent reaps it
    (a supervisor may take its time), yet runs no code: it can dispatch
    nothing, so a standby need not wait out the TTL for it.
    """
    if pid is None or not boot or not pidns:
        return False
    if boot != _read_boot_id() or pidns != _read_pidns():
        return False
    found = _process_stat(pid)
    if found is None:
        return True
    state, ticks = found
    return (start is not None and ticks != start) or state in _EXITED_STATES


class QueueStore(Protocol):
    """The queue as the daemon uses it: what any backend must provide.

    SQLite implements it now; a PostgreSQL backend for sites that outgrow one
    host would implement the same methods with the same guarantees, and must
    pass tests/integration/test_store_contract.py. Each method runs inside a
    transaction its caller opened; dispatch methods are fenced on the lease
    epoch and raise LeaseLost when the fence fails.
    """

    # intake
    def intake(self, item: IntakeItem) -> IntakeResult: ...
    def record_audit(self, item: AuditItem) -> str: ...
    def set_ack_outcome(self, message_id: str, outcome: str) -> bool: ...
    # lease
    def lease(self) -> Lease | None: ...
    def queue_id(self) -> str | None: ...
    def try_acquire_lease(self, me: LeaseHolder, ttl: float) -> int | None: ...
    def renew_lease(self, holder: str, epoch: int, ttl: float) -> None: ...
    def release_lease(self, holder: str, epoch: int) -> bool: ...
    def recover_claimed(self, holder: str, epoch: int) -> int: ...
    # claim and settle
    def channel_head(self, channel: str) -> HeadRow | None: ...
    def claim(self, holder: str, epoch: int, message_id: str) -> bool: ...
    def mark_inflight(self, holder: str, epoch: int, message_id: str, from_state: str, attempts: int) -> int: ...
    def settle(
        self, holder: str, epoch: int, message_id: str, attempt: int, state: str, *,
        server_status: int | None, server_ack: str | None, app_ack: bytes | None = None,
        error_code: str | None = None, error_text: str | None = None,
    ) -> bool: ...
    def requeue(
        self, holder: str, epoch: int, message_id: str, attempt: int, next_attempt_at: float, *,
        server_status: int | None = None, error_code: str | None = None, error_text: str | None = None,
    ) -> bool: ...
    def fail_live(
        self, holder: str, epoch: int, message_id: str, attempt: int, state: str, *,
        error_code: str, error_text: str, app_ack: bytes | None = None,
    ) -> bool: ...
    # channels and stats
    def pause_channel(self, channel: str, reason: str) -> None: ...
    def resume_channel(self, channel: str) -> None: ...
    def paused_channels(self) -> set[str]: ...
    def stats(self, configured_channels: list[str] | None = None) -> dict[str, Any]: ...


class SqliteStore:
    """All queue reads and writes, on one connection owned by one thread."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        queries: dict[str, str],
        *,
        db_path: Path,
        dedupe_window: float = 7 * 86400,
        retention: float = 30 * 86400,
        max_db_bytes: int = 0,
        min_free_disk_bytes: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.conn = conn
        self.q = queries
        self.db_path = db_path
        self.dedupe_window = dedupe_window
        self.retention = retention
        self.max_db_bytes = max_db_bytes
        self.min_free_disk_bytes = min_free_disk_bytes
        self.clock = clock
        self._disk_free: int | None = None  # usable disk space at this batch's first intake
        self._batch_cost = 0  # bytes the intakes of this batch may have added
        self._page_size = 0
        self.refused_at = float("-inf")  # time.monotonic() of the last intake refused for room

    # -- transactions -------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[SqliteStore]:
        """BEGIN IMMEDIATE … COMMIT for single-shot callers."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise StorageError(f"cannot start a write transaction: {exc}") from exc
        self.begin_batch()
        try:
            yield self
        except BaseException:
            self._rollback()
            raise
        try:
            self.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StorageError(f"commit failed: {exc}") from exc

    def _rollback(self) -> None:
        try:
            self.conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # no transaction is active after some I/O errors

    def _one(self, name: str, **params: Any) -> sqlite3.Row | tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self.conn.execute(self.q[name], params).fetchone()
        return row

    # -- intake -------------------------------------------------------------

    def intake(self, item: IntakeItem) -> IntakeResult:
        """Queue a message, or find it is a duplicate (SPEC 4, dedupe)."""
        now = self.clock()
        sha = hashlib.sha256(item.body).hexdigest()
        key = {
            "channel": item.channel,
            "sending_app": item.sending_app,
            "sending_facility": item.sending_facility,
            "control_id": item.control_id,
        }
        prior = self._one("dedupe_lookup", now=now, **key) if item.control_id else None
        if prior is not None:
            prior_sha, prior_id, prior_mode, commit_ack, app_ack = prior
            if prior_sha == sha:
                state_row = self._one("replay_state", id=prior_id)
                state = state_row[0] if state_row else None
                if app_ack is None and state_row is not None:
                    app_ack = state_row[2]
                return IntakeResult(
                    outcome="duplicate",
                    message_id=prior_id,
                    ack_mode=prior_mode,
                    commit_ack=commit_ack,
                    app_ack=app_ack,
                    prior_state=state,
                )
            return IntakeResult(outcome="conflict", message_id=prior_id, ack_mode=item.ack_mode)
        if self.over_limits(now, self.intake_cost(len(item.body) + len(item.commit_ack or b""))):
            return IntakeResult(outcome="backpressure", message_id="", ack_mode=item.ack_mode)
        message_id = str(uuid.uuid4())
        seq_row = self._one("next_seq", channel=item.channel)
        assert seq_row is not None
        seq = int(seq_row[0])
        self.conn.execute(
            self.q["insert_message"],
            {
                "id": message_id,
                "channel": item.channel,
                "seq": seq,
                "state": "queued",
                "remote": item.remote,
                "sending_app": item.sending_app,
                "sending_facility": item.sending_facility,
                "control_id": item.control_id,
                "message_type": item.message_type,
                "encoding": item.encoding,
                "body": item.body,
                "body_sha256": sha,
                "ack_mode": item.ack_mode,
                "accept_ack_type": item.accept_ack_type,
                "application_ack_type": item.application_ack_type,
                "ack_sent": item.commit_ack,
                "ack_outcome": "pending",
                "error_code": None,
                "error_text": None,
                "now": item.received_at,
            },
        )
        if item.control_id:
            self.conn.execute(
                self.q["dedupe_upsert"],
                {
                    **key,
                    "body_sha256": sha,
                    "message_id": message_id,
                    "ack_mode": item.ack_mode,
                    "commit_ack": item.commit_ack,
                    "expires_at": now + self.dedupe_window,
                },
            )
        return IntakeResult(outcome="accepted", message_id=message_id, seq=seq, ack_mode=item.ack_mode)

    def record_audit(self, item: AuditItem) -> str:
        """Insert a ``nacked`` audit row; never counts as a dedupe prior.

        Audit rows are intake too: when purging cannot make room below the disk
        floor or at the size cap they are not kept (StorageError), so they never
        eat the reserve dispatch needs.
        """
        cost = self.intake_cost(len(item.body) + len(item.ack_sent or b""))
        if self.over_limits(self.clock(), cost):
            raise StorageError("audit row not kept: no room below the queue's disk and size limits")
        message_id = str(uuid.uuid4())
        self.conn.execute(
            self.q["insert_message"],
            {
                "id": message_id,
                "channel": item.channel,
                "seq": None,
                "state": "nacked",
                "remote": item.remote,
                "sending_app": item.sending_app,
                "sending_facility": item.sending_facility,
                "control_id": item.control_id,
                "message_type": item.message_type,
                "encoding": None,
                "body": item.body,
                "body_sha256": hashlib.sha256(item.body).hexdigest(),
                "ack_mode": "commit",
                "accept_ack_type": "",
                "application_ack_type": "",
                "ack_sent": item.ack_sent,
                "ack_outcome": "delivered" if item.ack_sent else "not_owed",
                "error_code": item.error_code,
                "error_text": item.error_text,
                "now": item.received_at,
            },
        )
        return message_id

    def set_ack_outcome(self, message_id: str, outcome: str) -> bool:
        if outcome not in states.ACK_OUTCOMES:
            raise ValueError(f"unknown ack_outcome {outcome!r}")
        cur = self.conn.execute(
            self.q["set_ack_outcome"], {"id": message_id, "outcome": outcome}
        )
        return cur.rowcount == 1

    def replay_state(self, message_id: str) -> tuple[str, str, bytes | None, int | None] | None:
        """(state, ack_outcome, app_ack, server_status) of a row, for ACK relay polling."""
        row = self._one("replay_state", id=message_id)
        if row is None:
            return None
        return (str(row[0]), str(row[1]), row[2], row[3])

    # -- backpressure and retention ------------------------------------------
    #
    # Intake (messages and audit rows) may only use the disk down to
    # ``min_free_disk_bytes``; everything below that floor is a reserve for
    # the writes that free space or must never stop: claim, inflight, settle,
    # lease, purges, vacuum, checkpoints. Free space is measured at the start
    # of every commit batch (``begin_batch``, not on a timer) and each intake
    # of the batch is charged its estimated size against it, so a burst can
    # overshoot the floor by at most one estimate's error.

    def begin_batch(self) -> None:
        """A commit batch starts (after BEGIN IMMEDIATE): the next intake measures the disk afresh."""
        self._disk_free = None
        self._batch_cost = 0

    def page_size(self) -> int:
        if not self._page_size:
            self._page_size = int(self.conn.execute("PRAGMA page_size").fetchone()[0])
        return self._page_size

    def intake_cost(self, nbytes: int) -> int:
        """Disk bytes one intake may take: its pages in the WAL and again in the file, plus the
        index, counter and dedupe pages it touches (a deliberate over-estimate)."""
        return 2 * nbytes + 12 * self.page_size()

    def used_bytes(self) -> int:
        """Database size without free pages (SPEC 6: size measured without free pages)."""
        page_count = self.conn.execute("PRAGMA page_count").fetchone()[0]
        return int((page_count - self.free_pages()) * self.page_size())

    def free_pages(self) -> int:
        """Pages inside the file that hold no data: new rows reuse them before the file grows."""
        return int(self.conn.execute("PRAGMA freelist_count").fetchone()[0])

    def free_disk_bytes(self) -> int:
        st = os.statvfs(self.db_path.parent)
        return int(st.f_bavail * st.f_frsize)

    def _usable_disk_bytes(self) -> int:
        """Free disk space minus what is already promised: the WAL regrows to its
        regular size (db.WAL_SIZE_LIMIT) after every truncation, and pages that
        so far live only in the WAL extend the file when they are checkpointed."""
        wal = _file_size(self.db_path.with_name(self.db_path.name + "-wal"))
        logical = int(self.conn.execute("PRAGMA page_count").fetchone()[0]) * self.page_size()
        pending = max(0, logical - _file_size(self.db_path))
        return self.free_disk_bytes() - max(0, WAL_SIZE_LIMIT - wal) - pending

    def _room_problem(self, cost: int) -> tuple[str, bool] | None:
        """Why ``cost`` more intake bytes do not fit now, and whether purging rows would help."""
        if self.max_db_bytes and self.used_bytes() + cost > self.max_db_bytes:
            return "the queue database is at queue.max_db_bytes", True
        floor = self.min_free_disk_bytes
        if not floor:
            return None
        if self._disk_free is None:
            self._disk_free = self._usable_disk_bytes()
        disk = self._disk_free - self._batch_cost - cost
        # Half the floor always stays really free on the disk: the WAL that
        # dispatch writes lives outside the file's free pages.
        if disk < floor // 2:
            return "free disk space is below queue.min_free_disk_bytes", False
        # The file's own free pages count as room: new rows reuse them first
        # (and a file with auto_vacuum hands them back to the filesystem).
        if disk + self.free_pages() * self.page_size() < floor:
            return "free disk space is below queue.min_free_disk_bytes", True
        return None

    def over_limits(self, now: float, cost: int = 0) -> bool:
        """SPEC 4 backpressure: purge what the limits allow first, then refuse.

        ``cost`` (see ``intake_cost``) is charged to this batch when it fits.
        """
        if not (self.max_db_bytes or self.min_free_disk_bytes):
            return False
        if self._room_problem(cost) is not None:
            self.make_room(now, cost)
            if self._room_problem(cost) is not None:
                self.refused_at = time.monotonic()
                return True
        self._batch_cost += cost
        return False

    def make_room(self, now: float, cost: int = 0, max_steps: int = 20) -> int:
        """Purge for room: what retention allows, then the oldest delivered rows first.

        Only ``processed``, ``rejected`` and ``nacked`` rows go (never live or
        ``failed`` ones), at most ``max_steps`` batches of 500 per call so one
        intake never holds the write lock for long; the next call goes on.
        """
        purged = self.purge_retention(now)
        for _ in range(max_steps):
            problem = self._room_problem(cost)
            if problem is None or not problem[1]:
                break
            step = self._one_purge_step_oldest()
            if step == 0:
                break
            purged += step
        return purged

    def pressure(self) -> str | None:
        """Why intake would refuse a message now (a fresh measurement), or None."""
        self.begin_batch()
        problem = self._room_problem(0)
        return problem[0] if problem else None

    def disk_tight(self) -> bool:
        """The disk alone, without the file's free pages, is below the floor: give those back."""
        return bool(self.min_free_disk_bytes and self._usable_disk_bytes() < self.min_free_disk_bytes)

    def _one_purge_step_oldest(self, limit: int = 500) -> int:
        """Size cap: the oldest purgeable terminal rows go first."""
        cur = self.conn.execute(self.q["purge_oldest_terminal"], {"limit": limit})
        return cur.rowcount

    def auto_vacuum(self) -> int:
        """The file's PRAGMA auto_vacuum (0 none, 2 incremental; see db._apply_pragmas)."""
        return int(self.conn.execute("PRAGMA auto_vacuum").fetchone()[0])

    def release_free_pages(self, keep: int = 0, limit: int = 2048) -> int:
        """Hand free pages beyond ``keep`` back to the filesystem, at most ``limit`` per call.

        Needs auto_vacuum = INCREMENTAL (files created since this version).
        The file itself shrinks at the next complete checkpoint. Returns the
        number of pages released.
        """
        if self.auto_vacuum() != 2:
            return 0
        count = min(self.free_pages() - keep, limit)
        if count <= 0:
            return 0
        before = self.free_pages()
        # Python's sqlite3 steps a statement without result columns only
        # once, and each step of incremental_vacuum releases one page.
        for _ in range(count):
            self.conn.execute("PRAGMA incremental_vacuum")
        return before - self.free_pages()

    def checkpoint(self, mode: str, wait: float = 0.1) -> tuple[int, int, int]:
        """``PRAGMA wal_checkpoint(mode)`` waiting at most ``wait`` s for locks: (busy, log, done).

        TRUNCATE takes the write lock for a moment: run a PASSIVE one first
        (it copies without blocking anybody) so little is left to copy while
        the lock is held, and give up rather than queue behind a writer.
        """
        if mode not in ("PASSIVE", "TRUNCATE"):
            raise ValueError(f"unknown checkpoint mode {mode!r}")
        if mode == "TRUNCATE":
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        previous = int(self.conn.execute("PRAGMA busy_timeout").fetchone()[0])
        self.conn.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
        try:
            row = self.conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {previous}")
        return int(row[0]), int(row[1]), int(row[2])

    def purge_retention(self, now: float, batch: int = 1000) -> int:
        """Delete purgeable terminal rows older than ``retention`` and expired dedupe keys.

        ``failed`` rows are never purged automatically: they are undelivered messages.
        """
        self.conn.execute(self.q["purge_expired_dedupe_keys"], {"now": now})
        cur = self.conn.execute(
            self.q["purge_terminal_older_than"], {"cutoff": now - self.retention, "limit": batch}
        )
        return cur.rowcount

    def enforce_size_cap(self) -> int:
        purged = 0
        while self.max_db_bytes and self.used_bytes() >= self.max_db_bytes:
            step = self._one_purge_step_oldest()
            if step == 0:
                break
            purged += step
        return purged

    def probe_write(self) -> None:
        """A tiny write: /readyz proves the database takes writes — and intake would accept."""
        self.conn.execute(self.q["probe_write"], {"now": repr(self.clock())})
        if self._room_problem(0) is not None:
            self.make_room(self.clock())
            problem = self._room_problem(0)
            if problem is not None:
                raise StorageError(f"backpressure: {problem[0]}")

    # -- lease ---------------------------------------------------------------

    def lease(self) -> Lease | None:
        row = self._one("lease_row")
        if row is None or row[0] is None:
            return None
        return Lease(holder=row[0], epoch=int(row[5]), expires_at=float(row[6] or 0))

    def try_acquire_lease(self, me: LeaseHolder, ttl: float) -> int | None:
        """Take the lease when free, expired, or its holder is provably dead."""
        now = self.clock()
        row = self._one("lease_row")
        assert row is not None
        holder, pid, boot, pidns, start, epoch, expires_at = row
        free = holder is None or expires_at is None or float(expires_at) <= now
        if not free and holder != me.holder and not holder_provably_dead(pid, boot, pidns, start):
            return None
        taken = self._one(
            "lease_take",
            holder=me.holder,
            pid=me.pid,
            boot=me.boot_id,
            pidns=me.pidns,
            start=me.start_ticks,
            expires_at=now + ttl,
            now=now,
            seen_epoch=epoch,
        )
        return int(taken[0]) if taken else None

    def queue_id(self) -> str | None:
        """The UUID this queue got when it was created (or first opened by this version)."""
        row = self._one("queue_id")
        return str(row[0]) if row is not None else None

    def renew_lease(self, holder: str, epoch: int, ttl: float) -> None:
        now = self.clock()
        cur = self.conn.execute(
            self.q["lease_renew"], {"holder": holder, "epoch": epoch, "expires_at": now + ttl, "now": now}
        )
        if cur.rowcount != 1:
            raise LeaseLost(f"lease epoch {epoch} is no longer held by {holder}")

    def release_lease(self, holder: str, epoch: int) -> bool:
        cur = self.conn.execute(self.q["lease_release"], {"holder": holder, "epoch": epoch})
        return cur.rowcount == 1

    def _fenced(self, name: str, holder: str, epoch: int, **params: Any) -> sqlite3.Cursor:
        return self.conn.execute(self.q[name], {"holder": holder, "epoch": epoch, **params})

    def _transition(self, name: str, holder: str, epoch: int, message_id: str, **params: Any) -> bool:
        """One fenced, guarded state change: True when the row moved.

        Zero rows means the guard did not match (another attempt, another
        state) — or the fence failed, which raises LeaseLost. An application
        ACK settled with the row is also kept with its dedupe key, for replay.
        """
        cur = self._fenced(name, holder, epoch, id=message_id, now=self.clock(), **params)
        if cur.rowcount == 0:
            self._check_fence(holder, epoch)
            return False
        app_ack = params.get("app_ack")
        if app_ack is not None:
            self.conn.execute(self.q["dedupe_set_app_ack"], {"message_id": message_id, "app_ack": app_ack})
        return True

    def _check_fence(self, holder: str, epoch: int) -> None:
        if self._one("lease_fence", holder=holder, epoch=epoch) is None:
            raise LeaseLost(f"lease epoch {epoch} is no longer held by {holder}")

    def recover_claimed(self, holder: str, epoch: int) -> int:
        """After taking the lease: claimed rows were provably not sent → queued."""
        cur = self._fenced("recover_claimed", holder, epoch, now=self.clock())
        self._check_fence(holder, epoch)
        return cur.rowcount

    # -- dispatch ------------------------------------------------------------

    def channel_head(self, channel: str) -> HeadRow | None:
        row = self._one("channel_head", channel=channel)
        if row is None:
            return None
        return HeadRow(*row)

    def live_channels(self) -> list[str]:
        return [r[0] for r in self.conn.execute(self.q["live_channels"])]

    def claim(self, holder: str, epoch: int, message_id: str) -> bool:
        return self._transition("claim", holder, epoch, message_id)

    def mark_inflight(self, holder: str, epoch: int, message_id: str, from_state: str, attempts: int) -> int:
        """Committed *before* the frame is written (SPEC 6). Returns the new attempt number."""
        row = self._fenced(
            "mark_inflight", holder, epoch, id=message_id, from_state=from_state, attempts=attempts,
            now=self.clock(),
        ).fetchone()
        if row is None:
            self._check_fence(holder, epoch)
            raise StorageError(f"row {message_id} was not {from_state} at attempt {attempts}")
        return int(row[0])

    def settle(
        self,
        holder: str,
        epoch: int,
        message_id: str,
        attempt: int,
        state: str,
        *,
        server_status: int | None,
        server_ack: str | None,
        app_ack: bytes | None = None,
        error_code: str | None = None,
        error_text: str | None = None,
    ) -> bool:
        """inflight → processed/rejected/failed for exactly this attempt."""
        if state not in states.SETTLED:
            raise ValueError(f"cannot settle into {state!r}")
        return self._transition(
            "settle", holder, epoch, message_id, attempt=attempt, state=state,
            server_status=server_status, server_ack=server_ack, app_ack=app_ack,
            error_code=error_code, error_text=error_text,
        )

    def requeue(
        self, holder: str, epoch: int, message_id: str, attempt: int, next_attempt_at: float,
        *, server_status: int | None = None, error_code: str | None = None, error_text: str | None = None,
    ) -> bool:
        """inflight/claimed → queued with a backoff; the row stays the channel head."""
        return self._transition(
            "requeue", holder, epoch, message_id, attempt=attempt, next_attempt_at=next_attempt_at,
            server_status=server_status, error_code=error_code, error_text=error_text,
        )

    def fail_live(
        self, holder: str, epoch: int, message_id: str, attempt: int, state: str,
        *, error_code: str, error_text: str, app_ack: bytes | None = None,
    ) -> bool:
        """A live row straight to failed/rejected (ambiguous inflight, too big, attempts exhausted)."""
        if state not in ("failed", "rejected"):
            raise ValueError(f"fail_live cannot set {state!r}")
        return self._transition(
            "fail_live", holder, epoch, message_id, attempt=attempt, state=state,
            error_code=error_code, error_text=error_text, app_ack=app_ack,
        )

    # -- channels ------------------------------------------------------------

    def pause_channel(self, channel: str, reason: str) -> None:
        self.conn.execute(self.q["channel_pause"], {"channel": channel, "now": self.clock(), "reason": reason})

    def resume_channel(self, channel: str) -> None:
        self.conn.execute(self.q["channel_resume"], {"channel": channel})

    def paused_channels(self) -> set[str]:
        return {r[0] for r in self.conn.execute(self.q["channel_flags"]) if r[2]}

    # -- reads ---------------------------------------------------------------

    def message(self, message_id: str) -> dict[str, Any] | None:
        cur = self.conn.execute(self.q["message_by_id"], {"id": message_id})
        row = cur.fetchone()
        if row is None:
            return None
        return {d[0]: v for d, v in zip(cur.description, row, strict=True)}

    def stats(self, configured_channels: list[str] | None = None) -> dict[str, Any]:
        """The ``queue stats --json`` object (SPEC 2)."""
        now = self.clock()
        by_state = {s: 0 for s in states.ALL}
        for state, n in self.conn.execute(self.q["count_by_state"]):
            by_state[state] = int(n)
        channels: dict[str, dict[str, Any]] = {}

        def channel_entry(name: str) -> dict[str, Any]:
            return channels.setdefault(
                name,
                {"queued": 0, "claimed": 0, "inflight": 0, "oldest_queued_age_s": None, "paused": False},
            )

        for name in configured_channels or []:
            channel_entry(name)
        for name, _last_seq, paused, _at, _reason in self.conn.execute(self.q["channel_flags"]):
            channel_entry(name)["paused"] = bool(paused)
        for name, state, n, oldest in self.conn.execute(self.q["live_by_channel"]):
            entry = channel_entry(name)
            entry[state] = int(n)
            if oldest is not None:
                entry["oldest_queued_age_s"] = round(max(0.0, now - float(oldest)), 3)
        row = self._one("lease_row")
        lease_obj = None
        if row is not None and row[0] is not None and row[6] is not None and float(row[6]) > now:
            holder, pid, boot, pidns, start, epoch, expires_at = row
            # SPEC 2: null while no process holds it — a holder provably dead
            # (kill -9 on this host) holds nothing, whatever its expiry says.
            if not holder_provably_dead(pid, boot, pidns, start):
                lease_obj = {"holder": holder, "epoch": int(epoch), "expires_at": rfc3339(float(expires_at))}
        return {
            "states": by_state,
            "channels": dict(sorted(channels.items())),
            "lease": lease_obj,
            "db": {
                "path": str(self.db_path),
                "size_bytes": _file_size(self.db_path),
                "wal_bytes": _file_size(self.db_path.with_name(self.db_path.name + "-wal")),
            },
        }


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0




def _implements_the_interface(store: SqliteStore) -> QueueStore:
    """mypy checks here that SqliteStore satisfies QueueStore."""
    return store
