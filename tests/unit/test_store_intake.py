"""Store-level intake on a real SQLite file: seq, dedupe, audit rows, backpressure, ownership (SPEC 4 and 6).

No sockets and no event loop: ``SqliteStore`` runs inside transactions its
caller opens, so each test drives it through ``store.transaction()`` or the
real group-commit ``Writer`` thread, with a controllable clock.
"""

from __future__ import annotations

import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.errors import IncompatibleDatabase, StorageError
from agent.storage import maintenance
from agent.storage import sqlite as db
from agent.storage.store import AuditItem, IntakeItem, IntakeResult, SqliteStore
from agent.storage.writer import Writer

DAY = 86400.0
T0 = 1_800_000_000.0


class Clock:
    """A settable clock: tests move time instead of waiting for it."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def message(cid: str, *, pid: str = "1", app: str = "LAB", pad: int = 0) -> bytes:
    return (f"MSH|^~\\&|{app}|NORTH|EHR|CENTRAL|20260101||ADT^A01|{cid}|P|2.5.1\r"
            f"PID|1||{pid}{'X' * pad}\r").encode()


def item(cid: str, *, body: bytes | None = None, channel: str = "adt", app: str = "LAB",
         received_at: float = T0) -> IntakeItem:
    return IntakeItem(
        channel=channel, remote="127.0.0.1:1", sending_app=app, sending_facility="NORTH",
        control_id=cid, message_type="ADT^A01", body=body if body is not None else message(cid, app=app),
        encoding="utf-8", ack_mode="commit", commit_ack=f"ACK-FOR-{cid}".encode(), received_at=received_at,
    )


def open_store(path: Path, clock: Clock, **options: Any) -> SqliteStore:
    conn = db.open_database(path, "unit-agent", db.DatabaseOptions(), clock())
    kwargs: dict[str, Any] = {"dedupe_window": 7 * DAY, "retention": 30 * DAY, "max_db_bytes": 0,
                              "min_free_disk_bytes": 0}
    kwargs.update(options)
    return SqliteStore(conn, db.load_queries(), db_path=path, clock=clock, **kwargs)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[SqliteStore]:
    s = open_store(tmp_path / "data" / "queue.db", clock)
    try:
        yield s
    finally:
        s.conn.close()


def intake(store: SqliteStore, it: IntakeItem) -> IntakeResult:
    with store.transaction() as s:
        return s.intake(it)


def rows(store: SqliteStore, where: str = "1") -> list[tuple[Any, ...]]:
    return store.conn.execute(
        f"SELECT control_id, state, seq, body FROM messages WHERE {where} ORDER BY rowid"  # noqa: S608
    ).fetchall()


def last_seq(store: SqliteStore, channel: str = "adt") -> int | None:
    row = store.conn.execute("SELECT last_seq FROM channels WHERE channel = ?", (channel,)).fetchone()
    return None if row is None else int(row[0])


class TestSequence:
    def test_seq_counts_queued_inserts_per_channel(self, store: SqliteStore) -> None:
        """Each queued insert takes the next seq of its own channel, starting at 1."""
        results = [intake(store, item(f"A{n}")) for n in range(3)]
        other = intake(store, item("B0", channel="lab"))
        assert [r.seq for r in results] == [1, 2, 3]
        assert other.seq == 1
        assert (last_seq(store), last_seq(store, "lab")) == (3, 1)

    def test_audit_duplicate_and_conflict_never_advance_seq(self, store: SqliteStore) -> None:
        """Nacked audit rows, duplicates and conflicts take no seq and leave the counter alone."""
        intake(store, item("A1"))
        with store.transaction() as s:
            s.record_audit(AuditItem("adt", "127.0.0.1:1", b"garbage", "100", "no MSH segment"))
        assert intake(store, item("A1")).outcome == "duplicate"
        assert intake(store, item("A1", body=message("A1", pid="other"))).outcome == "conflict"
        assert last_seq(store) == 1
        assert intake(store, item("A2")).seq == 2
        assert [r[2] for r in rows(store, "state = 'nacked'")] == [None]

    def test_seq_advances_in_the_inserts_transaction(self, store: SqliteStore) -> None:
        """A rolled-back intake leaves neither a row nor a used seq: the next message gets the same seq."""
        intake(store, item("A1"))
        def doomed() -> None:
            with store.transaction() as s:
                assert s.intake(item("A2")).seq == 2
                raise RuntimeError("commit never happens")

        with pytest.raises(RuntimeError):
            doomed()
        assert last_seq(store) == 1
        assert rows(store, "control_id = 'A2'") == []
        assert intake(store, item("A3")).seq == 2

    def test_seq_is_shared_by_two_connections_on_one_file(self, tmp_path: Path, clock: Clock) -> None:
        """Two processes' stores on one file (upgrade overlap) never hand out the same seq."""
        path = tmp_path / "data" / "queue.db"
        first, second = open_store(path, clock), open_store(path, clock)
        try:
            seqs = [intake(first if n % 2 else second, item(f"O{n}")).seq for n in range(10)]
        finally:
            first.conn.close()
            second.conn.close()
        assert seqs == list(range(1, 11))


