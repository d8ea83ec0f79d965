"""``intake_batch``: a group of messages queued all or none, deduped against the table and each other.

A real SQLite file in ``tmp_path``; each test drives the store through
``store.transaction()`` (or the writer thread), with a clock it moves.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent.errors import StorageError
from agent.storage import sqlite as db
from agent.storage.store import IntakeItem, SqliteStore
from agent.storage.writer import Writer

T0 = 1_800_000_000.0


def message(cid: str, *, pid: str = "1", pad: int = 0) -> bytes:
    return (f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|{cid}|P|2.5.1\r"
            f"PID|1||{pid}{'X' * pad}\r").encode()


def item(cid: str, *, body: bytes | None = None, channel: str = "adt", **fields: Any) -> IntakeItem:
    return IntakeItem(
        channel=channel, remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
        control_id=cid, message_type="ADT^A01", body=body if body is not None else message(cid),
        encoding="utf-8", ack_mode="commit", commit_ack=f"ACK-FOR-{cid}".encode(), received_at=T0,
        **fields,
    )


def open_store(path: Path, **options: Any) -> SqliteStore:
    conn = db.open_database(path, "batch-agent", db.DatabaseOptions(), T0)
    return SqliteStore(conn, db.load_queries(), db_path=path, clock=lambda: T0, **options)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = open_store(tmp_path / "data" / "queue.db")
    try:
        yield s
    finally:
        s.close()


def rows(store: SqliteStore) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(store.db_path)
    try:
        return conn.execute("SELECT control_id, state, seq FROM messages ORDER BY rowid").fetchall()
    finally:
        conn.close()


class TestGroups:
    def test_a_group_is_queued_in_order_with_consecutive_seq(self, store: SqliteStore) -> None:
        """Three new messages: three accepted rows, seq 1, 2, 3 in the group's order."""
        with store.transaction() as s:
            results = s.intake_batch([item("G1"), item("G2"), item("G3")])
        assert [(r.outcome, r.seq) for r in results] == [("accepted", 1), ("accepted", 2), ("accepted", 3)]
        assert rows(store) == [("G1", "queued", 1), ("G2", "queued", 2), ("G3", "queued", 3)]

    def test_duplicates_and_conflicts_within_the_group(self, store: SqliteStore) -> None:
        """The same key twice in one group: identical bytes replay the first, other bytes conflict with it."""
        first = item("D1")
        with store.transaction() as s:
            results = s.intake_batch([first, item("D2"), first, item("D1", body=message("D1", pid="other"))])
        assert [r.outcome for r in results] == ["accepted", "accepted", "duplicate", "conflict"]
        assert results[2].message_id == results[0].message_id
        assert results[2].commit_ack == b"ACK-FOR-D1"
        assert results[3].message_id == results[0].message_id
        assert rows(store) == [("D1", "queued", 1), ("D2", "queued", 2)]

    def test_duplicates_against_the_table(self, store: SqliteStore) -> None:
        """A group member already queued by an earlier commit is a duplicate; the rest are queued."""
        with store.transaction() as s:
            old = s.intake(item("T1"))
        with store.transaction() as s:
            results = s.intake_batch([item("T2"), item("T1")])
        assert [r.outcome for r in results] == ["accepted", "duplicate"]
        assert results[1].message_id == old.message_id and results[1].prior_state == "queued"

    def test_an_empty_group_does_nothing(self, store: SqliteStore) -> None:
        """No items, no results, no rows."""
        with store.transaction() as s:
            assert s.intake_batch([]) == []
        assert rows(store) == []

    def test_a_failing_member_takes_the_whole_group_with_it(self, store: SqliteStore) -> None:
        """One insert the database refuses (a CHECK) rolls back the group's other rows, not the transaction's."""
        bad = replace(item("F2"), ack_mode="bogus")  # type: ignore[arg-type]  # a value the schema refuses
        with store.transaction() as s:
            with pytest.raises(sqlite3.IntegrityError):
                s.intake_batch([item("F1"), bad, item("F3")])
            assert s.intake(item("AFTER")).seq == 1  # the group's seq was given back too
        assert rows(store) == [("AFTER", "queued", 1)]

    def test_a_failing_group_in_the_writer_spares_its_neighbours(self, store: SqliteStore) -> None:
        """Through the writer: the group's caller gets StorageError, a job of the same batch commits."""
        bad = replace(item("W2"), ack_mode="bogus")  # type: ignore[arg-type]
        writer = Writer(store)
        writer.start()
        try:
            group = writer.submit(SqliteStore.intake_batch, [item("W1"), bad])
            single = writer.submit(SqliteStore.intake, item("W3"))
            with pytest.raises(StorageError):
                group.result(10)
            assert single.result(10).outcome == "accepted"
        finally:
            writer.close()
        assert rows(store) == [("W3", "queued", 1)]


