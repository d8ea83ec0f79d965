"""Opening the queue database: pragmas, permissions, migrations, ownership.

The SQL lives in ``queue/`` (shipped as ``agent._sql`` through a committed
symlink): ``migrations/NNNN_*.sql`` and ``queries.sql`` with ``-- name: x``
blocks. SQL is data (procrastinate's layout); this module only loads it.
"""

from __future__ import annotations

import os
import re
import sqlite3
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from agent.errors import IncompatibleDatabase, StorageError

#: The schema this code writes; migrations bring older files up to it.
SCHEMA_VERSION = 1
#: The oldest schema this code can still run against (forward compatibility:
#: a newer file whose min_compatible_version is <= ours is fine).
MIN_COMPATIBLE_VERSION = 1

DB_FILENAME = "queue.db"

_NAME_LINE = re.compile(r"^--\s*name:\s*([a-z0-9_]+)\s*$", re.MULTILINE)
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def _sql_root() -> resources.abc.Traversable:
    return resources.files("agent._sql")


def load_queries() -> dict[str, str]:
    """Named queries from every ``queue/*.sql``: each block starts with ``-- name: x``."""
    queries: dict[str, str] = {}
    files = sorted((e for e in _sql_root().iterdir() if e.name.endswith(".sql")), key=lambda e: e.name)
    for entry in files:
        parts = _NAME_LINE.split(entry.read_text(encoding="utf-8"))
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"{entry.name} defines query {name!r} a second time")
            queries[name] = body.strip()
    return queries


def load_migrations() -> list[tuple[int, str]]:
    """(version, sql) for every migration file, in order."""
    found: list[tuple[int, str]] = []
    for entry in (_sql_root() / "migrations").iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text(encoding="utf-8")))
    found.sort()
    return found


#: The WAL is cut back to this size whenever SQLite restarts it from the
#: start (after a complete checkpoint), so one big batch or a long reader
#: does not keep its high-water mark on the disk for good. About the
#: auto-checkpoint threshold (1000 pages of 4 KiB), so a WAL in its usual
#: range is never cut and regrown.
WAL_SIZE_LIMIT = 4 * 1024 * 1024

#: PRAGMA auto_vacuum values (the SQLite file header, offset 52/64).
AUTO_VACUUM_NONE = 0
AUTO_VACUUM_INCREMENTAL = 2


@dataclass(frozen=True)
class DatabaseOptions:
    synchronous: str = "full"  # SPEC 6: FULL survives power loss in WAL mode
    busy_timeout: float = 5.0


def _apply_pragmas(conn: sqlite3.Connection, options: DatabaseOptions) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(options.busy_timeout * 1000)}")
    if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
        # Only a brand-new, empty file can get it (else it takes a VACUUM):
        # purged rows' pages can then be handed back to the filesystem
        # (store.release_free_pages). Older files keep auto_vacuum = NONE
        # and reuse their free pages; docs/operations.md says how to convert
        # one offline.
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


def _prepare_files(db_path: Path) -> None:
    """Create the data dir 0700 and the database file 0600 before SQLite does.

    SQLite gives the -wal and -shm files the database file's permissions, so
    creating it 0600 ourselves keeps all three private.
    """
    db_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(db_path.parent, 0o700)
    fd = os.open(db_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(db_path, 0o600)


def connect(db_path: Path, options: DatabaseOptions, *, create: bool) -> sqlite3.Connection:
    """A connection in autocommit mode (explicit BEGIN IMMEDIATE by callers).

    ``create=False`` never creates a file: read-only commands use it (SPEC 2).
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


def _meta(conn: sqlite3.Connection) -> dict[str, str]:
    has_meta = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
    ).fetchone()
    if not has_meta:
        return {}
    return {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}


def migrate(conn: sqlite3.Connection, agent_id: str, now: float) -> int:
    """Bring the file up to SCHEMA_VERSION and check it belongs to ``agent_id``.

    Runs in one BEGIN IMMEDIATE so two processes starting together (upgrade
    overlap) cannot both migrate. Returns the file's schema version.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        meta = _meta(conn)
        version = int(meta.get("schema_version", "0"))
        min_compatible = int(meta.get("min_compatible_version", "0"))
        if min_compatible > SCHEMA_VERSION:
            raise IncompatibleDatabase(
                f"the queue database needs agent schema >= {min_compatible}, this agent has "
                f"{SCHEMA_VERSION}: upgrade hl7-agent or use another data_dir"
            )
        owner = meta.get("agent_id")
        if owner is not None and owner != agent_id:
            raise IncompatibleDatabase(
                f"the queue database belongs to agent.id {owner!r}, not {agent_id!r}: two agents "
                "must never share a queue; fix agent.id or data_dir"
            )
        for number, sql in load_migrations():
            if number > version:
                for statement in _split_statements(sql):
                    conn.execute(statement)
                version = number
        if version > int(meta.get("schema_version", "0")):
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(version),),
            )
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('min_compatible_version', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(max(min_compatible, MIN_COMPATIBLE_VERSION)),),
            )
        if owner is None:
            conn.execute("INSERT INTO meta (key, value) VALUES ('agent_id', ?)", (agent_id,))
            conn.execute("INSERT INTO meta (key, value) VALUES ('created_at', ?)", (repr(now),))
        if "queue_id" not in meta:
            # The queue's identity for the server's lease-epoch fence: made once,
            # never changed. A new meta key only, so an older agent keeps working
            # on the file; a file made by one gets its id on first open by us.
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('queue_id', ?) ON CONFLICT (key) DO NOTHING",
                (str(uuid.uuid4()),),
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return version


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
        migrate(conn, agent_id, now)
    except sqlite3.Error as exc:
        conn.close()
        raise StorageError(f"cannot migrate queue database {db_path}: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def open_existing(db_path: Path, options: DatabaseOptions) -> sqlite3.Connection:
    """A connection for operator commands: never creates, refuses a too-new schema."""
    conn = connect(db_path, options, create=False)
    meta = _meta(conn)
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
