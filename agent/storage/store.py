"""The SQLite queue: the one place that runs the queue's SQL (docs/queue.md).

``SqliteStore`` is assembled from parts split by concern, sharing one base
(agent/storage/store_base.py): intake (store_intake.py), dispatch and the
lease (store_dispatch.py), stats and the operator's queries
(store_operator.py); maintenance (retention, room, the WAL) is
agent/storage/maintenance.py, process liveness agent/storage/liveness.py.
Every query is a named method; rows come back as frozen dataclasses
(agent/storage/rows.py), never positional tuples.

Methods run *inside* a transaction their caller opened — the writer thread
groups many of them into one commit (each in its own SAVEPOINT), and
``store.transaction()`` is there for single-shot callers (operator commands,
tests). Every state transition is a guarded UPDATE named after its event in
agent/core/states.py, whose row count is checked; every dispatch write is
fenced on the lease epoch, so a process that lost the lease cannot change a
row even before it notices.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from agent.errors import DatabaseLocked, StorageError
from agent.storage import sqlite as db
from agent.storage.liveness import LeaseHolder, holder_provably_dead
from agent.storage.maintenance import FREE_PAGE_SLACK
from agent.storage.rows import (
    AckMode,
    AuditItem,
    ChannelActivity,
    HeadRow,
    IntakeItem,
    IntakeOutcome,
    IntakeResult,
    Lease,
    OperatorAction,
    RecentFailure,
)
from agent.storage.store_intake import IntakeQueries
from agent.storage.store_operator import OperatorQueries

__all__ = [
    "FREE_PAGE_SLACK",
    "AckMode",
    "AuditItem",
    "HeadRow",
    "IntakeItem",
    "IntakeOutcome",
    "IntakeResult",
    "Lease",
    "LeaseHolder",
    "QueueConfig",
    "QueueStore",
    "SqliteStore",
    "db_options",
    "holder_provably_dead",
    "make_store",
    "open_operator_store",
]


class SqliteStore(IntakeQueries, OperatorQueries):
    """All queue reads and writes, on one connection owned by one thread."""


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
    def intake_batch(self, items: Sequence[IntakeItem]) -> list[IntakeResult]: ...
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
        server_reason: str | None = None,
    ) -> bool: ...
    def requeue(
        self, holder: str, epoch: int, message_id: str, attempt: int, next_attempt_at: float, *,
        server_status: int | None = None, error_code: str | None = None, error_text: str | None = None,
        server_reason: str | None = None,
    ) -> bool: ...
    def fail_live(
        self, holder: str, epoch: int, message_id: str, attempt: int, state: str, *,
        error_code: str, error_text: str, app_ack: bytes | None = None,
        server_reason: str | None = None,
    ) -> bool: ...
    # channels, relay and stats
    def pause_channel(self, channel: str, reason: str) -> None: ...
    def resume_channel(self, channel: str) -> None: ...
    def paused_channels(self) -> set[str]: ...
    def settled_app_acks(self, ids: Sequence[str]) -> dict[str, bytes]: ...
    def recent_failures(self, limit: int) -> list[RecentFailure]: ...
    # the operator's audit trail
    def take_operator_actions(self, stale_before: float) -> list[OperatorAction]: ...
    def probe_write(self) -> None: ...
    def stats(self, configured_channels: list[str] | None = None) -> dict[str, Any]: ...
    # the status page
    def channel_activity(self, channels: Sequence[str]) -> list[ChannelActivity]: ...
    def live_depth(self) -> int: ...
    def server_acks(self, ids: Sequence[str]) -> dict[str, str]: ...


def _implements_the_interface(store: SqliteStore) -> QueueStore:
    """mypy checks here that SqliteStore satisfies QueueStore."""
    return store


# -- opening a store ---------------------------------------------------------------


class QueueConfig(Protocol):
    """The ``[queue]`` settings a store needs (agent.app.config's QueueSettings has them)."""

    @property
    def synchronous(self) -> str: ...
    @property
    def busy_timeout(self) -> float: ...
    @property
    def dedupe_window(self) -> float: ...
    @property
    def retention(self) -> float: ...
    @property
    def max_db_bytes(self) -> int: ...
    @property
    def min_free_disk_bytes(self) -> int: ...


def db_options(queue: QueueConfig) -> db.DatabaseOptions:
    return db.DatabaseOptions(synchronous=queue.synchronous, busy_timeout=queue.busy_timeout)


def make_store(conn: Any, db_path: Path, queue: QueueConfig,  # noqa: ANN401 - the dialect's connection
               clock: Callable[[], float] = time.time) -> SqliteStore:
    """A store on ``conn`` with the limits of ``[queue]``."""
    return SqliteStore(
        conn,
        db.load_queries(),
        db_path=db_path,
        dedupe_window=queue.dedupe_window,
        retention=queue.retention,
        max_db_bytes=queue.max_db_bytes,
        min_free_disk_bytes=queue.min_free_disk_bytes,
        clock=clock,
    )


@contextmanager
def open_operator_store(db_path: Path, queue: QueueConfig, agent_id: str, *,
                        write: bool) -> Iterator[SqliteStore]:
    """The queue database at ``db_path`` for an operator command: never created.

    ``write=False`` sets the connection read-only (SQLite's ``query_only``) so
    a read command cannot change the file even by a bug. ``write=True`` checks
    the file belongs to ``agent_id`` first (two agents never share a queue).
    A file of an older schema (its daemon not upgraded yet) is brought up to
    this one by a write command — the same additive migration the daemon runs
    at start, which the older daemon keeps working with — and refused by a
    read command with a line saying so. Driver errors become StorageError;
    ``DatabaseLocked`` when the lock was held beyond ``busy_timeout``.
    """
    dialect = db.SqliteDialect()
    try:
        conn = db.open_existing(db_path, db_options(queue))
    except dialect.Error as exc:
        if dialect.is_locked(exc):
            raise DatabaseLocked(f"database is locked: {exc}") from exc
        raise StorageError(f"cannot open queue database {db_path}: {exc}") from exc
    try:
        store = make_store(conn, db_path, queue)
        version = int(db.read_meta(conn).get("schema_version", "0"))
        if write:
            db.check_owner(conn, db_path, agent_id)
            if version < db.SCHEMA_VERSION:
                db.migrate(conn, agent_id, time.time())
        else:
            if version < db.SCHEMA_VERSION:
                raise StorageError(
                    f"the queue database {db_path} has schema {version}, this hl7-agent reads schema "
                    f"{db.SCHEMA_VERSION}: start this version's daemon once (it upgrades the file in "
                    "place; an older daemon keeps working on it), then try again"
                )
            dialect.read_only(conn)
        yield store
    except dialect.Error as exc:
        raise dialect.storage_error(exc, "queue database error: ") from exc
    finally:
        conn.close()
