"""SqliteDialect: driver errors classified by SQLite's result code, never by their text.

Every error here is a real one from SQLite on a file in ``tmp_path``: a write
lock another connection holds, a file opened read-only, a database at its
page limit, and a query whose message merely *contains* the word "locked".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import DatabaseLocked, StorageError
from agent.storage import sqlite as db
from agent.storage.sqlite import Failure, SqliteDialect
from agent.storage.store import SqliteStore
from agent.storage.writer import Reader, Writer

DIALECT = SqliteDialect()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "data" / "queue.db"
    db.open_database(p, "dialect-agent", db.DatabaseOptions(), 0.0).close()
    return p


def error_of(conn: sqlite3.Connection, sql: str) -> sqlite3.Error:
    with pytest.raises(sqlite3.Error) as caught:
        conn.execute(sql)
    return caught.value


class TestClassify:
    def test_a_held_write_lock_is_locked(self, path: Path) -> None:
        """BEGIN IMMEDIATE against another connection's write lock (SQLITE_BUSY): LOCKED, DatabaseLocked."""
        holder = sqlite3.connect(path, isolation_level=None)
        waiter = sqlite3.connect(path, isolation_level=None, timeout=0.05)
        try:
            holder.execute("BEGIN IMMEDIATE")
            exc = error_of(waiter, "BEGIN IMMEDIATE")
        finally:
            holder.close()
            waiter.close()
        assert DIALECT.classify(exc) is Failure.LOCKED
        assert isinstance(DIALECT.storage_error(exc), DatabaseLocked)

    def test_a_message_that_says_locked_is_not_a_lock(self, path: Path) -> None:
        """'no such table: locked_rows' is an ordinary error, though its text has the word."""
        conn = sqlite3.connect(path)
        try:
            exc = error_of(conn, "SELECT * FROM locked_rows")
        finally:
            conn.close()
        assert "locked" in str(exc)
        assert DIALECT.classify(exc) is Failure.OTHER
        error = DIALECT.storage_error(exc)
        assert type(error) is StorageError and str(error) == "no such table: locked_rows"

    def test_read_only_file(self, path: Path) -> None:
        """A write on a connection opened read-only: READ_ONLY."""
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            exc = error_of(conn, "INSERT INTO meta (key, value) VALUES ('x', 'y')")
        finally:
            conn.close()
        assert DIALECT.classify(exc) is Failure.READ_ONLY

    def test_full_database(self, path: Path) -> None:
        """An insert past PRAGMA max_page_count (SQLITE_FULL, as on a full disk): DISK_FULL."""
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")
            exc = error_of(conn, "INSERT INTO meta (key, value) VALUES ('big', hex(randomblob(100000)))")
        finally:
            conn.close()
        assert DIALECT.classify(exc) is Failure.DISK_FULL

    def test_an_error_without_a_code(self) -> None:
        """An exception that carries no SQLite result code is OTHER."""
        assert DIALECT.classify(sqlite3.ProgrammingError("closed")) is Failure.OTHER
        assert DIALECT.classify(ValueError("x")) is Failure.OTHER


class TestThreadsClassifyByCode:
    @pytest.fixture
    def store(self, path: Path) -> Iterator[SqliteStore]:
        conn = db.connect(path, db.DatabaseOptions(), create=False)
        store = SqliteStore(conn, db.load_queries(), db_path=path)
        yield store
        store.close()  # the writer or reader closed it already; closing again is harmless

    def test_writer_job_whose_message_says_locked(self, store: SqliteStore) -> None:
        """The writer reports an ordinary failure as StorageError, not DatabaseLocked (which means: retry)."""
        writer = Writer(store)
        writer.start()
        try:
            failed = writer.submit(lambda s: s.conn.execute("SELECT * FROM locked_rows"))
            with pytest.raises(StorageError) as caught:
                failed.result(10)
        finally:
            writer.close()
        assert not isinstance(caught.value, DatabaseLocked)

    def test_reader_call_whose_message_says_busy(self, store: SqliteStore) -> None:
        """The reader does the same for a blocking read."""
        reader = Reader(store)
        try:
            with pytest.raises(StorageError) as caught:
                reader.call_blocking(lambda s: s.conn.execute("SELECT * FROM busy_rows"))
        finally:
            reader.close()
        assert not isinstance(caught.value, DatabaseLocked)


class TestTransactions:
    def test_write_transaction_rolls_back_on_error(self, path: Path) -> None:
        """The one transaction helper: an exception inside leaves nothing behind and no transaction open."""
        conn = db.connect(path, db.DatabaseOptions(), create=False)

        def doomed() -> None:
            with DIALECT.write_transaction(conn):
                conn.execute("INSERT INTO meta (key, value) VALUES ('tx', '1')")
                raise RuntimeError("boom")

        try:
            with pytest.raises(RuntimeError):
                doomed()
            assert not conn.in_transaction
            assert conn.execute("SELECT count(*) FROM meta WHERE key = 'tx'").fetchone() == (0,)
        finally:
            conn.close()

    def test_store_transaction_reports_a_held_lock_as_database_locked(self, path: Path) -> None:
        """store.transaction() turns the driver's busy error into DatabaseLocked."""
        conn = db.connect(path, db.DatabaseOptions(busy_timeout=0.05), create=False)
        store = SqliteStore(conn, db.load_queries(), db_path=path)
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            with pytest.raises(DatabaseLocked), store.transaction():
                pass
        finally:
            holder.close()
            store.close()


def test_the_writer_keeps_sub_journals_in_memory(path: Path) -> None:
    """The writer's connection has temp_store = MEMORY: a savepoint's or statement's sub-journal
    past 64 KiB no longer spills to a temporary file (open, write, unlink, close in a commit
    batch). Other connections keep the default, so an operator's big sort does not grow in RAM."""
    writer = db.open_database(path, "dialect-agent", db.DatabaseOptions(), 0.0)
    reader = db.connect(path, db.DatabaseOptions(), create=False)
    try:
        assert writer.execute("PRAGMA temp_store").fetchone() == (2,)  # MEMORY
        assert reader.execute("PRAGMA temp_store").fetchone() == (0,)  # DEFAULT
    finally:
        writer.close()
        reader.close()
