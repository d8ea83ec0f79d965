"""The queue: the one place that runs the queue's SQL (docs/queue.md), on SQLite or PostgreSQL.

``Store`` is assembled from parts split by concern, sharing one base
(agent/storage/store_base.py): intake (store_intake.py), dispatch and the
lease (store_dispatch.py), stats and the operator's queries
(store_operator.py); maintenance (retention, room, the WAL) is
agent/storage/maintenance.py, process liveness agent/storage/liveness.py.
Every query is a named method; rows come back as frozen dataclasses
(agent/storage/rows.py), never positional tuples. The same class runs on
both backends: what differs is its dialect (agent/storage/sqlite.py,
agent/storage/postgres.py) and the dialect's SQL (``queue/<dialect>/``, the
same query names).

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
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from agent.errors import ConfigError, DatabaseLocked, DatabaseUnavailable, StorageError
from agent.storage import sqlite as db
from agent.storage.dialect import Dialect
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
from agent.storage.sql import load_queries
from agent.storage.store_intake import IntakeQueries
from agent.storage.store_operator import OperatorQueries

log = structlog.get_logger(__name__)

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
    "Store",
    "db_options",
    "holder_provably_dead",
    "make_store",
    "open_operator_store",
    "open_stores",
]

if TYPE_CHECKING:
    from agent.storage.postgres import PgOptions


class Store(IntakeQueries, OperatorQueries):
    """All queue reads and writes, on one connection owned by one thread, on either backend."""


#: The name the rest of the agent has used since before the second backend:
#: the same class (``await writer.call(SqliteStore.claim, …)`` runs on PostgreSQL too).
SqliteStore = Store


class QueueStore(Protocol):
    """The queue as the daemon uses it: what any backend must provide.

    ``Store`` implements it on both backends, and passes
    tests/integration/test_store_contract.py against SQLite and a real
    PostgreSQL server alike. Each method runs inside a
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
    def channel_head_and_pause(self, channel: str) -> tuple[HeadRow | None, bool]: ...
    def claim(self, holder: str, epoch: int, message_id: str) -> bool: ...
    def claim_and_send(self, holder: str, epoch: int, message_id: str, attempts: int) -> int | None: ...
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
    def resume_channel(self, channel: str) -> int: ...
    def paused_channels(self) -> set[str]: ...
    def settled_app_acks(self, ids: Sequence[str]) -> dict[str, bytes]: ...
    def recent_failures(self, limit: int) -> list[RecentFailure]: ...
    # the operator's audit trail
    def take_operator_actions(self, stale_before: float) -> list[OperatorAction]: ...
    def probe_write(self) -> None: ...
    def stats(self, configured_channels: list[str] | None = None,
              partitioned: Collection[str] | None = None) -> dict[str, Any]: ...
    def record_outbound(self, channel: str, state_json: str) -> None: ...
    # the status page
    def channel_activity(self, channels: Sequence[str]) -> list[ChannelActivity]: ...
    def live_depth(self) -> int: ...
    def server_acks(self, ids: Sequence[str]) -> dict[str, str]: ...


def _implements_the_interface(store: Store) -> QueueStore:
    """mypy checks here that Store satisfies QueueStore."""
    return store


# -- opening a store ---------------------------------------------------------------


class QueueConfig(Protocol):
    """The ``[queue]`` settings a store needs (agent.app.config's QueueSettings has them)."""

    @property
    def backend(self) -> str: ...
    @property
    def dsn(self) -> str | None: ...
    @property
    def password_file(self) -> Path | None: ...
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


POSTGRESQL = "postgresql"


def db_options(queue: QueueConfig) -> db.DatabaseOptions:
    return db.DatabaseOptions(synchronous=queue.synchronous, busy_timeout=queue.busy_timeout)


def pg_options(queue: QueueConfig, agent_id: str) -> PgOptions:
    """The PostgreSQL connection settings of ``[queue]``; ConfigError when psycopg is missing."""
    try:
        from agent.storage.postgres import PgOptions
    except ImportError as exc:
        raise ConfigError(
            'config error: queue.backend = "postgresql" needs psycopg, which is not installed: '
            "pip install 'hl7-agent[postgresql]'"
        ) from exc
    return PgOptions(dsn=queue.dsn or "", password_file=queue.password_file,
                     busy_timeout=queue.busy_timeout, agent_id=agent_id)


def make_store(conn: Any, db_path: Path, queue: QueueConfig,  # noqa: ANN401 - the dialect's connection
               clock: Callable[[], float] = time.time, dialect: Dialect | None = None) -> Store:
    """A store on ``conn`` with the limits of ``[queue]`` (a database server has none of ours)."""
    on_server = dialect is not None and not dialect.file_maintenance
    return Store(
        conn,
        db.load_queries() if dialect is None else load_queries(dialect.name),
        db_path=db_path,
        dedupe_window=queue.dedupe_window,
        retention=queue.retention,
        max_db_bytes=0 if on_server else queue.max_db_bytes,
        min_free_disk_bytes=0 if on_server else queue.min_free_disk_bytes,
        clock=clock,
        dialect=dialect,
    )