class TestDedupe:
    def test_identical_retransmit_is_a_duplicate_with_the_first_ack(self, store: SqliteStore) -> None:
        """Identical bytes on the same key: no new row, the original id and its commit ACK come back."""
        first = intake(store, item("D1"))
        again = intake(store, item("D1"))
        assert again.outcome == "duplicate"
        assert again.message_id == first.message_id
        assert again.commit_ack == b"ACK-FOR-D1"
        assert again.prior_state == "queued"
        assert len(rows(store)) == 1

    def test_key_includes_sending_application(self, store: SqliteStore) -> None:
        """The same MSH-10 from another sending application (MSH-3) is another message."""
        assert intake(store, item("K1", app="LAB")).outcome == "accepted"
        assert intake(store, item("K1", app="RIS")).outcome == "accepted"

    def test_two_identical_items_in_one_writer_batch_make_one_row(self, store: SqliteStore) -> None:
        """Duplicates within one group-commit batch are caught: one row, and the second gets the first's ACK."""
        writer = Writer(store)
        writer.start()
        gate = threading.Event()
        try:
            blocker = writer.submit(lambda s: gate.wait(10))  # holds the thread so both land in the next batch
            first = writer.submit(lambda s: (writer.batches, s.intake(item("B1"))))
            second = writer.submit(lambda s: (writer.batches, s.intake(item("B1"))))
            gate.set()
            blocker.result(10)
            (batch_a, result_a), (batch_b, result_b) = first.result(10), second.result(10)
        finally:
            writer.close()
        assert batch_a == batch_b  # no commit between them: one batch
        assert result_a.outcome == "accepted"
        assert result_b.outcome == "duplicate"
        assert result_b.message_id == result_a.message_id
        assert result_b.commit_ack == b"ACK-FOR-B1"  # the first item's commit ACK
        conn = sqlite3.connect(store.db_path)
        try:
            assert conn.execute("SELECT count(*) FROM messages WHERE control_id = 'B1'").fetchone() == (1,)
        finally:
            conn.close()

    def test_conflict_rows_are_audited_and_never_priors(self, store: SqliteStore) -> None:
        """A reused control id with another body is a conflict against the original; its nacked audit row never becomes a prior."""
        original = intake(store, item("C1"))
        impostor_body = message("C1", pid="impostor")
        conflict = intake(store, item("C1", body=impostor_body))
        assert conflict.outcome == "conflict"
        assert conflict.message_id == original.message_id
        with store.transaction() as s:
            s.record_audit(AuditItem("adt", "127.0.0.1:1", impostor_body, "205", "duplicate key",
                                     sending_app="LAB", sending_facility="NORTH", control_id="C1"))
        # The impostor again: still a conflict (its audit row is no prior), the original still a duplicate.
        assert intake(store, item("C1", body=impostor_body)).outcome == "conflict"
        assert intake(store, item("C1")).outcome == "duplicate"
        assert [(r[1], r[3]) for r in rows(store, "control_id = 'C1'")] == [
            ("queued", message("C1")), ("nacked", impostor_body)]

    def test_an_audit_row_alone_does_not_block_the_key(self, store: SqliteStore) -> None:
        """A control id first seen in a refused frame (nacked) is accepted when it later arrives well-formed."""
        with store.transaction() as s:
            s.record_audit(AuditItem("adt", "127.0.0.1:1", b"MSH|bad", "102", "bad",
                                     sending_app="LAB", sending_facility="NORTH", control_id="N1"))
        assert intake(store, item("N1")).outcome == "accepted"

    def test_key_outlives_its_purged_row_until_dedupe_window(self, store: SqliteStore, clock: Clock) -> None:
        """Purging the row keeps the key: a retransmit within dedupe_window still replays; after it, it is new."""
        first = intake(store, item("P1"))
        with store.transaction() as s:
            s.conn.execute("UPDATE messages SET state = 'processed', updated_at = ? WHERE id = ?",
                           (clock(), first.message_id))
            assert maintenance.enforce_size_cap(s) == 0  # no cap configured: nothing purged this way
            s.conn.execute("DELETE FROM messages WHERE id = ?", (first.message_id,))  # operator purge
        clock.now += 6 * DAY
        with store.transaction() as s:
            maintenance.purge_retention(s, clock())
        replay = intake(store, item("P1"))
        assert (replay.outcome, replay.message_id, replay.commit_ack) == ("duplicate", first.message_id,
                                                                          b"ACK-FOR-P1")
        assert rows(store) == []
        clock.now += 1.5 * DAY  # past the 7-day window
        with store.transaction() as s:
            maintenance.purge_retention(s, clock())
        assert store.conn.execute("SELECT count(*) FROM dedupe_keys").fetchone() == (0,)
        fresh = intake(store, item("P1"))
        assert fresh.outcome == "accepted"
        assert fresh.seq == 2

    def test_expired_key_is_ignored_even_before_it_is_purged(self, store: SqliteStore, clock: Clock) -> None:
        """A key past its expiry no longer dedupes, whether or not the sweep has run."""
        intake(store, item("E1"))
        clock.now += 7 * DAY + 1
        assert intake(store, item("E1")).outcome == "accepted"


