"""The writer thread's deferred bookkeeping: never a commit of its own while traffic flows."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agenttest import wait_for

from agent.storage import checkpoints
from agent.storage import sqlite as db
from agent.storage.store import IntakeItem, SqliteStore
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


def _holding() -> tuple[threading.Event, threading.Event, object]:
    """A job that holds the writer thread inside its batch until ``gate`` is set."""
    started, gate = threading.Event(), threading.Event()

    def hold(store: SqliteStore) -> None:
        started.set()
        gate.wait(10)

    return started, gate, hold


class TestLateJoiners:
    """Jobs that arrive while a batch runs its statements join that batch's COMMIT."""

    def test_a_job_queued_while_a_batch_runs_commits_with_it(self, writer: Writer) -> None:
        """A dispatch settle that arrives mid-batch waits for the commit under way, not for a whole next batch."""
        started, gate, hold = _holding()
        before = writer.batches
        held = writer.submit(hold)  # type: ignore[arg-type]
        assert started.wait(10)
        late = writer.submit(_set_meta("late", "1"))
        gate.set()
        late.result(10)
        held.result(10)
        assert writer.batches == before + 1
        assert writer.submit(lambda s: _meta(s, "late")).result(5) == "1"

    def test_an_intake_group_queued_meanwhile_waits_for_the_next_batch_and_keeps_its_order(
        self, writer: Writer
    ) -> None:
        """Intake groups are not taken late: they start the next batch, in the order they came."""
        started, gate, hold = _holding()

        def intake_item(cid: str) -> IntakeItem:
            body = f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|{cid}|P|2.5.1\r".encode()
            return IntakeItem(channel="adt", remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
                              control_id=cid, message_type="ADT^A01", body=body, encoding="utf-8",
                              ack_mode="commit", commit_ack=b"ACK", received_at=time.time())

        async def run() -> list[tuple[int, str]]:
            loop = asyncio.get_running_loop()
            seen: list[tuple[int, str]] = []
            done = [loop.create_future() for _ in range(2)]
            before = writer.batches
            held = writer.submit(hold)  # type: ignore[arg-type]
            assert await asyncio.to_thread(started.wait, 10)
            for n, cid in enumerate(("G1", "G2")):
                def answered(results: object, error: object, n: int = n, cid: str = cid) -> None:
                    assert error is None, error
                    seen.append((writer.batches - before, cid))
                    done[n].set_result(None)

                writer.intake([intake_item(cid)], answered)
            late = asyncio.wrap_future(writer.submit(_set_meta("late", "1")))
            gate.set()
            await late
            assert writer.batches == before + 1  # the late job rode with the held one
            await asyncio.gather(*done)
            await asyncio.wrap_future(held)
            return seen

        assert asyncio.run(run()) == [(2, "G1"), (2, "G2")]
        seqs = writer.submit(lambda s: s.conn.execute(
            "SELECT control_id, seq FROM messages ORDER BY seq").fetchall()).result(5)
        assert [tuple(r) for r in seqs] == [("G1", 1), ("G2", 2)]


def _bump(key: str):  # noqa: ANN202 - a store job
    """A job that adds one to a counter in meta: run twice, it would show 2."""

    def job(store: SqliteStore) -> None:
        store.conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, '1')"
            " ON CONFLICT (key) DO UPDATE SET value = CAST(value AS INTEGER) + 1", (key,),
        )

    return job


def _bump_then_fail(key: str):  # noqa: ANN202 - a store job
    def job(store: SqliteStore) -> None:
        _bump(key)(store)
        raise ValueError("this job fails after writing")

    return job


def _statements(writer: Writer) -> list[str]:
    """Every statement the writer's connection runs from now on (SQLite's own trace)."""
    seen: list[str] = []
    writer.submit(lambda s: s.conn.set_trace_callback(seen.append)).result(5)
    return seen


