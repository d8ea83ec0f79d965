"""PostgresDialect against a real PostgreSQL server: sessions, errors, reconnection, migrations.

Every error here is a real one from the server the session started
(tests/conftest.py): a lock another session holds past ``lock_timeout``, a
database made read-only, a session the server terminated, the server
stopped and started, a transaction that failed before its COMMIT. Nothing is
faked.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from agenttest import wait_for
from pgserver import PgDatabase

from agent.errors import DatabaseLocked, IncompatibleDatabase, StorageError
from agent.storage import postgres
from agent.storage.dialect import Failure
from agent.storage.postgres import PgOptions, PostgresDialect
from agent.storage.sql import POSTGRESQL, load_queries
from agent.storage.store import IntakeItem, Store

AGENT = "pg-dialect-agent"


def dialect(db: PgDatabase, role: str = "writer", **options: Any) -> PostgresDialect:
    return PostgresDialect(PgOptions(dsn=options.pop("dsn", db.dsn), agent_id=AGENT, **options), role=role)


def store_on(d: PostgresDialect, conn: Any) -> Store:
    return Store(conn, load_queries(POSTGRESQL), db_path=Path("unused"), dialect=d)


def item(cid: str, channel: str = "adt") -> IntakeItem:
    return IntakeItem(channel=channel, remote="10.0.0.1:1", sending_app="LAB", sending_facility="N",
                      control_id=cid, message_type="ADT^A01", body=f"MSH|^~\\&|LAB|N|||||ADT^A01|{cid}|P|2.5\r".encode(),
                      encoding="utf-8", ack_mode="commit", commit_ack=b"ACK " + cid.encode())


@pytest.fixture
def store(pg_database: PgDatabase) -> Iterator[Store]:
    d = dialect(pg_database)
    s = store_on(d, postgres.open_database(d, AGENT, time.time()))
    try:
        yield s
    finally:
        s.close()


def setting(conn: Any, name: str) -> str:
    return str(conn.execute("SELECT current_setting(%s)", (name,)).fetchone()[0])


class TestSession:
    def test_agent_sessions_carry_their_timeouts_and_name(self, store: Store, pg_database: PgDatabase) -> None:
        """lock_timeout = busy_timeout, the idle-in-transaction and statement timeouts, read committed,
        and an application_name pg_stat_activity shows."""
        conn = store.conn
        assert setting(conn, "lock_timeout") == "5s"
        assert setting(conn, "idle_in_transaction_session_timeout") == "5s"
        assert setting(conn, "statement_timeout") == "30s"
        assert setting(conn, "default_transaction_isolation") == "read committed"
        names = [r[0] for r in pg_database.rows(
            "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (conn.info.backend_pid,))]
        assert names == [f"hl7-agent {AGENT} writer"]

    def test_tcp_keepalives_and_timeouts_are_set_unless_the_dsn_sets_them(self, pg_database: PgDatabase) -> None:
        """libpq keepalives, tcp_user_timeout and connect_timeout by default; the dsn's own values win."""
        conn = dialect(pg_database).connect()
        try:
            params = conn.info.get_parameters()
            assert (params["keepalives"], params["keepalives_idle"], params["keepalives_count"]) == ("1", "10", "3")
            assert params["tcp_user_timeout"] == "15000" and params["connect_timeout"] == "5"
        finally:
            conn.close()
        own = dialect(pg_database, dsn=pg_database.dsn + "&keepalives_idle=42").connect()
        try:
            assert own.info.get_parameters()["keepalives_idle"] == "42"
        finally:
            own.close()

    @pytest.mark.parametrize(("server_value", "expected"), [("off", "on"), ("local", "on"),
                                                            ("remote_write", "on"), ("remote_apply", "remote_apply")])
    def test_synchronous_commit_is_at_least_on(self, pg_own_database: PgDatabase, server_value: str,
                                               expected: str) -> None:
        """A weaker database default is raised to on for our sessions; a stronger one is kept."""
        pg_own_database.rows(f'ALTER DATABASE "{pg_own_database.name}" SET synchronous_commit = {server_value}')
        conn = dialect(pg_own_database).connect()
        try:
            assert setting(conn, "synchronous_commit") == expected
        finally:
            conn.close()

    def test_password_file_is_read_at_connect(self, pg_database: PgDatabase, tmp_path: Path) -> None:
        """A dsn without a password connects with password_file; a wrong one fails in one line, unshown."""
        secret = tmp_path / "pw"
        secret.write_text(pg_database.server.password + "\n")
        conn = dialect(pg_database, dsn=pg_database.dsn_without_password, password_file=secret).connect()
        conn.close()
        secret.write_text("not-the-password\n")
        with pytest.raises(StorageError) as caught:
            dialect(pg_database, dsn=pg_database.dsn_without_password, password_file=secret).connect()
        text = str(caught.value)
        assert "\n" not in text and "not-the-password" not in text and "password authentication failed" in text

    def test_a_writer_refuses_a_database_that_takes_no_writes(self, pg_own_database: PgDatabase) -> None:
        """default_transaction_read_only (what a standby looks like): the writer says so at connect."""
        pg_own_database.rows(f'ALTER DATABASE "{pg_own_database.name}" SET default_transaction_read_only = on')
        with pytest.raises(StorageError, match="takes no writes"):
            dialect(pg_own_database).connect()
        dialect(pg_own_database, role="reader").connect().close()  # reads still work


