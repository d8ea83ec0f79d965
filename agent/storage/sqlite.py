"""The SQLite side of the queue: connect, pragmas, migrations, ownership, error classes.

What differs per database backend sits in :class:`SqliteDialect`, the small
object the store holds: connecting, how a write transaction starts (``BEGIN
IMMEDIATE`` here; ``BEGIN`` plus a row lock elsewhere), the clock the lease
runs on (this host's time here; the database's ``now()`` for a shared server),
how a driver error is classified (locked, disk full, read-only, connection
lost) and how a BLOB comes back. Upsert syntax and column types are in the
dialect's own SQL files (``queue/sqlite/``). Everything dialect-neutral —
dedupe, seq, the fenced transitions, stats — is the store's.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import DatabaseLocked, IncompatibleDatabase, StorageError
from agent.storage import schema
from agent.storage.dialect import Failure, TransactionBlocks
from agent.storage.sql import SQLITE, load_migrations, load_queries

__all__ = [
    "AUTO_VACUUM_INCREMENTAL",
    "AUTO_VACUUM_NONE",
    "MIN_COMPATIBLE_VERSION",
    "SCHEMA_VERSION",
    "WAL_SIZE_LIMIT",
    "DatabaseOptions",
    "Failure",
    "SqliteDialect",
    "check_owner",
    "connect",
    "load_migrations",
    "load_queries",
    "migrate",
    "open_database",
    "open_existing",
    "read_meta",
]

#: The schema this code writes; migrations bring older files up to it.
SCHEMA_VERSION = 4
#: The oldest schema this code can still run against (forward compatibility:
#: a newer file whose min_compatible_version is <= ours is fine).
MIN_COMPATIBLE_VERSION = 1

#: The WAL is cut back to this size whenever SQLite restarts it from the
#: start (after a complete checkpoint), so one big batch or a long reader
#: does not keep its high-water mark on the disk for good. Twice the
#: writer's own checkpoint interval (agent/storage/checkpoints.py:
#: CHECKPOINT_FRAMES, 512 pages of 4 KiB), so a WAL in its usual range is
#: never cut and regrown.
WAL_SIZE_LIMIT = 4 * 1024 * 1024

#: SQLite's automatic checkpoint on the writer connection, in pages: a backstop
#: only. The daemon's writer checkpoints after answering its batches, every
#: CHECKPOINT_FRAMES; this one, inside a COMMIT, comes only if that stopped.
WRITER_AUTOCHECKPOINT_PAGES = 2000

#: PRAGMA auto_vacuum values (the SQLite file header, offset 52/64).
AUTO_VACUUM_NONE = 0
AUTO_VACUUM_INCREMENTAL = 2


@dataclass(frozen=True)
class DatabaseOptions:
    # FULL survives power loss in WAL mode (docs/queue.md#the-promise).
    synchronous: str = "full"
    busy_timeout: float = 5.0


#: SQLite primary result codes (https://sqlite.org/rescode.html); extended
#: codes carry the primary one in their low byte.
_FAILURES = {
    sqlite3.SQLITE_BUSY: Failure.LOCKED,
    sqlite3.SQLITE_LOCKED: Failure.LOCKED,
    sqlite3.SQLITE_FULL: Failure.DISK_FULL,
    sqlite3.SQLITE_READONLY: Failure.READ_ONLY,
    sqlite3.SQLITE_IOERR: Failure.CONNECTION_LOST,
    sqlite3.SQLITE_CANTOPEN: Failure.CONNECTION_LOST,
    sqlite3.SQLITE_NOTADB: Failure.CONNECTION_LOST,
    sqlite3.SQLITE_CORRUPT: Failure.CONNECTION_LOST,
}


class SqliteDialect(TransactionBlocks):
    """What is SQLite-specific about running the queue (see the module docstring)."""

    name = SQLITE
    #: The exception every driver call may raise.
    Error = sqlite3.Error
    #: Result rows readable by column name (agent/storage/rows.py builds dataclasses of them).
    row_factory = sqlite3.Row
    #: Free pages, WAL checkpoints and PRAGMA optimize are ours to run (agent/storage/maintenance.py).
    file_maintenance = True

    # -- transactions ----------------------------------------------------------

    def begin_write(self, conn: sqlite3.Connection) -> None:
        """Take the write lock at once: no deadlock between two upgrading readers."""
        conn.execute("BEGIN IMMEDIATE")

    def commit(self, conn: sqlite3.Connection) -> None:
        conn.execute("COMMIT")

    def rollback(self, conn: sqlite3.Connection) -> None:
        """Roll back if a transaction is open; never raises (some I/O errors end it already)."""
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def savepoint(self, conn: sqlite3.Connection, name: str) -> None:
        conn.execute(f"SAVEPOINT {name}")

    def release(self, conn: sqlite3.Connection, name: str) -> None:
        conn.execute(f"RELEASE {name}")

    def rollback_to(self, conn: sqlite3.Connection, name: str) -> None:
        """Undo a savepoint's work and drop it; never raises."""
        try:
            conn.execute(f"ROLLBACK TO {name}")
            conn.execute(f"RELEASE {name}")
        except sqlite3.Error:
            pass

    def read_only(self, conn: sqlite3.Connection) -> None:
        """Make ``conn`` refuse every write, even one a bug would issue."""
        conn.execute("PRAGMA query_only = 1")

    def in_transaction(self, conn: sqlite3.Connection) -> bool:
        """False once SQLite rolled the whole transaction back by itself (an I/O error)."""
        return conn.in_transaction

    def changes(self, conn: sqlite3.Connection) -> int:
        """Rows changed on ``conn`` since it opened: a batch that changed none leaves it alone."""
        return conn.total_changes

    # -- connections -----------------------------------------------------------

    def connection_usable(self, conn: sqlite3.Connection) -> bool:
        """A file connection is never lost for good: each statement reports its own error."""
        return True

    def guarded(self, conn: sqlite3.Connection) -> AbstractContextManager[None]:
        """No deadline: a local file cannot freeze the way a server can (busy_timeout bounds locks)."""
        return nullcontext()

    def reconnect(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        return conn

    # -- clock, values, errors -------------------------------------------------

    def lease_now(self, conn: sqlite3.Connection, clock: Callable[[], float]) -> float:
        """The time lease expiry is measured on: this host's clock (one host shares the file)."""
        return clock()

    def blob(self, value: bytes | memoryview) -> bytes:
        """A BLOB column as bytes."""
        return bytes(value)

    def classify(self, exc: BaseException) -> Failure:
        """What a driver error means, by its result code (never by its text)."""
        code = getattr(exc, "sqlite_errorcode", None)
        if not isinstance(code, int):
            return Failure.OTHER
        return _FAILURES.get(code & 0xFF, Failure.OTHER)

    def is_locked(self, exc: BaseException) -> bool:
        return self.classify(exc) is Failure.LOCKED

    def storage_error(self, exc: BaseException, prefix: str = "") -> StorageError:
        """The agent's exception for a driver error: DatabaseLocked when it was the lock."""
        if self.is_locked(exc):
            return DatabaseLocked(f"database is locked: {exc}")
        return StorageError(f"{prefix}{exc}")

    def db_stats(self, conn: sqlite3.Connection, db_path: Path) -> dict[str, Any]:
        """The ``db`` object of ``queue stats``: the file, its size and its WAL's."""
        return {
            "backend": SQLITE,
            "path": str(db_path),
            "size_bytes": _file_size(db_path),
            "wal_bytes": _file_size(db_path.with_name(db_path.name + "-wal")),
        }

    def connect(self, db_path: Path, options: DatabaseOptions, *, create: bool) -> sqlite3.Connection:
        return connect(db_path, options, create=create)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _apply_pragmas(conn: sqlite3.Connection, options: DatabaseOptions) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(options.busy_timeout * 1000)}")
    if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
        # Only a brand-new, empty file can get it (else it takes a VACUUM):
        # purged rows' pages can then be handed back to the filesystem
        # (maintenance.release_free_pages). Older files keep auto_vacuum =
        # NONE and reuse their free pages; docs/operations.md says how to
        # convert one offline.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StorageError(f"could not switch the queue database to WAL mode (got {mode})")
    sync = {"full": "FULL", "normal": "NORMAL"}[options.synchronous]
    conn.execute(f"PRAGMA synchronous = {sync}")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
    # Deleted rows hold patient data. FAST zeroes deleted content on the
    # b-tree pages that are written anyway (a whole row of a message up to
    # ~4 KB; the first part of a bigger one) but does not rewrite the freed
    # overflow pages of a big body: ON (Debian's build default) writes every
    # freed page once more, in zeros, through the WAL, which doubles what a
    # purge writes and needs disk space exactly when the disk is full.
    # Freed pages go back to the filesystem soon after a purge (incremental
    # vacuum) or are reused by the next rows.
    conn.execute("PRAGMA secure_delete = FAST")