def open_stores(db_path: Path, queue: QueueConfig, agent_id: str, now: float) -> tuple[Store, Store]:
    """The daemon's two stores, for the writer and the reader thread; the database migrated first.

    SQLite: the file at ``db_path``, created when missing. PostgreSQL: the
    database of ``queue.dsn`` (several processes may start at once: the
    first migrates, under an advisory lock); one that cannot be reached now
    is connected and migrated on first use instead.
    """
    if queue.backend == POSTGRESQL:
        from agent.storage import postgres

        # No queue file, but the state directory still holds the hand-over sockets.
        db.make_private_dir(db_path.parent)
        options = pg_options(queue, agent_id)
        writer_dialect = postgres.PostgresDialect(options, role="writer")
        reader_dialect = postgres.PostgresDialect(options, role="reader")
        # A database away at start is waited out like one lost later (docs/ha.md):
        # the daemon starts, intake answers "resend later", and the writer's
        # first connection migrates. Another agent's database still stops it.
        conn: postgres.PgConnection | None
        reader_conn: postgres.PgConnection | None = None
        try:
            conn = postgres.open_database(writer_dialect, agent_id, now)
        except DatabaseUnavailable as exc:
            writer_dialect.open_later(exc, agent_id)
            reader_dialect.open_later(exc)
            conn = None
            log.warning("queue_database_unavailable_at_start", dsn=writer_dialect.display_dsn, error=str(exc),
                        hint="starting anyway: intake answers AR 207 (resend later) until the database "
                             "takes writes; nothing is accepted meanwhile")
        if conn is not None:
            try:
                reader_conn = reader_dialect.connect()
            except DatabaseUnavailable as exc:
                reader_dialect.open_later(exc)  # the writer is connected: the reader retries on its own
            except BaseException:
                conn.close()
                raise
        return (make_store(conn, db_path, queue, dialect=writer_dialect),
                make_store(reader_conn, db_path, queue, dialect=reader_dialect))
    sqlite_options = db_options(queue)
    writer_conn = db.open_database(db_path, agent_id, sqlite_options, now)
    try:
        reader = db.connect(db_path, sqlite_options, create=False)
    except BaseException:
        writer_conn.close()
        raise
    return make_store(writer_conn, db_path, queue), make_store(reader, db_path, queue)


@contextmanager
def open_operator_store(db_path: Path, queue: QueueConfig, agent_id: str, *,
                        write: bool) -> Iterator[Store]:
    """The queue database at ``db_path`` (or ``queue.dsn``) for an operator command: never created.

    ``write=False`` sets the connection read-only (SQLite's ``query_only``,
    PostgreSQL's ``default_transaction_read_only``) so a read command cannot
    change the database even by a bug. ``write=True`` checks the database
    belongs to ``agent_id`` first (two agents never share a queue).
    A database of an older schema (its daemon not upgraded yet) is brought up
    to this one by a write command — the same additive migration the daemon
    runs at start, which the older daemon keeps working with — and refused by
    a read command with a line saying so. Driver errors become StorageError;
    ``DatabaseLocked`` when the lock was held beyond ``busy_timeout``.
    """
    if queue.backend == POSTGRESQL:
        with _open_pg_operator_store(db_path, queue, agent_id, write=write) as store:
            yield store
        return
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


@contextmanager
def _open_pg_operator_store(db_path: Path, queue: QueueConfig, agent_id: str, *,
                            write: bool) -> Iterator[Store]:
    from agent.storage import postgres

    dialect = postgres.PostgresDialect(pg_options(queue, agent_id), role="operator")
    store = make_store(postgres.open_existing(dialect), db_path, queue, dialect=dialect)
    try:
        version = int(store.meta().get("schema_version", "0"))
        if write:
            postgres.check_owner(store.conn, dialect, agent_id)
            if version < postgres.SCHEMA_VERSION:
                postgres.migrate(dialect, store.conn, agent_id, time.time())
        else:
            if version < postgres.SCHEMA_VERSION:
                raise StorageError(
                    f"the queue database {dialect.display_dsn} has schema {version}, this hl7-agent "
                    f"reads schema {postgres.SCHEMA_VERSION}: start this version's daemon once (it "
                    "upgrades the database in place; an older daemon keeps working on it), then try again"
                )
            dialect.read_only(store.conn)
        yield store
    except dialect.Error as exc:
        raise dialect.storage_error(exc, "queue database error: ") from exc
    finally:
        store.close()