class TestTransactions:
    def test_a_failed_transaction_is_never_reported_committed(self, store: Store) -> None:
        """PostgreSQL answers COMMIT of a failed transaction with ROLLBACK and no error; the dialect raises."""
        d, conn = store.dialect, store.conn
        d.begin_write(conn)
        with pytest.raises(psycopg.Error):
            conn.execute("SELECT 1/0")
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            d.commit(conn)
        assert not d.in_transaction(conn)

    def test_the_write_lock_times_out_as_locked(self, pg_database: PgDatabase) -> None:
        """A second writer waits for the first one's lock at most busy_timeout, then DatabaseLocked."""
        first, second = dialect(pg_database), dialect(pg_database, busy_timeout=0.3)
        a, b = first.connect(), second.connect()
        try:
            first.begin_write(a)
            started = time.monotonic()
            with pytest.raises(psycopg.Error) as caught:
                second.begin_write(b)
            assert 0.25 < time.monotonic() - started < 3
            assert second.classify(caught.value) is Failure.LOCKED
            assert isinstance(second.storage_error(caught.value), DatabaseLocked)
            assert not second.in_transaction(b)  # rolled back, ready for the next one
            first.commit(a)
            second.begin_write(b)
            second.commit(b)
        finally:
            a.close()
            b.close()

    def test_a_frozen_transaction_is_ended_by_the_server(self, pg_database: PgDatabase) -> None:
        """A process stopped inside a transaction holds the lock only until idle_in_transaction_session_timeout."""
        frozen, waiting = dialect(pg_database), dialect(pg_database, busy_timeout=15)
        a, b = frozen.connect(), waiting.connect()
        try:
            frozen.begin_write(a)  # ... and never another word from this client
            started = time.monotonic()
            waiting.begin_write(b)
            waited = time.monotonic() - started
            waiting.commit(b)
            assert postgres.IDLE_IN_TRANSACTION_TIMEOUT - 0.5 < waited < postgres.IDLE_IN_TRANSACTION_TIMEOUT + 5
            with pytest.raises(psycopg.Error) as caught:
                a.execute("SELECT 1")
            assert frozen.classify(caught.value) is Failure.CONNECTION_LOST
            assert not frozen.connection_usable(a)
        finally:
            a.close()
            b.close()


