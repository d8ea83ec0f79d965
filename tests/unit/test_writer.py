"""The writer thread's deferred bookkeeping: never a commit of its own while traffic flows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agenttest import wait_for

from agent.storage import sqlite as db
from agent.storage.store import SqliteStore
from agent.storage.writer import Reader, Writer


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[Writer]:
    path = tmp_path / "data" / "queue.db"
    conn = db.open_database(path, "writer-test", db.DatabaseOptions(), time.time())
    w = Writer(SqliteStore(conn, db.load_queries(), db_path=path))
    w.start()
    try:
        yield w
    finally:
        w.close()


def _meta(store: SqliteStore, key: str) -> str | None:
    row = store.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def _set_meta(key: str, value: str):  # noqa: ANN202 - a store job
    def job(store: SqliteStore) -> None:
        store.conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    return job


class TestDeferredJobs:
    def test_deferred_job_rides_with_the_next_batch(self, writer: Writer) -> None:
        """A deferred job is committed in the same batch as the next submitted job, not in one of its own."""
        before = writer.batches
        writer.defer(_set_meta("deferred", "1"))
        writer.submit(_set_meta("submitted", "1")).result(5)
        assert writer.batches == before + 1
        assert writer.submit(lambda s: _meta(s, "deferred")).result(5) == "1"

    def test_deferred_job_alone_is_flushed_when_quiet(self, writer: Writer) -> None:
        """With no other traffic a deferred job is still committed, within the flush interval."""
        writer.defer(_set_meta("quiet", "1"))
        wait_for(lambda: writer.batches >= 1, 5, what="the deferred job's own flush")
        assert writer.submit(lambda s: _meta(s, "quiet")).result(5) == "1"

    def test_close_flushes_deferred_jobs(self, tmp_path: Path) -> None:
        """Closing the writer commits what was deferred before the close."""
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "writer-test", db.DatabaseOptions(), time.time())
        w = Writer(SqliteStore(conn, db.load_queries(), db_path=path))
        w.defer_flush_interval = 60.0
        w.start()
        w.defer(_set_meta("at_close", "1"))
        w.close()
        check = db.open_database(path, "writer-test", db.DatabaseOptions(), time.time())
        try:
            assert check.execute("SELECT value FROM meta WHERE key = 'at_close'").fetchone() == ("1",)
        finally:
            check.close()


class TestCallsByMethod:
    """``writer.call(SqliteStore.method, …)`` and ``reader.call(…)``: the store method named at the call."""

    def test_writer_call_runs_the_method_with_its_arguments_and_commits(self, writer: Writer) -> None:
        """The method gets the store first, then the arguments; its effect is committed when the call returns."""
        before = writer.batches
        asyncio.run(writer.call(SqliteStore.pause_channel, "adt", "test"))
        assert writer.batches == before + 1
        assert writer.submit(SqliteStore.paused_channels).result(5) == {"adt"}

    def test_defer_takes_a_method_and_arguments(self, writer: Writer) -> None:
        """A deferred method with arguments rides with the next submitted job."""
        writer.defer(SqliteStore.pause_channel, "lab", "deferred")
        assert writer.submit(SqliteStore.paused_channels).result(5) == {"lab"}

    def test_reader_call_and_call_blocking(self, writer: Writer) -> None:
        """The reader answers the same method on its own connection, awaited or blocking."""
        writer.submit(SqliteStore.pause_channel, "adt", "x").result(5)
        path = writer.store.db_path
        reader = Reader(SqliteStore(db.connect(path, db.DatabaseOptions(), create=False), db.load_queries(),
                                    db_path=path))
        try:
            assert asyncio.run(reader.call(SqliteStore.paused_channels)) == {"adt"}
            assert reader.call_blocking(SqliteStore.stats, ["adt"])["channels"]["adt"]["paused"] is True
        finally:
            reader.close()