class TestSavepoints:
    """A batch runs without savepoints; only when one of its jobs fails is it taken again, one savepoint each."""

    def test_a_batch_of_jobs_and_late_joiners_uses_no_savepoint(self, writer: Writer) -> None:
        seen = _statements(writer)
        started, gate, hold = _holding()
        before = writer.batches
        held = writer.submit(hold)  # type: ignore[arg-type]
        assert started.wait(10)
        late = [writer.submit(_bump(f"k{n}")) for n in range(3)]
        gate.set()
        for job in (held, *late):
            job.result(10)
        assert writer.batches == before + 1
        assert not [q for q in seen if "SAVEPOINT" in q.upper() or q.upper().startswith("RELEASE")], seen
        assert [writer.submit(lambda s, n=n: _meta(s, f"k{n}")).result(5) for n in range(3)] == ["1", "1", "1"]

    def test_a_failing_job_spares_its_batch_and_each_job_counts_once(self, tmp_path: Path) -> None:
        """The failing job's own write is undone; its neighbours' writes commit once, though run twice."""
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "writer-test", db.DatabaseOptions(), time.time())
        writer = Writer(SqliteStore(conn, db.load_queries(), db_path=path))
        # Queued before the thread starts: all three are in its first batch.
        jobs = [writer.submit(_bump("a")), writer.submit(_bump_then_fail("b")), writer.submit(_bump("c"))]
        writer.start()
        try:
            assert jobs[0].result(10) is None
            with pytest.raises(ValueError, match="fails after writing"):
                jobs[1].result(10)
            assert jobs[2].result(10) is None
            assert writer.batches == 1
            values = writer.submit(lambda s: [_meta(s, k) for k in "abc"]).result(5)
            assert values == ["1", None, "1"]
        finally:
            writer.close()

    def test_a_failing_late_joiner_spares_the_batch_it_joined(self, writer: Writer) -> None:
        started, gate, hold = _holding()
        before = writer.batches
        held = writer.submit(hold)  # type: ignore[arg-type]
        assert started.wait(10)
        first = writer.submit(_bump("x"))
        failing = writer.submit(_bump_then_fail("y"))
        last = writer.submit(_bump("z"))
        gate.set()
        held.result(10)
        first.result(10)
        last.result(10)
        with pytest.raises(ValueError):
            failing.result(10)
        assert writer.batches == before + 1
        assert writer.submit(lambda s: [_meta(s, k) for k in "xyz"]).result(5) == ["1", None, "1"]


class TestAnnouncedJobs:
    """``expect()``: a batch about to commit waits a moment for a job its caller is about to submit."""

    def test_a_batch_waits_for_an_announced_job_and_commits_with_it(self, writer: Writer) -> None:
        """The announced job joins the commit under way, even though it came after the batch's own jobs ran."""
        writer.hold = writer.min_hold = 10.0  # far longer than needed: the job's arrival ends the wait
        ran = threading.Event()

        def first(store: SqliteStore) -> None:
            _set_meta("first", "1")(store)
            ran.set()

        before = writer.batches
        writer.expect()
        held = writer.submit(first)
        assert ran.wait(10)
        writer.expected_done()
        late = writer.submit(_set_meta("announced", "1"))
        late.result(10)
        held.result(10)
        assert writer.batches == before + 1

    def test_an_announced_job_that_never_comes_delays_the_commit_by_the_hold_at_most(self, writer: Writer) -> None:
        """A hint, never a promise: the batch commits after ``hold`` even if the job is never submitted."""
        writer.hold = writer.min_hold = 0.05
        writer.expect()
        try:
            started = time.monotonic()
            writer.submit(_set_meta("alone", "1")).result(10)
            assert time.monotonic() - started < 5
        finally:
            writer.expected_done()

    def test_the_hold_is_never_longer_than_a_batch_takes(self, writer: Writer) -> None:
        """A job that misses a commit waits about one batch for the next: holding longer would cost more.

        The batches here take milliseconds (a small commit on a local disk),
        so with ``hold`` at 30 s an announcement that is never fulfilled
        costs the commit milliseconds, not the full hold.
        """
        for n in range(5):  # the batches' work, measured
            writer.submit(_set_meta(f"warm{n}", "1")).result(10)
        writer.hold = 30.0
        writer.expect()
        try:
            started = time.monotonic()
            writer.submit(_set_meta("capped", "1")).result(20)
            assert time.monotonic() - started < 5
        finally:
            writer.expected_done()


