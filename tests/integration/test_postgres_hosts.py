"""Two hosts on one PostgreSQL queue, at the store level: each with its own writer thread and connection.

What several agent processes sharing a database must keep (docs/ha.md):
``seq`` gap-free per channel whoever takes the message, dedupe across hosts
(also for the same message arriving at both at once), group commit on a
database server, the lease measured on the database's clock (the hosts'
clocks may disagree), and a takeover fencing the old holder. Real server,
real threads (the daemon's own Writer); nothing faked but the clock the
lease test moves.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from agenttest import wait_for
from pgserver import PgDatabase

from agent.errors import LeaseLost
from agent.storage import postgres
from agent.storage.postgres import PgOptions, PostgresDialect
from agent.storage.sql import POSTGRESQL, load_queries
from agent.storage.store import IntakeItem, IntakeResult, LeaseHolder, Store
from agent.storage.writer import Writer

AGENT = "pg-hosts"
TTL = 30.0


def item(cid: str, channel: str = "adt", *, body: bytes | None = None, ack: bytes | None = None) -> IntakeItem:
    text = body or f"MSH|^~\\&|LAB|N|EHR|C|20260101||ADT^A01|{cid}|P|2.5\rPID|1||{cid}\r".encode()
    return IntakeItem(channel=channel, remote="10.0.0.1:1", sending_app="LAB", sending_facility="N",
                      control_id=cid, message_type="ADT^A01", body=text, encoding="utf-8",
                      ack_mode="commit", commit_ack=ack or b"MSH|^~\\&|ACK\rMSA|AA|" + cid.encode() + b"\r")


@dataclass
class Host:
    """One agent process's view: its store on its own connection, run by its own writer thread."""

    name: str
    store: Store
    writer: Writer
    skew: list[float]

    def submit(self, it: IntakeItem) -> concurrent.futures.Future[IntakeResult]:
        return self.writer.submit(Store.intake, it)

    def tx(self, fn: Callable[[Store], object]) -> object:
        return self.writer.submit(fn).result(30)


@pytest.fixture
def hosts(pg_database: PgDatabase) -> Iterator[Callable[..., Host]]:
    made: list[Host] = []
    skew = [0.0]  # seconds the test moved the (shared) database clock

    def make(name: str, clock: Callable[[], float] = time.time) -> Host:
        d = PostgresDialect(PgOptions(dsn=pg_database.dsn, agent_id=AGENT), role="writer",
                            lease_skew=lambda: skew[0])
        conn = postgres.open_database(d, AGENT, time.time())
        store = Store(conn, load_queries(POSTGRESQL), db_path=Path("unused"), clock=clock, dialect=d)
        writer = Writer(store, name=f"writer-{name}")
        writer.start()
        host = Host(name, store, writer, skew)
        made.append(host)
        return host

    try:
        yield make
    finally:
        for host in made:
            host.writer.close()


def rows(db: PgDatabase) -> list[tuple[object, ...]]:
    return db.rows("SELECT control_id, channel, seq, state FROM messages ORDER BY channel, seq")


