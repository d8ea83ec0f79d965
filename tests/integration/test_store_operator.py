"""The store's part of the operator tools: set-aside, the server's reason, the audit trail, schema 2.

On both backends: a real SQLite file in ``tmp_path``, and a schema of its own
on the session's real PostgreSQL server (tests/conftest.py); two connections
on one queue stand for two processes (the CLI and the daemon, or two hosts).
docs/queue.md#operator-actions, docs/queue.md#schema-versions-and-upgrades.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.core.states import State
from agent.storage import sqlite as db
from agent.storage.rows import RowFilter
from agent.storage.store import IntakeItem, LeaseHolder, SqliteStore

AGENT = "op-agent"
START = 1_750_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@dataclass
class Queue:
    path: Path
    store: SqliteStore
    clock: Clock
    me: LeaseHolder
    epoch: int
    pg: Any = None  # the test's PgDatabase on PostgreSQL; None on SQLite

    def intake(self, control_id: str, channel: str = "adt", *, ack_mode: str = "commit") -> str:
        body = (f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101120000||ADT^A01|{control_id}|P|2.5.1\r"
                "PID|1||9\r").encode()
        with self.store.transaction() as s:
            result = s.intake(IntakeItem(channel=channel, remote="10.0.0.1:1", sending_app="LAB",
                                         sending_facility="NORTH", control_id=control_id,
                                         message_type="ADT^A01", body=body, encoding="utf-8",
                                         ack_mode=ack_mode))  # type: ignore[arg-type]
        return result.message_id

    def send_head(self, channel: str = "adt") -> tuple[str, int]:
        """Claim and mark the head inflight under the lease: (id, attempt)."""
        with self.store.transaction() as s:
            head = s.channel_head(channel)
            assert head is not None and s.claim(self.me.holder, self.epoch, head.id)
            return head.id, s.mark_inflight(self.me.holder, self.epoch, head.id, "claimed", head.attempts)

    def state(self, message_id: str) -> str:
        row = self.store.row(message_id)
        assert row is not None
        return str(row.state)

    def other_store(self) -> SqliteStore:
        """A second connection on the same queue: what another process (or host) sees and does."""
        if self.pg is not None:
            from agent.storage import postgres
            from agent.storage.sql import load_queries

            dialect = postgres.PostgresDialect(postgres.PgOptions(dsn=self.pg.dsn, agent_id=AGENT),
                                               role="writer")
            return SqliteStore(dialect.connect(), load_queries("postgresql"), db_path=self.path,
                               clock=self.clock, dialect=dialect)
        conn = db.connect(self.path, db.DatabaseOptions(), create=False)
        return SqliteStore(conn, db.load_queries(), db_path=self.path, clock=self.clock)

    def scalar(self, sql: str, *args: object) -> object:
        """One value read straight from the database (``?`` placeholders), as an operator's shell would."""
        if self.pg is not None:
            (row,) = self.pg.rows(sql.replace("?", "%s"), args)
            return row[0]
        conn = sqlite3.connect(self.path)
        try:
            return conn.execute(sql, args).fetchone()[0]
        finally:
            conn.close()


def _open(tmp_path: Path, pg: Any) -> tuple[SqliteStore, Path]:
    clock = Clock()
    path = tmp_path / "queue.db"
    if pg is None:
        conn = db.open_database(path, AGENT, db.DatabaseOptions(), clock())
        return SqliteStore(conn, db.load_queries(), db_path=path, clock=clock, retention=86400.0), path
    from agent.storage import postgres
    from agent.storage.sql import load_queries

    dialect = postgres.PostgresDialect(postgres.PgOptions(dsn=pg.dsn, agent_id=AGENT), role="writer")
    conn = postgres.open_database(dialect, AGENT, clock())
    return SqliteStore(conn, load_queries("postgresql"), db_path=path, clock=clock, retention=86400.0,
                       dialect=dialect), path