class TestFaults:
    def test_a_terminated_session_is_reopened_by_the_next_transaction(self, store: Store,
                                                                      pg_database: PgDatabase) -> None:
        """The server ended our session (a restart, an administrator): the next BEGIN reconnects once, unseen."""
        old_pid = store.conn.info.backend_pid
        pg_database.rows("SELECT pg_terminate_backend(%s)", (old_pid,))
        with store.transaction() as s:
            assert s.intake(item("T1")).outcome == "accepted"
        assert store.conn.info.backend_pid != old_pid

    def test_read_only_is_classified_and_reconnects_when_writable_again(self, store: Store,
                                                                       pg_server: Any) -> None:
        """A server made read-only under a live session (25006): READ_ONLY, StorageError, then writes resume."""
        try:
            with pg_server.connect() as admin:
                admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
                admin.execute("SELECT pg_reload_conf()")
            wait_for(lambda: _read_only_now(store), 10, what="the reload to reach the session")
            with pytest.raises(StorageError, match="takes no writes"), store.transaction() as s:
                s.intake(item("R1"))
            # The connection is dropped; the writer's reconnection refuses a read-only database.
            with pytest.raises(StorageError, match="takes no writes"):
                store.connection()
        finally:
            with pg_server.connect() as admin:
                admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
                admin.execute("SELECT pg_reload_conf()")

        def writes() -> bool:
            try:
                with store.transaction() as s:
                    return s.intake(item("R1")).outcome == "accepted"
            except StorageError:
                return False

        wait_for(writes, 15, interval=0.2, what="writes after the database is writable again")

    def test_server_down_fails_at_once_and_comes_back_by_itself(self, store: Store, pg_server: Any) -> None:
        """Server stopped: every transaction fails with StorageError (quickly, backoff between attempts);
        started again: the next transactions reconnect and commit."""
        with pg_server.stopped():
            failures = []
            for _ in range(5):
                started = time.monotonic()
                with pytest.raises(StorageError) as caught, store.transaction() as s:
                    s.intake(item("D1"))
                failures.append(time.monotonic() - started)
                assert "\n" not in str(caught.value)
            assert max(failures) < 6  # connect_timeout bounds an attempt; refused is at once

        def writes() -> bool:
            try:
                with store.transaction() as s:
                    return s.intake(item("D1")).outcome == "accepted"
            except StorageError:
                return False

        wait_for(writes, 20, interval=0.1, what="a commit after the server came back")


def _read_only_now(store: Store) -> bool:
    return setting(store.conn, "default_transaction_read_only") == "on"