class TestIntakeAcrossHosts:
    def test_both_hosts_take_intake_and_seq_stays_gap_free_per_channel(
        self, hosts: Callable[..., Host], pg_database: PgDatabase
    ) -> None:
        """Three senders per host, each waiting for its answer, on two channels: each channel is
        numbered 1..n once, and each sender's messages keep its order."""
        a, b = hosts("a"), hosts("b")
        results: dict[str, IntakeResult] = {}

        def sender(host: Host, name: str) -> None:
            for i in range(60):
                cid = f"{name}{i:03d}"
                results[cid] = host.submit(item(cid, "adt" if i % 3 else "lab")).result(30)

        threads = [threading.Thread(target=sender, args=(h, f"{h.name}{n}")) for h in (a, b) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 360 and {r.outcome for r in results.values()} == {"accepted"}
        by_channel: dict[str, list[int]] = defaultdict(list)
        for control_id, channel, seq, state in rows(pg_database):
            assert state == "queued" and isinstance(seq, int)
            by_channel[str(channel)].append(seq)
            assert results[str(control_id)].seq == seq
        assert set(by_channel) == {"adt", "lab"}
        for channel, seqs in by_channel.items():
            assert seqs == list(range(1, len(seqs) + 1)), channel
        for name in {c[:2] for c in results}:
            for channel in ("adt", "lab"):
                mine = [r.seq for c, r in sorted(results.items()) if c.startswith(name)
                        and (int(c[2:]) % 3 != 0) == (channel == "adt")]
                assert mine == sorted(mine), (name, channel)
        # Both writers committed many batches, interleaved with the other host's.
        assert a.writer.batches > 5 and b.writer.batches > 5

    def test_a_retransmit_to_the_other_host_gets_the_original_ack(
        self, hosts: Callable[..., Host], pg_database: PgDatabase
    ) -> None:
        """Host B answers a message host A took with A's ACK bytes and adds no row; other bytes: conflict."""
        a, b = hosts("a"), hosts("b")
        original = a.submit(item("X1", ack=b"ACK-AS-SENT-BY-A")).result(10)
        again = b.submit(item("X1", ack=b"ACK-B-WOULD-BUILD")).result(10)
        assert again.outcome == "duplicate" and again.message_id == original.message_id
        assert again.commit_ack == b"ACK-AS-SENT-BY-A"
        other = b.submit(item("X1", body=b"MSH|^~\\&|LAB|N|||||ADT^A01|X1|P|2.5\rPID|1||other\r")).result(10)
        assert other.outcome == "conflict"
        assert [r[0] for r in rows(pg_database)] == ["X1"]

    def test_the_same_message_at_both_hosts_at_once_makes_one_row(
        self, hosts: Callable[..., Host], pg_database: PgDatabase
    ) -> None:
        """A sender that fails over mid-message reaches both hosts together: one accepted, one duplicate."""
        a, b = hosts("a"), hosts("b")
        outcomes: dict[str, list[str]] = {}
        for i in range(40):
            cid = f"S{i:03d}"
            start = threading.Barrier(2)

            def go(host: Host, cid: str = cid, start: threading.Barrier = start) -> IntakeResult:
                start.wait(5)
                return host.submit(item(cid)).result(10)

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                results = list(pool.map(go, (a, b)))
            outcomes[cid] = sorted(r.outcome for r in results)
            assert results[0].message_id == results[1].message_id
        assert set(map(tuple, outcomes.values())) == {("accepted", "duplicate")}
        assert len(rows(pg_database)) == 40

    def test_a_group_with_a_repeated_key_makes_one_row(self, hosts: Callable[..., Host],
                                                      pg_database: PgDatabase) -> None:
        """One batch frame holding the same message twice: one row, the second answered as duplicate."""
        a = hosts("a")
        results = a.writer.submit(Store.intake_batch, [item("G1"), item("G2"), item("G1")]).result(10)
        assert [r.outcome for r in results] == ["accepted", "accepted", "duplicate"]
        assert results[2].message_id == results[0].message_id
        assert [r[2] for r in rows(pg_database)] == [1, 2]

    def test_senders_share_commits_on_the_database_server(self, hosts: Callable[..., Host],
                                                          pg_database: PgDatabase) -> None:
        """Jobs waiting while a commit runs go into one transaction together (group commit)."""
        a = hosts("a")
        blocker = PostgresDialect(PgOptions(dsn=pg_database.dsn, agent_id=AGENT), role="writer")
        conn = blocker.connect()
        try:
            blocker.begin_write(conn)  # the writer's next BEGIN waits for this lock
            before = a.writer.batches
            first = a.submit(item("W0"))
            wait_for(lambda: pg_database.rows(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                (a.store.conn.info.backend_pid,)), 10, what="the writer waiting for the lock")
            rest = [a.submit(item(f"W{i}")) for i in range(1, 50)]
            blocker.commit(conn)
        finally:
            conn.close()
        assert all(f.result(10).outcome == "accepted" for f in [first, *rest])
        assert a.writer.batches - before <= 3
        assert len(rows(pg_database)) == 50


class TestLeaseAcrossHosts:
    def test_the_lease_runs_on_the_database_clock(self, hosts: Callable[..., Host]) -> None:
        """Host A's clock is an hour behind: its lease still lasts a TTL on the database's clock,
        so host B cannot take it early (on host clocks it could at once)."""
        a = hosts("a", clock=lambda: time.time() - 3600)
        b = hosts("b")
        me_a, me_b = holder("a"), holder("b")
        epoch = a.tx(lambda s: s.try_acquire_lease(me_a, TTL))
        assert epoch == 1
        assert b.tx(lambda s: s.try_acquire_lease(me_b, TTL)) is None
        a.skew[0] += TTL + 1
        assert b.tx(lambda s: s.try_acquire_lease(me_b, TTL)) == 2

    def test_a_takeover_fences_every_write_of_the_old_holder(self, hosts: Callable[..., Host],
                                                             pg_database: PgDatabase) -> None:
        """After B took over from A (expired), A's settle and claim raise LeaseLost and change nothing."""
        a, b = hosts("a"), hosts("b")
        ids = [a.submit(item(f"L{i}")).result(10).message_id for i in range(2)]
        me_a, me_b = holder("a"), holder("b")
        old = a.tx(lambda s: s.try_acquire_lease(me_a, TTL))
        assert isinstance(old, int)
        assert a.tx(lambda s: s.claim(me_a.holder, old, ids[0]))
        attempt = a.tx(lambda s: s.mark_inflight(me_a.holder, old, ids[0], "claimed", 0))
        a.skew[0] += TTL + 1
        new = b.tx(lambda s: s.try_acquire_lease(me_b, TTL))
        assert new == old + 1
        with pytest.raises(LeaseLost):
            a.tx(lambda s: s.settle(me_a.holder, old, ids[0], attempt, "processed", server_status=200,
                                    server_ack=None))
        with pytest.raises(LeaseLost):
            a.tx(lambda s: s.claim(me_a.holder, old, ids[1]))
        assert [r[3] for r in rows(pg_database)] == ["inflight", "queued"]
        resent = b.tx(lambda s: s.mark_inflight(me_b.holder, new, ids[0], "inflight", attempt))
        assert b.tx(lambda s: s.settle(me_b.holder, new, ids[0], resent, "processed", server_status=200,
                                       server_ack=None))


def holder(name: str) -> LeaseHolder:
    """This process under another holder name, as on another host (another boot id: never provably dead)."""
    return replace(LeaseHolder.for_this_process(AGENT), holder=name, boot_id=f"boot-of-{name}")