class TestBackpressure:
    def _fill(self, store: SqliteStore, clock: Clock, prefix: str, limit: int = 2000) -> list[str]:
        accepted = []
        for n in range(limit):
            clock.now += 1  # past the 0.5 s check throttle
            result = intake(store, item(f"{prefix}{n}", body=message(f"{prefix}{n}", pad=4000)))
            if result.outcome == "backpressure":
                return accepted
            assert result.outcome == "accepted"
            accepted.append(result.message_id)
        raise AssertionError("max_db_bytes never refused")

    def test_purges_processed_rows_first_then_refuses(self, tmp_path: Path, clock: Clock) -> None:
        """Over max_db_bytes intake purges processed/nacked rows and goes on; with only live rows left it refuses."""
        store = open_store(tmp_path / "data" / "queue.db", clock, max_db_bytes=256 * 1024)
        try:
            first_fill = self._fill(store, clock, "F")
            assert len(first_fill) >= 10
            assert store.conn.execute("SELECT count(*) FROM messages").fetchone() == (len(first_fill),)
            # Refused messages left no row and took no seq.
            assert last_seq(store) == len(first_fill)
            with store.transaction() as s:
                s.conn.execute("UPDATE messages SET state = 'processed'")
                s.record_audit(AuditItem("adt", "127.0.0.1:1", b"x" * 100, "100", "no MSH segment"))
            clock.now += 1
            result = intake(store, item("AFTER", body=message("AFTER", pad=4000)))
            assert result.outcome == "accepted"
            states = dict(store.conn.execute("SELECT state, count(*) FROM messages GROUP BY state").fetchall())
            assert states.get("queued") == 1
            assert states.get("processed", 0) < len(first_fill)  # the purge made room
            second_fill = self._fill(store, clock, "S")
            queued = store.conn.execute("SELECT count(*) FROM messages WHERE state = 'queued'").fetchone()[0]
            assert queued == 1 + len(second_fill)  # no live row was purged to make room
            assert store.conn.execute("SELECT count(*) FROM messages WHERE state = 'processed'").fetchone() == (0,)
        finally:
            store.conn.close()

    def test_failed_rows_are_never_purged_for_room(self, tmp_path: Path, clock: Clock) -> None:
        """Backpressure keeps failed rows (undelivered messages): it refuses instead of purging them."""
        store = open_store(tmp_path / "data" / "queue.db", clock, max_db_bytes=192 * 1024)
        try:
            filled = self._fill(store, clock, "F")
            with store.transaction() as s:
                s.conn.execute("UPDATE messages SET state = 'failed'")
            clock.now += 1
            assert intake(store, item("X", body=message("X", pad=4000))).outcome == "backpressure"
            assert store.conn.execute("SELECT count(*) FROM messages WHERE state = 'failed'").fetchone() == (
                len(filled),)
        finally:
            store.conn.close()

    def test_readiness_fails_while_intake_refuses_short_messages(self, tmp_path: Path, clock: Clock) -> None:
        """/readyz's probe and the backpressure log ask room for a short message, not for none.

        Intake charges each message its pages too, so a file with a few KiB
        left refuses every message while room for zero bytes is still there.
        """
        store = open_store(tmp_path / "data" / "queue.db", clock, max_db_bytes=192 * 1024)
        try:
            self._fill(store, clock, "F")
            clock.now += 1
            assert intake(store, item("S", body=message("S"))).outcome == "backpressure"
            assert maintenance.pressure(store) == "the queue database is at queue.max_db_bytes"
            with pytest.raises(StorageError, match="backpressure: the queue database is at queue.max_db_bytes"):
                store.probe_write()
            # Room comes back (the live rows were delivered and purged): ready again.
            with store.transaction() as s:
                s.conn.execute("UPDATE messages SET state = 'processed'")
            clock.now += 10 * 86400
            store.probe_write()
            assert maintenance.pressure(store) is None
            assert intake(store, item("T", body=message("T"))).outcome == "accepted"
        finally:
            store.conn.close()

    def test_readiness_fails_while_messages_of_the_size_refused_still_would_be(
            self, tmp_path: Path, clock: Clock) -> None:
        """Room for a short message is not readiness while the messages senders send are refused.

        A 4 KB message refused for room keeps the probe failing for as long
        as one of its size would still be refused (up to REFUSAL_SHOWN_S),
        though a short one still fits; room for it, or an accepted message as
        large, ends that.
        """
        store = open_store(tmp_path / "data" / "queue.db", clock, max_db_bytes=192 * 1024)
        try:
            self._fill(store, clock, "F")  # ends with a 4 KB message refused
            store.space.max_db_bytes = maintenance.used_bytes(store) + maintenance.intake_cost(store, 1024)
            clock.now += 1
            assert intake(store, item("SHORT", body=message("SHORT"))).outcome == "accepted"
            assert intake(store, item("BIG", body=message("BIG", pad=4000))).outcome == "backpressure"
            assert maintenance.pressure(store) is None  # a short message would still fit
            with pytest.raises(StorageError, match="backpressure: the queue database is at queue.max_db_bytes"):
                store.probe_write()
            # Still refused long after, it still counts; forgotten once REFUSAL_SHOWN_S has passed.
            store.space.refused_at -= maintenance.REFUSAL_SHOWN_S - 5
            with pytest.raises(StorageError, match="backpressure"):
                store.probe_write()
            store.space.refused_at -= 10
            store.probe_write()
            # A fresh refusal; then room for it (a higher cap): ready again, and it stays so.
            assert intake(store, item("BIG2", body=message("BIG2", pad=4000))).outcome == "backpressure"
            with pytest.raises(StorageError, match="backpressure"):
                store.probe_write()
            store.space.max_db_bytes *= 2
            store.probe_write()
            store.space.max_db_bytes //= 2
            store.probe_write()  # the refusal was answered: room for it came back once
            # A refusal, then an accepted message as large as the refused one: it fits, so ready.
            assert intake(store, item("BIG3", body=message("BIG3", pad=4000))).outcome == "backpressure"
            store.space.max_db_bytes *= 2
            clock.now += 1
            assert intake(store, item("BIG4", body=message("BIG4", pad=4000))).outcome == "accepted"
            store.space.max_db_bytes //= 2
            assert store.space.refused_cost == 0
        finally:
            store.conn.close()

    def test_a_batch_is_charged_as_one_commit_not_member_by_member(self, tmp_path: Path, clock: Clock) -> None:
        """200 small members in one commit fit a 1 MiB cap on an empty file (charged 12 pages each: 9.6 MB, refused for ever)."""
        store = open_store(tmp_path / "data" / "queue.db", clock, max_db_bytes=1024 * 1024)
        try:
            with store.transaction() as s:
                results = s.intake_batch([item(f"B{n}") for n in range(200)])
            assert {r.outcome for r in results} == {"accepted"}
            assert maintenance.used_bytes(store) <= 1024 * 1024
        finally:
            store.conn.close()

    @pytest.mark.parametrize(("members", "pad"), [(1, 50), (50, 50), (50, 2100), (20, 10_000)])
    def test_a_groups_charge_covers_what_its_commit_writes(self, tmp_path: Path, clock: Clock,
                                                            members: int, pad: int) -> None:
        """group_cost is an over-estimate: at least the file's growth plus the WAL the commit wrote."""
        store = open_store(tmp_path / "data" / "queue.db", clock, min_free_disk_bytes=1)
        try:
            for n in range(100):  # a file with some rows already, as in service
                intake(store, item(f"W{n}", body=message(f"W{n}", pad=pad)))
            store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            pages = store.conn.execute("PRAGMA page_count").fetchone()[0]
            batch = [item(f"G{n}", body=message(f"G{n}", pad=pad)) for n in range(members)]
            charged = maintenance.group_cost(store, [len(i.body) + len(i.commit_ack or b"") for i in batch])
            with store.transaction() as s:
                assert {r.outcome for r in s.intake_batch(batch)} == {"accepted"}
            wal = (tmp_path / "data" / "queue.db-wal").stat().st_size
            grown = (store.conn.execute("PRAGMA page_count").fetchone()[0] - pages) * maintenance.page_size(store)
            assert grown + wal <= charged, (grown, wal, charged)
        finally:
            store.conn.close()

    def test_duplicates_are_answered_under_backpressure(self, tmp_path: Path, clock: Clock) -> None:
        """A retransmit of a stored message still gets its replay when the queue is full."""
        store = open_store(tmp_path / "data" / "queue.db", clock, max_db_bytes=192 * 1024)
        try:
            self._fill(store, clock, "F")
            clock.now += 1
            again = intake(store, item("F0", body=message("F0", pad=4000)))
            assert again.outcome == "duplicate"
        finally:
            store.conn.close()