@pytest.fixture(params=["sqlite", "postgresql"])
def queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Queue]:
    """A fresh, migrated queue holding the lease; parametrised by backend."""
    pg = request.getfixturevalue("pg_database") if request.param == "postgresql" else None
    store, path = _open(tmp_path, pg)
    clock = store.clock
    assert isinstance(clock, Clock)
    me = LeaseHolder.for_this_process(AGENT)
    with store.transaction() as s:
        epoch = s.try_acquire_lease(me, 300.0)
    assert epoch is not None
    try:
        yield Queue(path, store, clock, me, epoch, pg)
    finally:
        store.close()


ACK_422 = ("MSH|^~\\&|EHR|C|LAB|N|20260101||ACK^A01^ACK|S1|P|2.5.1\r"
           "MSA|AE|MSG1|unknown patient identifier in PID-3\rERR|||204^Unknown key identifier^HL70357|E\r")


class TestServerReason:
    def test_settle_stores_it_and_show_reads_it(self, queue: Queue) -> None:
        """A rejected settle keeps the server's reason with the row; recent_failures carries it."""
        message_id = queue.intake("MSG1")
        _, attempt = queue.send_head()
        with queue.store.transaction() as s:
            assert s.settle(queue.me.holder, queue.epoch, message_id, attempt, "rejected",
                            server_status=422, server_ack=ACK_422, error_code="422",
                            error_text="rejected by server (status 422)",
                            server_reason="unknown patient identifier in PID-3")
        row = queue.store.row(message_id)
        assert row is not None and row.server_reason == "unknown patient identifier in PID-3"
        (failure,) = queue.store.recent_failures(10)
        assert failure.id == message_id and failure.server_reason == row.server_reason
        assert failure.server_status == 422
        (listed,) = queue.store.list_rows(RowFilter())
        assert listed.server_reason == row.server_reason and listed.error_text.startswith("rejected")

    def test_requeue_describes_the_last_answer(self, queue: Queue) -> None:
        """A retry stores its answer's reason; a later retry without an answer clears it."""
        message_id = queue.intake("MSG1")
        _, attempt = queue.send_head()
        with queue.store.transaction() as s:
            assert s.requeue(queue.me.holder, queue.epoch, message_id, attempt, 0.0, server_status=503,
                             error_code="503", error_text="transient", server_reason="database down")
        row = queue.store.row(message_id)
        assert row is not None and (row.server_status, row.server_reason) == (503, "database down")
        _, attempt = queue.send_head()
        with queue.store.transaction() as s:
            assert s.requeue(queue.me.holder, queue.epoch, message_id, attempt, 0.0,
                             error_code="not_sent", error_text="session closed")
        row = queue.store.row(message_id)
        assert row is not None and row.server_reason is None

    def test_give_up_keeps_or_sets_it(self, queue: Queue) -> None:
        """fail_live sets the last answer's reason when given one, and keeps the row's otherwise."""
        message_id = queue.intake("MSG1")
        _, attempt = queue.send_head()
        with queue.store.transaction() as s:
            s.requeue(queue.me.holder, queue.epoch, message_id, attempt, 0.0, server_status=503,
                      server_reason="database down")
        _, attempt = queue.send_head()
        with queue.store.transaction() as s:
            assert s.fail_live(queue.me.holder, queue.epoch, message_id, attempt, "failed",
                               error_code="ambiguous", error_text="delivery unknown")
        row = queue.store.row(message_id)
        assert row is not None and row.server_reason == "database down"