def _intake_item(n: int) -> IntakeItem:
    cid = f"CK{n:06d}"
    body = f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|{cid}|P|2.5.1\rPID|1||{n}\r".encode()
    return IntakeItem(channel="adt", remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
                      control_id=cid, message_type="ADT^A01", body=body, encoding="utf-8", ack_mode="commit",
                      commit_ack=b"MSH|^~\\&|ACK")


class TestIntakeFailing:
    """/readyz's probe is one small row: the writer also says whether messages' own commits fail."""

    def test_a_failed_intake_is_shown_until_one_succeeds(self, writer: Writer) -> None:
        async def intake(item: IntakeItem) -> tuple[object, BaseException | None]:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[tuple[object, BaseException | None]] = loop.create_future()
            writer.intake([item], lambda results, error: done.set_result((results, error)), loop)
            return await done

        broken = _intake_item(1)
        broken.body = None  # type: ignore[assignment] - the statement fails for real
        _, error = asyncio.run(intake(broken))
        assert error is not None
        failing = writer.intake_failing
        assert failing is not None and failing[1]
        _, error = asyncio.run(intake(_intake_item(2)))
        assert error is None and writer.intake_failing is None


class TestWalCheckpoints:
    """On SQLite the writer checkpoints the WAL itself, after answering a batch (agent/storage/checkpoints.py)."""

    def test_the_wal_stays_near_the_writers_interval_not_sqlites_threshold(self, writer: Writer) -> None:
        """300 one-message commits (~3,600 frames): the WAL file never grows much past CHECKPOINT_FRAMES.

        Without the writer's checkpoints only SQLite's backstop
        (WRITER_AUTOCHECKPOINT_PAGES, 2,000 frames, about 8 MiB) would run.
        """
        wal = Path(f"{writer.store.db_path}-wal")
        largest = 0
        for n in range(300):
            writer.submit(SqliteStore.intake_batch, [_intake_item(n)]).result(10)
            largest = max(largest, wal.stat().st_size)
        frame = 4096 + 24
        # The pacer's estimate of frames per commit may be off by a few, and the
        # commit that crosses the mark overshoots it (about 540 frames seen here).
        assert largest <= 1.5 * checkpoints.CHECKPOINT_FRAMES * frame + 32, largest
        assert 2 * largest < db.WRITER_AUTOCHECKPOINT_PAGES * frame  # far from the backstop

    def test_a_burst_of_large_rows_after_quiet_commits_keeps_the_wal_within_its_limit(self, writer: Writer) -> None:
        """The pacer learns ~1 frame per commit from quiet commits; then each commit writes ~20: the WAL's size decides.

        This is how a disk the free-space floor was keeping was filled (the
        floor reserves a WAL of WAL_SIZE_LIMIT): a backlog drained at once
        after an outage, 3 KB rows, 8 MiB of WAL before the next checkpoint.
        """
        wal = Path(f"{writer.store.db_path}-wal")
        for _ in range(3 * checkpoints.CHECKPOINT_FRAMES):
            writer.submit(SqliteStore.probe_write).result(10)  # one small page each
        pacer = writer._pacer
        assert pacer is not None and pacer.per_commit < 4, pacer.per_commit
        largest = 0
        pad = "X" * 60_000
        for n in range(200):
            item = _intake_item(n)
            item.body = item.body + f"NTE|1||{pad}\r".encode()
            writer.submit(SqliteStore.intake_batch, [item]).result(10)
            largest = max(largest, wal.stat().st_size)
        one_commit = 20 * (4096 + 24)
        assert largest <= db.WAL_SIZE_LIMIT + checkpoints.WAL_SLACK_BYTES + one_commit, largest

    def test_a_batch_is_answered_before_the_checkpoint_runs(self, writer: Writer) -> None:
        """The checkpoint that falls due after a commit waits for that batch's answers, never the reverse."""
        events: list[str] = []
        writer.store.conn.set_trace_callback(
            lambda sql: events.append("checkpoint") if "wal_checkpoint" in sql else None)
        try:
            for n in range(120):
                future = writer.submit(SqliteStore.intake_batch, [_intake_item(n)])
                future.add_done_callback(lambda _f: events.append("answered"))
                future.result(10)
        finally:
            writer.store.conn.set_trace_callback(None)
        assert events.count("checkpoint") >= 2, events
        # Every checkpoint follows an answer, and no two checkpoints follow one batch.
        for i, event in enumerate(events):
            if event == "checkpoint":
                assert i > 0 and events[i - 1] == "answered", events[max(0, i - 3) : i + 1]

    def test_a_failing_checkpoint_fails_no_batch(self, writer: Writer, monkeypatch: pytest.MonkeyPatch) -> None:
        """A checkpoint error (here: one made up, a full disk cannot be had here) leaves every job answered."""
        calls: list[int] = []

        def failing(store: SqliteStore) -> int:
            calls.append(1)
            raise db.sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(checkpoints, "passive_checkpoint", failing)
        results = [writer.submit(SqliteStore.intake_batch, [_intake_item(n)]).result(10) for n in range(80)]
        assert [r.outcome for (r,) in results] == ["accepted"] * 80
        assert calls, "no checkpoint fell due"