class TestDatabaseFile:
    def test_file_modes(self, tmp_path: Path, clock: Clock) -> None:
        """The data dir is 0700 and queue.db with its -wal and -shm files are 0600."""
        path = tmp_path / "data" / "queue.db"
        store = open_store(path, clock)
        try:
            intake(store, item("M1"))
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            for name in ("queue.db", "queue.db-wal", "queue.db-shm"):
                assert stat.S_IMODE((path.parent / name).stat().st_mode) == 0o600, name
        finally:
            store.conn.close()

    def test_existing_data_dir_is_tightened_to_0700(self, tmp_path: Path, clock: Clock) -> None:
        """A data dir created beforehand with looser permissions is made 0700."""
        data = tmp_path / "data"
        data.mkdir(mode=0o755)
        data.chmod(0o755)
        open_store(data / "queue.db", clock).conn.close()
        assert stat.S_IMODE(data.stat().st_mode) == 0o700

    def test_another_agent_id_refuses_to_open(self, tmp_path: Path) -> None:
        """A database created by one agent.id is refused to another, with both ids in the message."""
        path = tmp_path / "data" / "queue.db"
        db.open_database(path, "edge-01", db.DatabaseOptions(), T0).close()
        with pytest.raises(IncompatibleDatabase, match=r"edge-01.*edge-02"):
            db.open_database(path, "edge-02", db.DatabaseOptions(), T0)
        db.open_database(path, "edge-01", db.DatabaseOptions(), T0).close()  # the owner still opens it

    def test_newer_min_compatible_version_refuses_to_open(self, tmp_path: Path) -> None:
        """A file whose min_compatible_version is above our schema is refused by the daemon and by operator commands."""
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "edge-01", db.DatabaseOptions(), T0)
        conn.execute("UPDATE meta SET value = ? WHERE key = 'min_compatible_version'",
                     (str(db.SCHEMA_VERSION + 1),))
        conn.close()
        with pytest.raises(IncompatibleDatabase):
            db.open_database(path, "edge-01", db.DatabaseOptions(), T0)
        with pytest.raises(IncompatibleDatabase):
            db.open_existing(path, db.DatabaseOptions())

    def test_newer_schema_still_compatible_opens(self, tmp_path: Path) -> None:
        """A newer schema_version whose min_compatible_version is ours opens (upgrade overlap, SPEC 6)."""
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "edge-01", db.DatabaseOptions(), T0)
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(db.SCHEMA_VERSION + 1),))
        conn.close()
        db.open_database(path, "edge-01", db.DatabaseOptions(), T0).close()
        version = sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        assert version == (str(db.SCHEMA_VERSION + 1),)  # never downgraded


class TestWriterThread:
    def test_a_failing_log_stream_never_strands_a_caller(self, tmp_path: Path, clock: Clock,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
        """When the commit fails and logging it raises too (EPIPE), the caller still gets a StorageError and the thread goes on."""
        from agent.errors import StorageError
        from agent.storage import writer as writer_module

        class BrokenLog:
            def error(self, *args: Any, **kwargs: Any) -> None:
                raise BrokenPipeError("log reader gone")

        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "unit-agent", db.DatabaseOptions(busy_timeout=0.05), clock())
        store = SqliteStore(conn, db.load_queries(), db_path=path, clock=clock, min_free_disk_bytes=0)
        writer = Writer(store)
        writer.start()
        monkeypatch.setattr(writer_module, "log", BrokenLog())
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            failed = writer.submit(lambda s: s.intake(item("W1")))
            with pytest.raises(StorageError):
                failed.result(10)
            holder.execute("ROLLBACK")
            assert writer.submit(lambda s: s.intake(item("W2"))).result(10).outcome == "accepted"
        finally:
            holder.close()
            writer.close()