class TestSetAside:
    def test_queued_row_becomes_failed_with_the_reason(self, queue: Queue) -> None:
        """Only queued → failed, with the code and text given; the next row becomes the head."""
        first, second = queue.intake("MSG1"), queue.intake("MSG2")
        with queue.store.transaction() as s:
            (outcome,) = s.set_aside([first], queue.clock(), error_code="set_aside",
                                     error_text="set aside by jdoe: bad MRN")
        assert (outcome.result, outcome.state, outcome.channel, outcome.seq) == ("moved", State.FAILED, "adt", 1)
        row = queue.store.row(first)
        assert row is not None and row.state == State.FAILED and row.error_code == "set_aside"
        assert row.error_text == "set aside by jdoe: bad MRN" and row.settled_at == queue.clock()
        head = queue.store.channel_head("adt")
        assert head is not None and head.id == second

    @pytest.mark.parametrize("live", ["claimed", "inflight"])
    def test_claimed_and_inflight_are_never_touched(self, queue: Queue, live: str) -> None:
        """A row the dispatcher holds is refused and left exactly as it was."""
        message_id = queue.intake("MSG1")
        with queue.store.transaction() as s:
            head = s.channel_head("adt")
            assert head is not None and s.claim(queue.me.holder, queue.epoch, message_id)
            if live == "inflight":
                s.mark_inflight(queue.me.holder, queue.epoch, message_id, "claimed", head.attempts)
        before = queue.store.row(message_id)
        with queue.store.transaction() as s:
            (outcome,) = s.set_aside([message_id], queue.clock() + 5, error_code="set_aside", error_text="x")
        assert outcome.result == "refused" and outcome.state == live
        assert queue.store.row(message_id) == before

    def test_settled_and_missing(self, queue: Queue) -> None:
        """A settled row is refused, an unknown id is missing; nothing else moves."""
        done = queue.intake("MSG1")
        _, attempt = queue.send_head()
        with queue.store.transaction() as s:
            s.settle(queue.me.holder, queue.epoch, done, attempt, "processed", server_status=200, server_ack=None)
            outcomes = s.set_aside([done, "00000000-0000-0000-0000-000000000000"], queue.clock(),
                                   error_code="set_aside", error_text="x")
        assert [(o.result, o.state) for o in outcomes] == [("refused", State.PROCESSED), ("missing", None)]
        assert queue.state(done) == "processed"

    def test_a_claim_after_a_set_aside_loses(self, queue: Queue) -> None:
        """The dispatcher read the head as queued, the operator set it aside first: the claim does nothing."""
        message_id = queue.intake("MSG1")
        head = queue.store.channel_head("adt")
        assert head is not None and head.id == message_id  # the dispatcher's read
        cli = queue.other_store()
        try:
            with cli.transaction() as s:
                assert s.set_aside([message_id], queue.clock(), error_code="set_aside",
                                   error_text="x")[0].result == "moved"
        finally:
            cli.close()
        with queue.store.transaction() as s:
            assert s.claim(queue.me.holder, queue.epoch, message_id) is False
        assert queue.state(message_id) == "failed"

    def test_the_guard_is_in_the_statement(self, queue: Queue) -> None:
        """A claim that commits between another process's read and its update wins: the update moves nothing."""
        message_id = queue.intake("MSG1")
        cli = queue.other_store()
        try:
            place = cli.row_place(message_id)  # the operator's view: queued
            assert place is not None and place.state == State.QUEUED
            with queue.store.transaction() as s:
                assert s.claim(queue.me.holder, queue.epoch, message_id)
            with cli.transaction() as s:
                (outcome,) = s.set_aside([message_id], queue.clock(), error_code="set_aside", error_text="x")
        finally:
            cli.close()
        assert outcome.result == "refused" and outcome.state == State.CLAIMED
        assert queue.state(message_id) == "claimed"

    def test_owed_application_ack_kept_with_row_and_dedupe_key(self, queue: Queue) -> None:
        """The AE a waiting sender gets is stored with the row (the relay's poll) and its dedupe key (replays)."""
        message_id = queue.intake("MSG1", ack_mode="application")
        ae = b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|2026||ACK^A01^ACK|Z|P|2.5.1\rMSA|AE|MSG1|not delivered\r"
        with queue.store.transaction() as s:
            s.set_aside([message_id], queue.clock(), error_code="set_aside", error_text="x",
                        app_acks={message_id: ae})
        assert queue.store.settled_app_acks([message_id]) == {message_id: ae}
        assert bytes(queue.scalar("SELECT app_ack FROM dedupe_keys WHERE message_id = ?",  # type: ignore[arg-type]
                                  message_id)) == ae


