"""A migrated store on either backend, for the tests of the store's contract.

The same store object is built on SQLite (a file in the test's tmp dir) and
on PostgreSQL (a schema of its own on the session's server, the
``pg_database`` fixture); the lease runs on the test's clock on both (on
PostgreSQL: the server's clock plus how far the test moved its own, the
dialect's test seam).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.storage import sqlite as db
from agent.storage.store import SqliteStore


class FakeClock:
    """Wall-clock seconds that only move when the test says so."""

    def __init__(self, start: float = 1_750_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.contextmanager
def open_store(backend: str, request: pytest.FixtureRequest, tmp_path: Path, agent_id: str,
               clock: FakeClock) -> Iterator[SqliteStore]:
    """A fresh, migrated store of ``agent_id`` on ``backend`` ("sqlite" or "postgresql"), closed afterwards."""
    if backend == "sqlite":
        path = tmp_path / "queue.db"
        conn = db.open_database(path, agent_id, db.DatabaseOptions(), clock())
        try:
            yield SqliteStore(conn, db.load_queries(), db_path=path, clock=clock)
        finally:
            conn.close()
        return
    from agent.storage import postgres
    from agent.storage.sql import load_queries

    database = request.getfixturevalue("pg_database")
    start = clock.now
    dialect = postgres.PostgresDialect(postgres.PgOptions(dsn=database.dsn, agent_id=agent_id),
                                       role="writer", lease_skew=lambda: clock.now - start)
    conn = postgres.open_database(dialect, agent_id, clock())
    store = SqliteStore(conn, load_queries("postgresql"), db_path=tmp_path / "unused", clock=clock,
                        dialect=dialect)
    try:
        yield store
    finally:
        store.close()