class TestGroupBackpressure:
    def _fill(self, store: SqliteStore, limit: int = 2000) -> int:
        for n in range(limit):
            with store.transaction() as s:
                if s.intake(item(f"F{n}", body=message(f"F{n}", pad=4000))).outcome == "backpressure":
                    return n
        raise AssertionError("max_db_bytes never refused")

    def test_the_group_is_refused_whole_when_it_does_not_fit(self, tmp_path: Path) -> None:
        """Each big member would fit alone, the group does not: every new member is refused, none queued.

        A member already stored is still answered as a duplicate.
        """
        path = tmp_path / "data" / "queue.db"
        store = open_store(path, max_db_bytes=288 * 1024)
        try:
            self._fill(store)
            with store.transaction() as s:
                s.conn.execute("UPDATE messages SET state = 'processed'")  # all purgeable for room
            big = [item(f"B{n}", body=message(f"B{n}", pad=60_000)) for n in range(6)]
            with store.transaction() as s:
                results = s.intake_batch([*big, item("F1", body=message("F1", pad=4000))])
            assert [r.outcome for r in results] == ["backpressure"] * 6 + ["duplicate"]
            assert not any(cid.startswith("B") for cid, _state, _seq in rows(store))
            with store.transaction() as s:
                assert s.intake_batch(big[:1])[0].outcome == "accepted"  # alone, one fits
        finally:
            store.close()


class TestCommitBatch:
    """Several groups in one commit batch: the answers of taking them one after another."""

    def test_groups_of_one_run_dedupe_each_other_and_share_the_seq_advance(self, store: SqliteStore) -> None:
        """A key queued by an earlier group of the run is a duplicate (or a conflict) in a later one."""
        with store.transaction() as s:
            old = s.intake(item("OLD"))
        other = item("A", body=message("A", pid="other"))
        with store.transaction() as s:
            out = s.intake_groups([[item("A")], [item("A"), item("B")], [other, item("OLD"), item("C")]])
        flat = [(r.outcome, r.seq) for group in out for r in group]
        assert flat == [("accepted", 2), ("duplicate", None), ("accepted", 3),
                        ("conflict", None), ("duplicate", None), ("accepted", 4)]
        assert out[1][0].message_id == out[0][0].message_id and out[1][0].commit_ack == b"ACK-FOR-A"
        assert out[1][0].prior_state == "queued"
        assert out[2][0].message_id == out[0][0].message_id
        assert out[2][1].message_id == old.message_id
        assert rows(store) == [("OLD", "queued", 1), ("A", "queued", 2), ("B", "queued", 3), ("C", "queued", 4)]

    def test_each_channel_takes_its_own_consecutive_seqs(self, store: SqliteStore) -> None:
        """Interleaved channels in one run: each channel's rows are numbered in arrival order."""
        with store.transaction() as s:
            out = s.intake_groups([[item("X1", channel="x")], [item("Y1", channel="y")],
                                   [item("X2", channel="x"), item("Y2", channel="y")]])
        assert [r.seq for group in out for r in group] == [1, 1, 2, 2]

    def test_writer_intake_a_bad_group_spares_the_groups_of_its_batch(self, store: SqliteStore) -> None:
        """The hot path (``Writer.intake``): one batch, one group the schema refuses, the others commit.

        A job holding the writer thread makes sure the three groups land in one batch.
        """
        bad = replace(item("W2"), ack_mode="bogus")  # type: ignore[arg-type]  # a value the schema refuses
        writer = Writer(store)
        writer.start()

        async def run() -> list[tuple[list[Any] | None, BaseException | None]]:
            loop = asyncio.get_running_loop()
            answers: list[asyncio.Future[tuple[list[Any] | None, BaseException | None]]] = []
            started, gate = threading.Event(), threading.Event()

            def hold(_store: SqliteStore) -> None:
                started.set()
                gate.wait(10)

            held = writer.submit(hold)
            assert await asyncio.to_thread(started.wait, 10)
            for group in ([item("W1")], [bad, item("W3")], [item("W4"), item("W1")]):
                answer = loop.create_future()
                answers.append(answer)
                writer.intake(group, lambda results, error, answer=answer: answer.set_result((results, error)))
            batches = writer.batches
            gate.set()
            await asyncio.wrap_future(held)
            got = [await a for a in answers]
            assert writer.batches == batches + 2  # the held job's commit, then one for the three groups
            return got

        try:
            (first, e1), (second, e2), (third, e3) = asyncio.run(run())
        finally:
            writer.close()
        assert e1 is None and first is not None and first[0].outcome == "accepted"
        assert isinstance(e2, StorageError) and second is None
        assert e3 is None and third is not None
        assert [r.outcome for r in third] == ["accepted", "duplicate"]
        assert rows(store) == [("W1", "queued", 1), ("W4", "queued", 2)]