class TestMigrations:
    def test_several_processes_starting_at_once_migrate_once(self, pg_database: PgDatabase) -> None:
        """Eight connections open an empty database together: the lock lets one migrate, all then open it."""
        errors: list[BaseException] = []
        conns: list[Any] = []
        barrier = threading.Barrier(8)

        def start() -> None:
            d = dialect(pg_database, busy_timeout=30)
            try:
                conn = d.connect()
                barrier.wait(10)
                postgres.migrate(d, conn, AGENT, time.time())
                conns.append(conn)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=start) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for conn in conns:
            conn.close()
        assert errors == []
        meta = dict(pg_database.rows("SELECT key, value FROM meta"))
        assert meta["schema_version"] == str(postgres.SCHEMA_VERSION)
        assert meta["agent_id"] == AGENT and meta["queue_id"]

    def test_another_agent_id_is_refused(self, store: Store, pg_database: PgDatabase) -> None:
        """Two agents never share a queue: another agent.id cannot open (or operate on) it."""
        other = PostgresDialect(PgOptions(dsn=pg_database.dsn, agent_id="someone-else"), role="writer")
        with pytest.raises(IncompatibleDatabase, match="belongs to agent.id"):
            postgres.open_database(other, "someone-else", time.time())
        conn = postgres.open_existing(other)
        try:
            with pytest.raises(IncompatibleDatabase, match="belongs to agent.id"):
                postgres.check_owner(conn, other, "someone-else")
        finally:
            conn.close()

    def test_a_newer_schema_is_refused(self, store: Store, pg_database: PgDatabase) -> None:
        """A database whose min_compatible_version is above ours is refused by the daemon and the commands."""
        pg_database.rows("UPDATE meta SET value = '99' WHERE key IN ('min_compatible_version', 'schema_version')")
        with pytest.raises(IncompatibleDatabase, match="needs agent schema >= 99"):
            postgres.open_database(dialect(pg_database), AGENT, time.time())
        with pytest.raises(IncompatibleDatabase, match="needs a newer hl7-agent"):
            postgres.open_existing(dialect(pg_database, role="operator"))

    def test_a_schema_1_database_migrates_in_place(self, pg_database: PgDatabase,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """A database of the previous version gains schema 2's column and table; its rows and
        min_compatible_version stay, so that version (the other host, not upgraded yet) still opens it."""
        first = postgres.load_migrations(POSTGRESQL)[:1]
        monkeypatch.setattr(postgres, "load_migrations", lambda _dialect: first)
        monkeypatch.setattr(postgres, "SCHEMA_VERSION", 1)
        postgres.open_database(dialect(pg_database), AGENT, time.time()).close()
        pg_database.rows("INSERT INTO messages (id, channel, seq, state, remote, body, body_sha256, "
                         "received_at, updated_at) VALUES ('old-row', 'adt', 1, 'failed', 'x', '\\x00', '', 1, 1)")
        assert pg_database.rows("SELECT to_regclass('operator_actions')") == [(None,)]
        monkeypatch.undo()
        d = dialect(pg_database)
        s = store_on(d, postgres.open_database(d, AGENT, time.time()))
        try:
            meta = s.meta()
            assert (meta["schema_version"], meta["min_compatible_version"]) == (str(postgres.SCHEMA_VERSION), "1")
            row = s.row("old-row")
            assert row is not None and row.server_reason is None and row.state == "failed"
            assert pg_database.rows("SELECT count(*) FROM operator_actions") == [(0,)]
        finally:
            s.close()
        with monkeypatch.context() as m:  # the previous version still opens the migrated database
            m.setattr(postgres, "SCHEMA_VERSION", 1)
            postgres.open_existing(dialect(pg_database, role="operator")).close()

    def test_operator_commands_on_a_schema_1_database(self, pg_database: PgDatabase, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
        """Its daemon not upgraded yet: a read command says what to do, a write command migrates first."""
        from types import SimpleNamespace

        from agent.storage.store import open_operator_store

        first = postgres.load_migrations(POSTGRESQL)[:1]
        with monkeypatch.context() as m:
            m.setattr(postgres, "load_migrations", lambda _dialect: first)
            m.setattr(postgres, "SCHEMA_VERSION", 1)
            postgres.open_database(dialect(pg_database), AGENT, time.time()).close()
        queue = SimpleNamespace(backend="postgresql", dsn=pg_database.dsn, password_file=None,
                                synchronous="full", busy_timeout=5.0, dedupe_window=86400.0,
                                retention=86400.0, max_db_bytes=0, min_free_disk_bytes=0)
        with pytest.raises(StorageError, match=f"has schema 1, this hl7-agent reads schema {postgres.SCHEMA_VERSION}: start this"), \
                open_operator_store(tmp_path / "q.db", queue, AGENT, write=False):
            pass
        assert pg_database.rows("SELECT value FROM meta WHERE key = 'schema_version'") == [("1",)]
        with open_operator_store(tmp_path / "q.db", queue, AGENT, write=True) as s:
            assert s.meta()["schema_version"] == str(postgres.SCHEMA_VERSION)
        with open_operator_store(tmp_path / "q.db", queue, AGENT, write=False) as s:
            assert s.live_depth() == 0

    def test_later_migrations_are_additive(self) -> None:
        """Every migration after the first only adds (new tables, indexes, nullable columns) or drops
        an index that enforced nothing (it only changes plans), so the previous version keeps
        working on a migrated database while both run."""
        allowed = re.compile(r"\s*(CREATE TABLE|CREATE INDEX|CREATE UNIQUE INDEX|ALTER TABLE \w+ ADD COLUMN"
                             r"|DROP INDEX IF EXISTS \w+)\b")
        unique: set[str] = set()
        for number, sql in postgres.load_migrations(POSTGRESQL):
            body = "\n".join(ln for ln in sql.splitlines() if not ln.strip().startswith("--"))
            for statement in filter(str.strip, body.split(";")):
                unique.update(re.findall(r"CREATE UNIQUE INDEX (\w+)", statement))
                if number == 1:
                    continue
                assert allowed.match(statement), (number, statement)
                if "ADD COLUMN" in statement:
                    assert "NOT NULL" not in statement or "DEFAULT" in statement, (number, statement)
                dropped = re.findall(r"DROP INDEX IF EXISTS (\w+)", statement)
                assert not set(dropped) & unique, (number, statement)  # a unique index is a constraint

    def test_commands_never_create_the_schema(self, pg_database: PgDatabase) -> None:
        """open_existing on a database without the agent's tables says so and creates nothing."""
        with pytest.raises(StorageError, match="holds no hl7-agent queue"):
            postgres.open_existing(dialect(pg_database, role="operator"))
        assert pg_database.rows("SELECT to_regclass('meta')") == [(None,)]
