"""The queue's id: a UUID made with the database, kept for ever, added to files made before it (real SQLite in tmp_path)."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

from agent.storage import sqlite as db
from agent.storage.store import SqliteStore


def open_store(path: Path) -> tuple[sqlite3.Connection, SqliteStore]:
    conn = db.open_database(path, "qid-agent", db.DatabaseOptions(), 0.0)
    return conn, SqliteStore(conn, db.load_queries(), db_path=path)


def meta(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT key, value FROM meta").fetchall())
    finally:
        conn.close()


class TestQueueId:
    def test_a_new_database_gets_a_uuid(self, tmp_path: Path) -> None:
        """The first open creates a queue_id that is a canonical UUID."""
        conn, store = open_store(tmp_path / "queue.db")
        try:
            queue_id = store.queue_id()
        finally:
            conn.close()
        assert queue_id is not None and str(uuid.UUID(queue_id)) == queue_id

    def test_the_id_never_changes_across_opens(self, tmp_path: Path) -> None:
        """Reopening (a restart, an upgrade) keeps the same id."""
        ids = []
        for _ in range(3):
            conn, store = open_store(tmp_path / "queue.db")
            ids.append(store.queue_id())
            conn.close()
        assert len(set(ids)) == 1 and ids[0] is not None

    def test_a_database_from_the_previous_version_gets_one_on_first_open(self, tmp_path: Path) -> None:
        """A file without the key (made before it existed) gets an id on first open; nothing else in meta changes."""
        path = tmp_path / "queue.db"
        conn, _store = open_store(path)
        conn.execute("DELETE FROM meta WHERE key = 'queue_id'")  # the file as the previous version left it
        conn.close()
        before = meta(path)
        assert "queue_id" not in before
        conn, store = open_store(path)
        try:
            queue_id = store.queue_id()
        finally:
            conn.close()
        after = meta(path)
        assert queue_id is not None and after.pop("queue_id") == queue_id
        assert after == before

    def test_the_schema_version_is_unchanged(self, tmp_path: Path) -> None:
        """Only a meta row is added: schema and min_compatible_version stay, so the previous version still opens the file."""
        path = tmp_path / "queue.db"
        conn, _store = open_store(path)
        conn.close()
        values = meta(path)
        assert values["schema_version"] == str(db.SCHEMA_VERSION)
        assert values["min_compatible_version"] == str(db.MIN_COMPATIBLE_VERSION)
        db.open_existing(path, db.DatabaseOptions()).close()