def make_private_dir(path: Path) -> None:
    """``path`` as a folder of mode 0700; missing parents 0755 whatever the umask.

    ``Path.mkdir(parents=True)`` gives parents ``0777 & ~umask``: under
    ``umask 000`` anyone could rename the data dir away and put their own in its place.
    """
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for parent in reversed(missing[1:]):
        # mkdir's mode is masked by the umask, never widened by it: 0755 at most.
        parent.mkdir(mode=0o755, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def _prepare_files(db_path: Path) -> None:
    """Create the data dir 0700 and the database file 0600 before SQLite does.

    SQLite gives the -wal and -shm files the database file's permissions, so
    creating it 0600 ourselves keeps all three private.
    """
    make_private_dir(db_path.parent)
    fd = os.open(db_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(db_path, 0o600)


def connect(db_path: Path, options: DatabaseOptions, *, create: bool) -> sqlite3.Connection:
    """A connection in autocommit mode (explicit BEGIN IMMEDIATE by callers).

    ``create=False`` never creates a file: read-only commands use it
    (docs/operations.md: a command that only reads never creates a database).
    """
    if create:
        _prepare_files(db_path)
    elif not db_path.exists():
        raise StorageError(f"no queue database at {db_path} (has the daemon run with this data_dir?)")
    try:
        conn = sqlite3.connect(
            f"file:{db_path}?mode=rw",
            uri=True,
            isolation_level=None,
            check_same_thread=False,
            timeout=options.busy_timeout,
        )
    except sqlite3.Error as exc:
        raise StorageError(f"cannot open queue database {db_path}: {exc}") from exc
    try:
        _apply_pragmas(conn, options)
    except sqlite3.Error as exc:
        conn.close()
        raise StorageError(f"cannot configure queue database {db_path}: {exc}") from exc
    return conn


def read_meta(conn: sqlite3.Connection, queries: dict[str, str] | None = None) -> dict[str, str]:
    """The ``meta`` table as a dict; empty when the file has none (not a queue database)."""
    return schema.read_meta(conn, queries if queries is not None else load_queries())


def migrate(conn: sqlite3.Connection, agent_id: str, now: float) -> int:
    """Bring the file up to SCHEMA_VERSION and check it belongs to ``agent_id``.

    Runs in one write transaction so two processes starting together (upgrade
    overlap) cannot both migrate. Returns the file's schema version.
    """

    def run_script(sql: str) -> None:
        for statement in _split_statements(sql):
            conn.execute(statement)

    with SqliteDialect().write_transaction(conn):
        return schema.migrate_meta(
            conn, load_queries(), load_migrations(), run_script, agent_id=agent_id, now=now,
            schema_version=SCHEMA_VERSION, min_compatible_version=MIN_COMPATIBLE_VERSION,
        )


def _split_statements(sql: str) -> list[str]:
    """Split a migration into statements (sqlite3.complete_statement aware)."""
    statements: list[str] = []
    current: list[str] = []
    for line in sql.splitlines(keepends=True):
        current.append(line)
        candidate = "".join(current)
        if sqlite3.complete_statement(candidate):
            if candidate.strip().strip(";").strip() and not _only_comments(candidate):
                statements.append(candidate)
            current = []
    return statements


def _only_comments(sql: str) -> bool:
    return all(not ln.strip() or ln.strip().startswith("--") for ln in sql.splitlines())


def open_database(
    db_path: Path, agent_id: str, options: DatabaseOptions, now: float
) -> sqlite3.Connection:
    """The daemon's writer connection: creates, migrates and checks ownership."""
    conn = connect(db_path, options, create=True)
    try:
        _writer_pragmas(conn)
        migrate(conn, agent_id, now)
    except sqlite3.Error as exc:
        conn.close()
        raise StorageError(f"cannot migrate queue database {db_path}: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _writer_pragmas(conn: sqlite3.Connection) -> None:
    """What only the daemon's writer connection gets.

    ``temp_store = MEMORY``: the sub-journal of a savepoint or a statement
    (the pages it changed, to undo it alone) otherwise spills to a file in
    /var/tmp once it passes 64 KiB — an open, writes, an unlink and a close
    of a temporary file in a commit batch of a few messages. In memory it is
    bounded by what one batch changes. Not on the reader or operator
    connections, whose big sorts must not grow in RAM.

    ``wal_autocheckpoint``: see WRITER_AUTOCHECKPOINT_PAGES.
    """
    conn.execute("PRAGMA temp_store = MEMORY")
    conn.execute(f"PRAGMA wal_autocheckpoint = {WRITER_AUTOCHECKPOINT_PAGES}")


def open_existing(db_path: Path, options: DatabaseOptions) -> sqlite3.Connection:
    """A connection for operator commands: never creates, refuses a too-new schema."""
    conn = connect(db_path, options, create=False)
    try:
        meta = read_meta(conn)
    except BaseException:
        conn.close()
        raise
    if not meta:
        conn.close()
        raise StorageError(f"{db_path} is not an hl7-agent queue database")
    if int(meta.get("min_compatible_version", "0")) > SCHEMA_VERSION:
        conn.close()
        raise IncompatibleDatabase(
            f"the queue database at {db_path} needs a newer hl7-agent "
            f"(schema {meta.get('schema_version')})"
        )
    return conn


def check_owner(conn: sqlite3.Connection, db_path: Path, agent_id: str) -> None:
    """Refuse to change a queue another ``agent.id`` owns (two agents never share a queue)."""
    owner = read_meta(conn).get("agent_id")
    if owner is not None and owner != agent_id:
        raise IncompatibleDatabase(
            f"the queue database at {db_path} belongs to agent.id {owner!r}, "
            f"not {agent_id!r}: check --config"
        )
