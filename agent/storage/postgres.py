"""The PostgreSQL side of the queue: several hosts share one database (docs/ha.md).

What differs from SQLite sits in :class:`PostgresDialect`; everything else —
dedupe, seq, the fenced transitions, stats — is the same store code
(agent/storage/store_base.py), running this dialect's named queries
(``queue/postgresql/``, the same names as SQLite's).

- **One writer at a time, as SQLite's BEGIN IMMEDIATE:** every write
  transaction begins with one transaction-scoped advisory lock. All of the
  agent's writes, on every host, are serialised by it: a dedupe check and its
  insert, a lease takeover and a fenced settle can never interleave, and two
  transactions of the agent can never deadlock. ``seq`` is taken from the
  channel's counter row in the insert's transaction, so seq order is commit
  order across hosts. Reads (the dispatcher's head polls, stats) take no lock.
- **Durability:** ``synchronous_commit`` is at least ``on`` on every session
  (set when weaker, then read back): an accept ACK follows PostgreSQL's
  commit, including a synchronous standby's flush where the server has one.
- **Nothing frozen stalls the others:** each session sets
  ``idle_in_transaction_session_timeout`` (the server ends the transaction
  of a process stopped or cut off in the middle of it, and with it the
  lock), ``lock_timeout`` (``queue.busy_timeout``: a wait for that lock ends
  in "resend later", never a hang), ``statement_timeout``, TCP keepalives and
  ``tcp_user_timeout`` (a dead server or network is noticed) and
  ``application_name`` (``pg_stat_activity`` shows which agent process it is).
- **The lease runs on the database's clock** (``clock_timestamp()``), so the
  hosts' clocks need not agree.
- **A server that froze is noticed too:** one that keeps the TCP connection
  but answers nothing (SIGSTOP, a paused VM) fires none of the server-side
  timeouts, so each write transaction and each read of the daemon runs under
  a client-side deadline (agent/storage/call_guard.py) that drops the
  connection: then as a lost one.
- **A lost connection is opened again** before the next transaction, spaced
  out with backoff while the server is away; until then every write fails at
  once (intake answers "resend later", ``/readyz`` is not ready). A database
  that cannot be reached when the daemon starts is the same case: the daemon
  starts without it, and the writer's first connection migrates
  (:meth:`PostgresDialect.open_later`).

One module of about 500 lines: the dialect's session settings, its error
mapping, reconnecting and the migration lock all act on the same
connection, and split apart each would need the others' internals.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import structlog
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from agent.core.retry import backoff
from agent.errors import DatabaseLocked, DatabaseUnavailable, IncompatibleDatabase, StorageError
from agent.storage import schema
from agent.storage.call_guard import CallGuard
from agent.storage.conninfo import mask_dsn
from agent.storage.dialect import Failure, TransactionBlocks
from agent.storage.sql import POSTGRESQL, load_migrations, load_queries

__all__ = [
    "MIN_COMPATIBLE_VERSION",
    "SCHEMA_VERSION",
    "PgConnection",
    "PgOptions",
    "PostgresDialect",
    "check_owner",
    "migrate",
    "open_database",
    "open_existing",
]

log = structlog.get_logger(__name__)

PgConnection = psycopg.Connection[Any]

#: The schema this code writes (queue/postgresql/migrations); versioned like SQLite's.
SCHEMA_VERSION = 4
MIN_COMPATIBLE_VERSION = 1

#: The agent's advisory lock (pg_advisory_xact_lock(int, int)): "HL7" and the write lock.
LOCK_CLASS = 0x484C37
WRITE_LOCK = 1

#: The server ends a transaction of ours that waits this long for its client
#: (the process was stopped or cut off in the middle of it): its locks go with it.
IDLE_IN_TRANSACTION_TIMEOUT = 5.0
#: No statement of the agent's runs longer (its writes are small and batched).
STATEMENT_TIMEOUT = 30.0
#: libpq parameters the agent sets unless the dsn sets them itself (libpq 34.1.2):
#: a connection attempt gives up after 5 s; an idle connection to a dead peer is
#: noticed within about 25 s (keepalives), one with unacknowledged data within 15 s.
CONNECTION_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "15000",
}
#: A write transaction may wait busy_timeout for the write lock; this much more and the
#: server is taken for frozen (agent/storage/call_guard.py). A read gets READ_DEADLINE.
WRITE_DEADLINE_SLACK = 5.0
READ_DEADLINE = 10.0
#: synchronous_commit values at least as strong as "on" (the others are weaker).
_DURABLE = frozenset({"on", "remote_apply"})
#: Reconnection after a lost connection: at once, then spaced out up to the cap (so writes
#: resume within about 2 s of the server's return; each attempt is bounded by connect_timeout).
RECONNECT_INITIAL = 0.25
RECONNECT_CAP = 2.0

_SQLSTATE_FAILURES = {
    "25006": Failure.READ_ONLY,  # read_only_sql_transaction: a standby, default_transaction_read_only
    "25P03": Failure.CONNECTION_LOST,  # idle_in_transaction_session_timeout: the server ended it
    "40001": Failure.LOCKED,  # serialization_failure
    "40P01": Failure.LOCKED,  # deadlock_detected
    "55P03": Failure.LOCKED,  # lock_not_available: lock_timeout
    "53100": Failure.DISK_FULL,  # disk_full (the server's)
    "57P01": Failure.CONNECTION_LOST,  # admin_shutdown
    "57P02": Failure.CONNECTION_LOST,  # crash_shutdown
    "57P03": Failure.CONNECTION_LOST,  # cannot_connect_now (starting up, recovering)
}


@dataclass(frozen=True)
class PgOptions:
    """How to reach the database: ``[queue]`` dsn, password_file, busy_timeout, and who we are."""

    dsn: str
    password_file: Path | None = None
    busy_timeout: float = 5.0
    agent_id: str = "hl7-agent"


def _one_line(exc: BaseException) -> str:
    return re.sub(r"\s+", " ", str(exc)).strip()


class PostgresDialect(TransactionBlocks):
    """What is PostgreSQL-specific about running the queue (see the module docstring).

    One instance per connection (the writer's, the reader's, an operator
    command's): it knows how to open that connection again.
    """

    name = POSTGRESQL
    Error = psycopg.Error
    row_factory = staticmethod(dict_row)  # a function: not bound to the dialect instance
    file_maintenance = False

    def __init__(self, options: PgOptions, *, role: str,
                 lease_skew: Callable[[], float] | None = None) -> None:
        self.options = options
        self.role = role
        #: Tests only: seconds added to the database clock (a test moves time, never waits).
        self._lease_skew = lease_skew
        self.display_dsn = mask_dsn(options.dsn)
        self._commits = 0
        self._read_only = False
        self._drop = False  # the connection answered "read-only" or "gone": open it again
        self._delays = backoff(RECONNECT_INITIAL, 2.0, RECONNECT_CAP)
        self._retry_at = 0.0
        self._last_error = ""
        #: The agent id to migrate the schema for on the next connection (open_later), else None.
        self._migrate_for: str | None = None
        self.guard = CallGuard(role, on_trip=self._unresponsive)

    # -- connections -----------------------------------------------------------

    def connect(self) -> PgConnection:
        """A new autocommit connection with the agent's session settings, checked."""
        params: dict[str, Any] = conninfo_to_dict(self.options.dsn)
        for key, value in CONNECTION_DEFAULTS.items():
            params.setdefault(key, value)
        params.setdefault("application_name", f"hl7-agent {self.options.agent_id} {self.role}")
        if self.options.password_file is not None:
            params["password"] = _read_password(self.options.password_file)
        try:
            conn = psycopg.connect(**params, autocommit=True)
        except psycopg.Error as exc:
            # libpq gives no SQLSTATE before a session exists: a server that is
            # down, starting, or refusing this password all look alike here.
            raise DatabaseUnavailable(f"cannot connect to the queue database {self.display_dsn}: "
                                      f"{_one_line(exc)}") from exc
        try:
            self._configure(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _configure(self, conn: PgConnection) -> None:
        where = f"the queue database {self.display_dsn}"
        try:
            for name, value in (
                ("lock_timeout", f"{int(self.options.busy_timeout * 1000)}ms"),
                ("idle_in_transaction_session_timeout", f"{int(IDLE_IN_TRANSACTION_TIMEOUT * 1000)}ms"),
                ("statement_timeout", f"{int(STATEMENT_TIMEOUT * 1000)}ms"),
                # The one lock decides the order of writes; a stricter default
                # would only add serialization failures.
                ("default_transaction_isolation", "read committed"),
            ):
                conn.execute("SELECT set_config(%s, %s, false)", (name, value))
            if _show(conn, "synchronous_commit") not in _DURABLE:
                conn.execute("SELECT set_config('synchronous_commit', 'on', false)")
            durable = _show(conn, "synchronous_commit")
            writable = _show(conn, "transaction_read_only") == "off"
        except psycopg.Error as exc:
            raise DatabaseUnavailable(f"cannot set up a session on {where}: {_one_line(exc)}") from exc
        if durable not in _DURABLE:
            raise StorageError(f"{where} keeps synchronous_commit = {durable}; the agent needs on")
        if self.role == "writer" and not writable:
            # A standby now may be the primary after a failover: "read-only" is waited out.
            raise DatabaseUnavailable(f"{where} takes no writes (a standby, or default_transaction_read_only); "
                                      "point queue.dsn at the primary")

    def connection_usable(self, conn: PgConnection | None) -> bool:
        return not (conn is None or self._drop or conn.closed or conn.broken)

    def open_later(self, error: StorageError, agent_id: str | None = None) -> None:
        """The database could not be reached at start (``error``): connect on first use, retried with backoff.

        ``agent_id``: the writer's — its first connection migrates the schema
        and checks the owner, as a start would have. The store holds no
        connection (None) until then; every write fails at once with
        "queue database unavailable", as after a lost connection.
        """
        self._migrate_for = agent_id
        self._last_error = _one_line(error)
        self._retry_at = time.monotonic() + next(self._delays)

    def reconnect(self, conn: PgConnection | None) -> PgConnection:
        """A new connection for a lost one (None: never opened); StorageError at once while the backoff runs."""
        now = time.monotonic()
        if now < self._retry_at:
            raise StorageError(f"queue database unavailable ({self._last_error}); "
                               f"next connection attempt in {self._retry_at - now:.1f}s")
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass
        try:
            fresh = self.connect()
            if self._read_only:
                self.read_only(fresh)
            if self._migrate_for is not None:
                self._migrate_first(fresh, self._migrate_for)
        except (StorageError, IncompatibleDatabase, psycopg.Error) as exc:
            self._last_error = _one_line(exc)
            self._retry_at = time.monotonic() + next(self._delays)
            if isinstance(exc, IncompatibleDatabase):
                # Not the server's absence: the operator must act (check --config).
                log.error("queue_database_refused", role=self.role, error=self._last_error)
                raise StorageError(self._last_error) from exc
            log.warning("queue_database_unavailable", role=self.role, error=self._last_error)
            raise exc if isinstance(exc, StorageError) else StorageError(self._last_error) from exc
        self._drop = False
        self._retry_at = 0.0
        self._delays = backoff(RECONNECT_INITIAL, 2.0, RECONNECT_CAP)
        log.info("queue_database_reconnected", role=self.role)
        return fresh

    def _migrate_first(self, conn: PgConnection, agent_id: str) -> None:
        """The migration a start would have run, on the first connection after open_later."""
        try:
            migrate(self, conn, agent_id, time.time())
        except BaseException:
            conn.close()
            raise
        self._migrate_for = None
        log.info("queue_database_migrated", role=self.role, dsn=self.display_dsn)

    # -- transactions ----------------------------------------------------------

    def _unresponsive(self, seconds: float) -> None:
        """The guard dropped the connection: the next attempt after the backoff, not at once.

        A frozen server takes each new connection too and answers nothing
        until ``connect_timeout``: meanwhile every write fails at once.
        """
        self._drop = True
        self._last_error = f"the server did not answer within {seconds:g}s"
        self._retry_at = time.monotonic() + next(self._delays)

    def guarded(self, conn: PgConnection | None) -> AbstractContextManager[None]:
        """A read on ``conn`` under READ_DEADLINE (a frozen server: see the module docstring)."""
        if not self.connection_usable(conn):
            return nullcontext()
        assert conn is not None
        return self.guard.around(conn.pgconn.socket, READ_DEADLINE)

    def begin_write(self, conn: PgConnection) -> None:
        """BEGIN and the agent's write lock, in one round trip (see the module docstring).

        The transaction runs under a deadline until COMMIT or ROLLBACK
        returns: ``busy_timeout`` for the lock, WRITE_DEADLINE_SLACK more.
        """
        self.guard.arm(conn.pgconn.socket, self.options.busy_timeout + WRITE_DEADLINE_SLACK)
        try:
            conn.execute(f"BEGIN; SELECT pg_advisory_xact_lock({LOCK_CLASS}, {WRITE_LOCK})")
        except BaseException:
            self.rollback(conn)  # e.g. lock_timeout: the transaction stands failed
            raise
        if conn.info.transaction_status != pq.TransactionStatus.INTRANS:
            self.rollback(conn)
            raise psycopg.OperationalError("BEGIN did not start a transaction")

    def commit(self, conn: PgConnection) -> None:
        """COMMIT, refusing to report a transaction that had failed as committed.

        PostgreSQL answers COMMIT of a failed transaction with ROLLBACK and no
        error: an accept ACK must never follow that.
        """
        if conn.info.transaction_status == pq.TransactionStatus.INERROR:
            self.rollback(conn)
            raise psycopg.errors.InFailedSqlTransaction("the transaction had failed; it was rolled back")
        try:
            cur = conn.execute("COMMIT")
        finally:
            self.guard.disarm()
        if cur.statusmessage != "COMMIT":
            raise psycopg.errors.InFailedSqlTransaction(f"COMMIT answered {cur.statusmessage}")
        self._commits += 1

    def rollback(self, conn: PgConnection) -> None:
        """Roll back if a transaction is open; never raises."""
        try:
            if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                conn.execute("ROLLBACK")
        except psycopg.Error:
            pass
        finally:
            self.guard.disarm()

    def savepoint(self, conn: PgConnection, name: str) -> None:
        conn.execute(f"SAVEPOINT {name}")

    def release(self, conn: PgConnection, name: str) -> None:
        conn.execute(f"RELEASE SAVEPOINT {name}")

    def rollback_to(self, conn: PgConnection, name: str) -> None:
        """Undo a savepoint's work and drop it; never raises."""
        try:
            conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
            conn.execute(f"RELEASE SAVEPOINT {name}")
        except psycopg.Error:
            pass

    def read_only(self, conn: PgConnection) -> None:
        """Make ``conn`` refuse every write, even one a bug would issue (kept across reconnects)."""
        self._read_only = True
        conn.execute("SELECT set_config('default_transaction_read_only', 'on', false)")

    def in_transaction(self, conn: PgConnection) -> bool:
        return not conn.closed and conn.info.transaction_status in (
            pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    def changes(self, conn: PgConnection) -> int:
        """Commits so far (the server does its own checkpoints: nothing waits on this)."""
        return self._commits

    # -- clock, values, errors, stats --------------------------------------------

    def lease_now(self, conn: PgConnection, clock: Callable[[], float]) -> float:
        """The database server's clock: every host measures the lease on the same one."""
        found = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert found is not None
        return float(found[0]) + (self._lease_skew() if self._lease_skew is not None else 0.0)

    def blob(self, value: bytes | memoryview) -> bytes:
        return bytes(value)

    def classify(self, exc: BaseException) -> Failure:
        """What a driver error means, by its SQLSTATE (never by its text).

        Read-only and connection-lost answers also mark the connection to be
        opened again before the next transaction: a multi-host dsn then finds
        the new primary.
        """
        if not isinstance(exc, psycopg.Error):
            return Failure.OTHER
        state = exc.sqlstate
        if state is None:
            found = (Failure.CONNECTION_LOST if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
                     else Failure.OTHER)
        elif state.startswith("08"):  # connection_exception
            found = Failure.CONNECTION_LOST
        else:
            found = _SQLSTATE_FAILURES.get(state, Failure.OTHER)
        if found in (Failure.CONNECTION_LOST, Failure.READ_ONLY):
            self._drop = True
            if found is Failure.CONNECTION_LOST:
                self.guard.disarm()  # nothing more waits on that connection
        return found

    def is_locked(self, exc: BaseException) -> bool:
        return self.classify(exc) is Failure.LOCKED

    def storage_error(self, exc: BaseException, prefix: str = "") -> StorageError:
        failure = self.classify(exc)
        text = _one_line(exc)
        if failure is Failure.LOCKED:
            return DatabaseLocked(f"database is locked: {text}")
        if failure is Failure.READ_ONLY:
            return StorageError(f"{prefix}the queue database takes no writes now (read-only): {text}")
        if failure is Failure.CONNECTION_LOST:
            return StorageError(f"{prefix}connection to the queue database lost: {text}")
        return StorageError(f"{prefix}{text}")

    def db_stats(self, conn: PgConnection, db_path: Path) -> dict[str, Any]:
        """The ``db`` object of ``queue stats``: the masked dsn and the database's size."""
        found = conn.execute("SELECT pg_database_size(current_database())").fetchone()
        return {
            "backend": POSTGRESQL,
            "dsn": self.display_dsn,
            "path": None,
            "size_bytes": int(found[0]) if found is not None else 0,
            "wal_bytes": None,
        }


def _show(conn: PgConnection, setting: str) -> str:
    found = conn.execute("SELECT current_setting(%s)", (setting,)).fetchone()
    return str(found[0]) if found is not None else ""


def _read_password(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StorageError(f"queue.password_file: cannot read {path}: {reason}") from None
    password = text.rstrip("\r\n")
    if not password:
        raise StorageError(f"queue.password_file: {path} is empty")
    return password


# -- schema ------------------------------------------------------------------------


def migrate(dialect: PostgresDialect, conn: PgConnection, agent_id: str, now: float) -> int:
    """Bring the database up to SCHEMA_VERSION and check it belongs to ``agent_id``.

    Under the agent's write lock, so several processes starting at once
    migrate once. Returns the database's schema version.
    """
    def run_script(sql: str) -> None:
        conn.execute(sql.encode())  # no parameters: several statements in one round trip

    with dialect.write_transaction(conn):
        return schema.migrate_meta(
            conn, load_queries(POSTGRESQL), load_migrations(POSTGRESQL), run_script,
            agent_id=agent_id, now=now, schema_version=SCHEMA_VERSION,
            min_compatible_version=MIN_COMPATIBLE_VERSION,
        )


def open_database(dialect: PostgresDialect, agent_id: str, now: float) -> PgConnection:
    """The daemon's writer connection: migrates and checks ownership."""
    conn = dialect.connect()
    try:
        migrate(dialect, conn, agent_id, now)
    except psycopg.Error as exc:
        conn.close()
        failure = dialect.classify(exc)
        kind = DatabaseUnavailable if failure in (Failure.CONNECTION_LOST, Failure.READ_ONLY) else StorageError
        raise kind(f"cannot migrate the queue database {dialect.display_dsn}: {_one_line(exc)}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def open_existing(dialect: PostgresDialect) -> PgConnection:
    """A connection for operator commands: never creates the schema, refuses a too-new one."""
    conn = dialect.connect()
    try:
        meta = schema.read_meta(conn, load_queries(POSTGRESQL))
    except psycopg.Error as exc:
        conn.close()
        raise dialect.storage_error(exc, "queue database error: ") from exc
    if not meta:
        conn.close()
        raise StorageError(f"{dialect.display_dsn} holds no hl7-agent queue "
                           "(has the daemon run with this queue.dsn?)")
    if int(meta.get("min_compatible_version", "0")) > SCHEMA_VERSION:
        conn.close()
        raise IncompatibleDatabase(
            f"the queue database {dialect.display_dsn} needs a newer hl7-agent "
            f"(schema {meta.get('schema_version')})"
        )
    return conn


def check_owner(conn: PgConnection, dialect: PostgresDialect, agent_id: str) -> None:
    """Refuse to change a queue another ``agent.id`` owns (two agents never share a queue)."""
    owner = schema.read_meta(conn, load_queries(POSTGRESQL)).get("agent_id")
    if owner is not None and owner != agent_id:
        raise IncompatibleDatabase(
            f"the queue database {dialect.display_dsn} belongs to agent.id {owner!r}, "
            f"not {agent_id!r}: check --config"
        )