class TestPlainBatch:
    """The common batch — intake groups and ACK outcomes only — runs without savepoints."""

    def _run(self, store: SqliteStore, groups: list[list[IntakeItem]]
             ) -> tuple[list[str], list[tuple[list[Any] | None, BaseException | None]]]:
        """One writer batch of ``groups`` (held back until all are queued); the statements it ran."""
        statements: list[str] = []
        writer = Writer(store)
        writer.start()

        async def run() -> list[tuple[list[Any] | None, BaseException | None]]:
            loop = asyncio.get_running_loop()
            started, gate = threading.Event(), threading.Event()

            def hold(_store: SqliteStore) -> None:
                started.set()
                gate.wait(10)

            held = writer.submit(hold)
            assert await asyncio.to_thread(started.wait, 10)
            answers: list[asyncio.Future[tuple[list[Any] | None, BaseException | None]]] = []
            for group in groups:
                answer = loop.create_future()
                answers.append(answer)
                writer.intake(group, lambda results, error, answer=answer: answer.set_result((results, error)))
            store.conn.set_trace_callback(statements.append)  # the writer thread waits in ``hold``
            gate.set()
            await asyncio.wrap_future(held)
            return [await a for a in answers]

        try:
            answers = asyncio.run(run())
        finally:
            store.conn.set_trace_callback(None)
            writer.close()
        # What ran after the held job's batch committed (it took the deferred outcomes along).
        assert "COMMIT" in statements, statements
        return statements[statements.index("COMMIT") + 1:], answers

    def test_an_intake_batch_takes_no_savepoint(self, store: SqliteStore) -> None:
        statements, answers = self._run(store, [[item("P1")], [item("P2"), item("P3")]])
        assert all(error is None for _, error in answers), answers
        assert statements[0].startswith("BEGIN") and statements[-1] == "COMMIT", statements
        assert not [s for s in statements if s.lstrip().upper().startswith(("SAVEPOINT", "RELEASE"))], statements
        assert rows(store) == [("P1", "queued", 1), ("P2", "queued", 2), ("P3", "queued", 3)]

    def test_a_failing_group_is_found_the_careful_way(self, store: SqliteStore) -> None:
        """The plain run fails: rolled back, taken again with savepoints, the others still commit."""
        bad = replace(item("B2"), ack_mode="bogus")  # type: ignore[arg-type]  # a value the schema refuses
        statements, answers = self._run(store, [[item("B1")], [bad], [item("B3")]])
        assert [error is None for _, error in answers] == [True, False, True]
        assert isinstance(answers[1][1], StorageError)
        assert any(s.upper().startswith("ROLLBACK") for s in statements)
        assert rows(store) == [("B1", "queued", 1), ("B3", "queued", 2)]