class TestAuditTrail:
    def record(self, store: SqliteStore, action: str = "fail", *, done: bool = True, rows: int = 1) -> int:
        with store.transaction() as s:
            return s.record_operator_action(action, os_user="jdoe", pid=4242, now=store.clock(), rows=rows,
                                            detail={"ids": ["a"]}, channel="adt", reason="why", done=done)

    def test_taken_once_and_in_order(self, queue: Queue) -> None:
        """Finished entries are taken oldest first, each once; their fields come back as written."""
        first, second = self.record(queue.store, "pause"), self.record(queue.store, "fail")
        assert queue.store.operator_actions_due(queue.clock() - 60)
        with queue.store.transaction() as s:
            taken = s.take_operator_actions(queue.clock() - 60)
        assert [(e.id, e.action) for e in taken] == [(first, "pause"), (second, "fail")]
        entry = taken[1]
        assert (entry.os_user, entry.pid, entry.channel, entry.reason, entry.rows, entry.status) == (
            "jdoe", 4242, "adt", "why", 1, "done")
        assert json.loads(entry.detail) == {"ids": ["a"]}
        assert not queue.store.operator_actions_due(queue.clock() - 60)
        with queue.store.transaction() as s:
            assert s.take_operator_actions(queue.clock() - 60) == []

    def test_running_entries_wait_until_done_or_silent(self, queue: Queue) -> None:
        """A command still in its batches is not logged yet; one that went silent (it died) is."""
        entry_id = self.record(queue.store, "purge", done=False)
        assert not queue.store.operator_actions_due(queue.clock() - 60)
        with queue.store.transaction() as s:
            s.update_operator_action(entry_id, now=queue.clock(), rows=2000, detail={"state": "processed"})
        assert not queue.store.operator_actions_due(queue.clock() - 60)
        queue.clock.now += 61
        with queue.store.transaction() as s:
            (entry,) = s.take_operator_actions(queue.clock() - 60)
        assert (entry.id, entry.rows, entry.status) == (entry_id, 2000, "running")

    def test_two_processes_each_entry_once(self, queue: Queue) -> None:
        """Two daemons on one file (an upgrade overlap) taking at the same time: every entry goes to one."""
        ids = [self.record(queue.store, rows=i) for i in range(200)]
        stores = [queue.other_store(), queue.other_store()]
        taken: list[list[int]] = [[], []]
        barrier = threading.Barrier(2)

        def take(n: int) -> None:
            barrier.wait()
            for _ in range(20):
                with stores[n].transaction() as s:
                    taken[n].extend(e.id for e in s.take_operator_actions(queue.clock() - 60))

        threads = [threading.Thread(target=take, args=(n,)) for n in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for s in stores:
            s.close()
        assert sorted(taken[0] + taken[1]) == ids

    def test_logged_entries_forgotten_after_retention(self, queue: Queue) -> None:
        """Entries logged longer ago than the queue's retention go at a later take."""
        self.record(queue.store)
        with queue.store.transaction() as s:
            s.take_operator_actions(queue.clock() - 60)
        queue.clock.now += 86400 + 1
        self.record(queue.store)
        with queue.store.transaction() as s:
            s.take_operator_actions(queue.clock() - 60)
        assert queue.scalar("SELECT count(*) FROM operator_actions") == 1


class TestSchemaTwo:
    def test_a_schema_1_file_migrates_in_place(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A file of the previous version gains the column and the table; its rows and
        min_compatible_version stay, so that version still opens it (an upgrade overlap)."""
        path = tmp_path / "queue.db"
        first = db.load_migrations()[:1]
        monkeypatch.setattr(db, "load_migrations", lambda: first)
        monkeypatch.setattr(db, "SCHEMA_VERSION", 1)
        conn = db.open_database(path, AGENT, db.DatabaseOptions(), START)
        store = SqliteStore(conn, db.load_queries(), db_path=path)
        conn.execute("INSERT INTO messages (id, channel, seq, state, remote, body, body_sha256, received_at,"
                     " updated_at) VALUES ('old-row', 'adt', 1, 'failed', 'x', x'00', '', 1, 1)")
        conn.close()
        monkeypatch.undo()
        conn = db.open_database(path, AGENT, db.DatabaseOptions(), START)
        try:
            store = SqliteStore(conn, db.load_queries(), db_path=path)
            meta = store.meta()
            assert (meta["schema_version"], meta["min_compatible_version"]) == (str(db.SCHEMA_VERSION), "1")
            row = store.row("old-row")
            assert row is not None and row.server_reason is None and row.state == State.FAILED
            assert conn.execute("SELECT count(*) FROM operator_actions").fetchone() == (0,)
        finally:
            conn.close()
        db.open_existing(path, db.DatabaseOptions()).close()

    def test_a_schema_3_file_loses_only_the_control_id_index(self, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
        """Schema 4 drops messages_control_id and nothing else; the rows stay, a control id is still
        found, and min_compatible_version stays 1 (the previous version keeps working on it)."""
        path = tmp_path / "queue.db"
        first = db.load_migrations()[:3]
        monkeypatch.setattr(db, "load_migrations", lambda: first)
        monkeypatch.setattr(db, "SCHEMA_VERSION", 3)

        def indexes(conn: sqlite3.Connection) -> set[str]:
            return {r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'index'")}

        conn = db.open_database(path, AGENT, db.DatabaseOptions(), START)
        before = indexes(conn)
        conn.execute("INSERT INTO messages (id, channel, seq, state, remote, control_id, body, body_sha256,"
                     " received_at, updated_at) VALUES ('old-row', 'adt', 1, 'queued', 'x', 'C1', x'00', '', 1, 1)")
        conn.close()
        monkeypatch.undo()
        conn = db.open_database(path, AGENT, db.DatabaseOptions(), START)
        try:
            assert before - indexes(conn) == {"messages_control_id"} and indexes(conn) <= before
            store = SqliteStore(conn, db.load_queries(), db_path=path)
            meta = store.meta()
            assert (meta["schema_version"], meta["min_compatible_version"]) == ("4", "1")
            assert [r.id for r in store.list_rows(RowFilter(control_id="C1"))] == ["old-row"]
        finally:
            conn.close()

    def test_later_migrations_are_additive(self) -> None:
        """Every migration after the first only adds (new tables, indexes, nullable columns) or drops
        an index that enforced nothing: an index changes how a query is planned, never its answer,
        so the previous version keeps working on a migrated file."""
        allowed = re.compile(r"\s*(CREATE TABLE|CREATE INDEX|CREATE UNIQUE INDEX|ALTER TABLE \w+ ADD COLUMN"
                             r"|DROP INDEX IF EXISTS \w+)\b")
        unique: set[str] = set()
        for number, sql in db.load_migrations():
            for statement in db._split_statements(sql):
                body = "\n".join(ln for ln in statement.splitlines() if not ln.strip().startswith("--"))
                unique.update(re.findall(r"CREATE UNIQUE INDEX (\w+)", body))
                if number == 1:
                    continue
                assert allowed.match(body), (number, body)
                if "ADD COLUMN" in body:
                    assert "NOT NULL" not in body or "DEFAULT" in body, (number, body)
                dropped = re.findall(r"DROP INDEX IF EXISTS (\w+)", body)
                assert not set(dropped) & unique, (number, body)  # a unique index is a constraint