class TestIntakeHandOver:
    """Intake groups of one loop turn reach the writer thread together (Writer._hand_over_intake)."""

    def test_groups_of_one_loop_turn_share_one_commit(self, writer: Writer) -> None:
        """Eight senders' frames read in one loop turn: one batch, though the thread was free meanwhile.

        Between the groups the loop lets go of the GIL for 5 ms each (as it
        does at every socket read): a group queued at once would have been
        taken alone by the idle thread and committed before the next came.
        """
        async def one_turn() -> list[tuple[object, BaseException | None]]:
            loop = asyncio.get_running_loop()
            answers: list[asyncio.Future[tuple[object, BaseException | None]]] = []
            for n in range(8):
                answer: asyncio.Future[tuple[object, BaseException | None]] = loop.create_future()
                writer.intake([_intake_item(100 + n)],
                              lambda results, error, answer=answer: answer.set_result((results, error)), loop)
                answers.append(answer)
                time.sleep(0.005)  # noqa: ASYNC251 - the GIL let go, as a socket read does; not a synchronisation
            return await asyncio.gather(*answers)

        before = writer.batches
        answers = asyncio.run(one_turn())
        assert all(error is None for _, error in answers)
        assert writer.batches - before <= 2  # one; two if the OS paused the loop between two puts

    def test_close_within_the_turn_still_commits_its_groups(self, tmp_path: Path) -> None:
        """close() from the loop before the turn ended: the groups of that turn are committed, then it stops."""
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "writer-test", db.DatabaseOptions(), time.time())
        w = Writer(SqliteStore(conn, db.load_queries(), db_path=path))
        w.start()
        answers: list[tuple[object, BaseException | None]] = []

        async def intake_then_close() -> None:
            loop = asyncio.get_running_loop()
            w.intake([_intake_item(200)], lambda results, error: answers.append((results, error)), loop)
            w.close()
            await asyncio.sleep(0)  # the answer's callback, queued by the writer thread, runs on the loop

        asyncio.run(intake_then_close())
        check = db.open_database(path, "writer-test", db.DatabaseOptions(), time.time())
        try:
            assert check.execute("SELECT count(*) FROM messages WHERE control_id = 'CK000200'").fetchone() == (1,)
        finally:
            check.close()
        assert len(answers) == 1 and answers[0][1] is None

    def test_groups_handed_over_after_close_are_answered_closed(self, tmp_path: Path) -> None:
        """A group whose turn ends after close() (from another thread) is told the writer is closed, not left hanging."""
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "writer-test", db.DatabaseOptions(), time.time())
        w = Writer(SqliteStore(conn, db.load_queries(), db_path=path))
        w.start()

        async def intake_across_close() -> tuple[object, BaseException | None]:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[tuple[object, BaseException | None]] = loop.create_future()
            w.intake([_intake_item(300)], lambda results, error: done.set_result((results, error)), loop)
            closer = threading.Thread(target=w.close)
            closer.start()
            closer.join(10)  # the loop is held here: its turn ends after the stop marker was queued
            async with asyncio.timeout(10):
                return await done

        results, error = asyncio.run(intake_across_close())
        assert results is None and error is not None and "closed" in str(error)
