"""``intake_batch`` on PostgreSQL: all or none, deduped within the group, failures kept to their group.

PostgreSQL aborts the whole transaction at the first failed statement, where
SQLite fails only the statement: what keeps a refused group from taking its
neighbours in the same commit with it is the savepoint around each group and
each writer job (agent/storage/postgres.py). The session's real server
(tests/conftest.py); the constraint violations are the server's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgserver import PgDatabase

from agent.errors import StorageError
from agent.storage import postgres
from agent.storage.sql import POSTGRESQL, load_queries
from agent.storage.store import IntakeItem, Store
from agent.storage.writer import Writer

AGENT = "pg-batch-agent"
T0 = 1_800_000_000.0


def item(cid: str, *, pid: str = "1", **fields: Any) -> IntakeItem:
    body = f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|{cid}|P|2.5.1\rPID|1||{pid}\r".encode()
    return IntakeItem(channel="adt", remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
                      control_id=cid, message_type="ADT^A01", body=body, encoding="utf-8", ack_mode="commit",
                      commit_ack=f"ACK-FOR-{cid}".encode(), received_at=T0, **fields)


@pytest.fixture
def store(pg_database: PgDatabase) -> Iterator[Store]:
    d = postgres.PostgresDialect(postgres.PgOptions(dsn=pg_database.dsn, agent_id=AGENT), role="writer")
    s = Store(postgres.open_database(d, AGENT, time.time()), load_queries(POSTGRESQL), db_path=Path("unused"),
              clock=lambda: T0, dialect=d)
    try:
        yield s
    finally:
        s.close()


def rows(db: PgDatabase) -> list[tuple[object, ...]]:
    return db.rows("SELECT control_id, state, seq FROM messages ORDER BY rowid")


class TestGroupsOnPostgres:
    def test_duplicates_and_conflicts_within_the_group(self, store: Store, pg_database: PgDatabase) -> None:
        """The same key twice in one group: identical bytes replay the first, other bytes conflict with it."""
        first = item("D1")
        with store.transaction() as s:
            results = s.intake_batch([first, item("D2"), first, item("D1", pid="other")])
        assert [r.outcome for r in results] == ["accepted", "accepted", "duplicate", "conflict"]
        assert results[2].message_id == results[0].message_id and results[2].commit_ack == b"ACK-FOR-D1"
        assert rows(pg_database) == [("D1", "queued", 1), ("D2", "queued", 2)]

    def test_duplicates_against_the_table_in_one_lookup(self, store: Store, pg_database: PgDatabase) -> None:
        """Several keys in one run are looked up together: known ones replay, conflict, or are new."""
        with store.transaction() as s:
            first = s.intake(item("T1"))
            s.intake(item("T2"))
        with store.transaction() as s:
            out = s.intake_groups([[item("T1")], [item("T2", pid="other"), item("T3")]])
        assert [[r.outcome for r in g] for g in out] == [["duplicate"], ["conflict", "accepted"]]
        assert out[0][0].message_id == first.message_id and out[0][0].commit_ack == b"ACK-FOR-T1"
        assert rows(pg_database) == [("T1", "queued", 1), ("T2", "queued", 2), ("T3", "queued", 3)]

    def test_a_failing_member_takes_the_whole_group_with_it(self, store: Store, pg_database: PgDatabase) -> None:
        """One insert the server refuses (a CHECK) rolls back the group, and the transaction goes on."""
        bad = replace(item("F2"), ack_mode="bogus")  # type: ignore[arg-type]  # a value the schema refuses
        with store.transaction() as s:
            with pytest.raises(psycopg.errors.CheckViolation):
                s.intake_batch([item("F1"), bad, item("F3")])
            assert s.intake(item("AFTER")).seq == 1  # the group's seq was given back too
        assert rows(pg_database) == [("AFTER", "queued", 1)]

    def test_a_failing_group_in_the_writer_spares_its_neighbours(self, store: Store,
                                                                 pg_database: PgDatabase) -> None:
        """Through the writer: the group's caller gets StorageError, a job of the same batch commits."""
        bad = replace(item("W2"), ack_mode="bogus")  # type: ignore[arg-type]
        writer = Writer(store)
        writer.start()
        try:
            group = writer.submit(Store.intake_batch, [item("W1"), bad])
            single = writer.submit(Store.intake, item("W3"))
            with pytest.raises(StorageError):
                group.result(10)
            assert single.result(10).outcome == "accepted"
        finally:
            writer.close()
        assert rows(pg_database) == [("W3", "queued", 1)]
