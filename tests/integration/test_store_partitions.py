"""The store's side of partitioned channels: per-key heads, the per-key claim, key pauses, plans.

docs/queue.md#partitioned-channels. Real databases (SQLite in tmp_path);
time is the store's clock, moved by the test, never waited for.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from storetest import FakeClock, open_store

from agent.core.partition import parse_partition_key
from agent.core.states import State
from agent.storage import sqlite as db
from agent.storage.rows import RowFilter
from agent.storage.store import IntakeItem, LeaseHolder, SqliteStore

T = TypeVar("T")
KEY = parse_partition_key("PID-3.1")


@dataclass
class Harness:
    store: SqliteStore
    clock: FakeClock
    holder: str = ""
    epoch: int = 0

    def tx(self, fn: Callable[[SqliteStore], T]) -> T:
        with self.store.transaction() as s:
            return fn(s)

    def state(self, message_id: str) -> State:
        row = self.store.row(message_id)
        assert row is not None
        return row.state

    def heads(self, limit: int = 10) -> list[str]:
        return [h.id for h in self.store.partition_heads("adt", self.clock(), limit)]

    def claim(self, message_id: str) -> bool:
        return self.tx(lambda s: s.claim_partition_head(self.holder, self.epoch, message_id))

    def send(self, message_id: str) -> int:
        assert self.claim(message_id), f"{message_id} was not claimable"
        return self.tx(lambda s: s.mark_inflight(self.holder, self.epoch, message_id, "claimed", 0))

    def settle(self, message_id: str, attempt: int = 1) -> None:
        assert self.tx(lambda s: s.settle(self.holder, self.epoch, message_id, attempt, "processed",
                                          server_status=200, server_ack=None))


@pytest.fixture(params=["sqlite", "postgresql"])
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """A migrated store holding the lease; parametrised by backend."""
    me = replace(LeaseHolder.for_this_process("partition-agent"), holder="me")
    clock = FakeClock()
    with open_store(request.param, request, tmp_path, "partition-agent", clock) as store:
        harness = Harness(store, clock)
        epoch = harness.tx(lambda s: s.try_acquire_lease(me, 30.0))
        assert epoch is not None
        harness.holder, harness.epoch = "me", epoch
        yield harness


def message(control_id: str, patient: str | None) -> bytes:
    pid = f"PID|1||{patient}^^^HOSP\r" if patient is not None else ""
    return f"MSH|^~\\&|LAB|NORTH|EHR|C|20260101||ADT^A08|{control_id}|P|2.5\r{pid}".encode()


def intake(h: Harness, control_id: str, patient: str | None, *, keyed: bool = True, channel: str = "adt") -> str:
    body = message(control_id, patient)
    key = KEY.of(body.decode()) if keyed else None
    result = h.tx(lambda s: s.intake(IntakeItem(
        channel=channel, remote="10.0.0.1:4000", sending_app="LAB", sending_facility="NORTH",
        control_id=control_id, message_type="ADT^A08", body=body, encoding="utf-8", ack_mode="commit",
        partition_key=key, received_at=h.clock())))
    assert result.outcome == "accepted"
    return result.message_id


class TestKeyStored:
    def test_intake_stores_the_key_and_none_without_partitioning(self, h: Harness) -> None:
        a = intake(h, "C1", "P1")
        b = intake(h, "C2", None)
        c = intake(h, "C3", "P9", keyed=False)
        keys = {r.id: r.partition_key for r in h.store.list_rows(RowFilter(limit=0))}
        assert keys == {a: "P1", b: "", c: None}


class TestHeads:
    def test_one_head_per_key_oldest_first(self, h: Harness) -> None:
        """The first row of each key, in seq order; later rows of a key wait for it."""
        ids = [intake(h, f"C{i}", p) for i, p in enumerate(["A", "B", "A", "C", "B", "A"])]
        assert h.heads() == [ids[0], ids[1], ids[3]]
        assert h.heads(limit=2) == [ids[0], ids[1]]

    def test_a_key_in_flight_shows_no_head_and_others_go_on(self, h: Harness) -> None:
        a1, b1, a2, b2 = (intake(h, f"C{i}", p) for i, p in enumerate("ABAB"))
        h.send(a1)
        assert h.heads() == [b1]
        h.send(b1)
        assert h.heads() == []
        h.settle(a1)
        assert h.heads() == [a2]
        assert [r.id for r in h.store.partition_busy("adt")] == [b1, a2][:1]
        assert {r.partition_key for r in h.store.partition_busy("adt")} == {"B"}
        h.settle(b1)
        assert h.heads() == [a2, b2]

    def test_a_retrying_head_blocks_only_its_key(self, h: Harness) -> None:
        a1, b1, a2, b2 = (intake(h, f"C{i}", p) for i, p in enumerate("ABAB"))
        attempt = h.send(a1)
        assert h.tx(lambda s: s.requeue(h.holder, h.epoch, a1, attempt, h.clock() + 60, server_status=503))
        assert h.heads() == [b1]  # a1 not due; a2 may not overtake it
        assert not h.claim(a2)
        h.clock.now += 61
        assert h.heads() == [a1, b1]
        blocked = h.store.blocked_partitions(h.clock() - 61)
        assert [(b.partition_key, b.why, b.id, b.depth) for b in blocked] == [("A", "retrying", a1, 2)]
        del b2

    def test_claim_refuses_a_row_whose_key_is_not_its_turn(self, h: Harness) -> None:
        """The per-key rule holds at the claim itself, under the write lock."""
        a1, a2 = intake(h, "C1", "A"), intake(h, "C2", "A")
        assert not h.claim(a2)
        assert h.state(a2) == State.QUEUED
        assert h.claim(a1)
        assert not h.claim(a2)

    def test_redrive_of_an_earlier_row_waits_for_the_one_in_flight(self, h: Harness) -> None:
        """A re-driven earlier row goes before the rest of its key, never beside a row in flight."""
        a1, a2, a3 = (intake(h, f"C{i}", "A") for i in range(3))
        attempt = h.send(a1)
        assert h.tx(lambda s: s.settle(h.holder, h.epoch, a1, attempt, "rejected", server_status=400,
                                       server_ack=None))
        h.send(a2)
        assert h.tx(lambda s: s.redrive_ids([a1], h.clock())) is not None
        assert h.state(a1) == State.QUEUED
        assert h.heads() == [] and not h.claim(a1)  # a2 is in flight
        h.settle(a2)
        assert h.heads() == [a1]  # before a3: the lower seq
        assert not h.claim(a3)

    def test_unkeyed_rows_hold_back_every_key_behind_them(self, h: Harness) -> None:
        """A live row an older agent took in (no key yet) is a barrier until its key is stored."""
        a1 = intake(h, "C1", "A")
        old = intake(h, "C2", "B", keyed=False)
        b2 = intake(h, "C3", "B")
        c1 = intake(h, "C4", "C")
        assert h.heads() == [a1]
        assert not h.claim(b2)
        assert [r.id for r in h.store.unkeyed_rows("adt")] == [old]
        stored = h.tx(lambda s: s.key_unkeyed("adt", lambda body, enc: KEY.of(body.decode(enc))))
        assert stored == 1
        assert h.heads() == [a1, old, c1]

    def test_paused_key_waits_and_channel_resume_clears_every_key(self, h: Harness) -> None:
        a1, b1, c1 = (intake(h, f"C{i}", p) for i, p in enumerate("ABC"))
        h.tx(lambda s: s.pause_partition("adt", "A", "rejected row x"))
        h.tx(lambda s: s.pause_partition("adt", "B", "rejected row y"))
        assert h.heads() == [c1]
        assert not h.claim(a1)
        blocked = h.store.blocked_partitions(h.clock())
        assert [(b.partition_key, b.why, b.id, b.depth) for b in blocked] == [
            ("A", "paused", a1, 1), ("B", "paused", b1, 1)]
        h.tx(lambda s: s.resume_channel("adt"))
        assert h.heads() == [a1, b1, c1]
        assert h.store.blocked_partitions(h.clock()) == []

    def test_other_channels_are_untouched(self, h: Harness) -> None:
        a = intake(h, "C1", "A")
        other = intake(h, "C2", "A", keyed=False, channel="lab")
        assert h.heads() == [a]
        head = h.store.channel_head("lab")
        assert head is not None and head.id == other


# -- query plans -----------------------------------------------------------------


def _plan(store: SqliteStore, name: str, **params: Any) -> str:
    rows = store.conn.execute("EXPLAIN QUERY PLAN " + store.q[name], params).fetchall()
    return "\n".join(str(r[3]) for r in rows)


class TestQueryPlanSqlite:
    """With a large backlog, finding each key's turn is index probes, never a scan of the table."""

    @pytest.fixture
    def big(self, tmp_path: Path) -> Iterator[SqliteStore]:
        path = tmp_path / "big.db"
        conn = db.open_database(path, "plan-agent", db.DatabaseOptions(), 0.0)
        conn.execute("BEGIN")
        rows = [(f"id{i:06d}", "adt", i + 1, f"P{i % 500}", b"x") for i in range(20_000)]
        conn.executemany(
            "INSERT INTO messages (id, channel, seq, state, remote, body, body_sha256, received_at,"
            " updated_at, partition_key) VALUES (?, ?, ?, 'queued', 'r', ?, 'h', 0, 0, ?)",
            [(i, c, s, b, k) for i, c, s, k, b in rows])
        conn.execute("COMMIT")
        conn.execute("ANALYZE")
        yield SqliteStore(conn, db.load_queries(), db_path=path)
        conn.close()

    def test_heads_walk_the_live_index_and_probe_per_key(self, big: SqliteStore) -> None:
        plan = _plan(big, "partition_heads", channel="adt", now=1.0, limit=8)
        assert "SCAN m" not in plan and "SCAN messages" not in plan, plan
        assert "USING INDEX messages_live_head" in plan, plan
        assert plan.count("messages_partition_head") >= 2, plan  # the earlier-row and NULL-key probes
        assert "messages_partition_busy" in plan, plan
        assert "TEMP B-TREE" not in plan, plan

    def test_claim_check_is_probes(self, big: SqliteStore) -> None:
        plan = _plan(big, "partition_claimable", id="id000001")
        assert "SCAN" not in plan.replace("SCAN CONSTANT", ""), plan

    def test_blocked_partitions_read_only_the_blocked(self, big: SqliteStore) -> None:
        assert "messages_partition_retry" in _plan(big, "partition_retrying", now=1.0, limit=10)
        plan = _plan(big, "partition_paused")
        assert "SCAN m " not in plan and "SCAN messages" not in plan, plan

    def test_heads_are_fast_with_the_backlog(self, big: SqliteStore) -> None:
        """20,000 queued rows over 500 keys: the first heads come back at once."""
        import time

        started = time.perf_counter()
        heads = big.partition_heads("adt", 1.0, 16)
        elapsed = time.perf_counter() - started
        assert [h.seq for h in heads] == list(range(1, 17))
        assert elapsed < 0.5, elapsed


class TestQueryPlanPostgres:
    """The same queries on PostgreSQL, with a backlog and fresh statistics: index scans, no
    sequential scan of messages."""

    def test_plans(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        clock = FakeClock()
        with open_store("postgresql", request, tmp_path, "partition-agent", clock) as store:
            h = Harness(store, clock)
            conn = h.store.conn
            with h.store.transaction():
                conn.execute(
                    "INSERT INTO messages (id, channel, seq, state, remote, body, body_sha256, received_at,"
                    " updated_at, partition_key) SELECT 'id' || g, 'adt', g, 'queued', 'r', '\\x00'::bytea,"
                    " 'h', 0, 0, 'P' || (g % 500) FROM generate_series(1, 20000) AS g")
            conn.execute("ANALYZE messages")
            for name, params in [
                ("partition_heads", {"channel": "adt", "now": 1.0, "limit": 8}),
                ("partition_claimable", {"id": "id1"}),
                ("partition_retrying", {"now": 1.0, "limit": 10}),
                ("partition_unkeyed", {"channel": "adt", "limit": 5}),
            ]:
                rows = conn.execute("EXPLAIN " + h.store.q[name], params).fetchall()
                plan = "\n".join(str(r[0] if not isinstance(r, dict) else next(iter(r.values()))) for r in rows)
                assert "Seq Scan on messages" not in plan, (name, plan)
                assert "messages_" in plan, (name, plan)


def test_migration_is_additive(tmp_path: Path) -> None:
    """A schema-v2 agent's insert (explicit columns, no partition_key) still works: the key is NULL."""
    path = tmp_path / "q.db"
    conn = db.open_database(path, "mig-agent", db.DatabaseOptions(), 0.0)
    conn.execute(
        "INSERT INTO messages (id, channel, seq, state, remote, body, body_sha256, received_at, updated_at)"
        " VALUES ('old', 'adt', 1, 'queued', 'r', x'00', 'h', 0, 0)")
    assert conn.execute("SELECT partition_key FROM messages WHERE id = 'old'").fetchone() == (None,)
    assert isinstance(conn, sqlite3.Connection)
    conn.close()


# -- what operators see: stats, the table, metrics, the status page ------------------


class TestBlockedPartitionViews:
    """Blocked keys are shown with their head, counts and ages, and a hash: never the key value."""

    SECRET_A, SECRET_B = "MRN-SECRET-A", "MRN-SECRET-B"

    def _blocked(self, h: Harness) -> tuple[str, str]:
        a1 = intake(h, "C1", self.SECRET_A)
        intake(h, "C2", self.SECRET_A)
        b1 = intake(h, "C3", self.SECRET_B)
        intake(h, "C4", "MRN-FLOWING")
        attempt = h.send(a1)
        assert h.tx(lambda s: s.requeue(h.holder, h.epoch, a1, attempt, h.clock() + 30, server_status=503,
                                        error_code="503", error_text="transient status 503"))
        h.tx(lambda s: s.pause_partition("adt", self.SECRET_B, f"rejected row {b1} (status 400)"))
        h.clock.now += 5
        return a1, b1

    def test_stats_json(self, h: Harness) -> None:
        from agent.core.partition import key_hash
        from tests.integration.test_queue_cli import check_schema, load_schema

        a1, b1 = self._blocked(h)
        data = h.store.stats(["adt"])
        entries = data["channels"]["adt"]["blocked_partitions"]
        assert [(e["why"], e["head_id"], e["depth"], e["key_hash"]) for e in entries] == [
            ("paused", b1, 1, key_hash(self.SECRET_B, h.store.key_hash_secret())), ("retrying", a1, 2, key_hash(self.SECRET_A, h.store.key_hash_secret()))]
        assert entries[1]["attempts"] == 1 and entries[1]["next_attempt_in_s"] == 25.0
        assert entries[1]["head_age_s"] == 5.0 and entries[1]["server_status"] == 503
        assert "SECRET" not in repr(data)
        data["generated_at"] = "2026-01-01T00:00:00Z"
        schema = load_schema()
        check_schema(data, schema, schema)

    def test_table(self, h: Harness) -> None:
        from agent.app.commands.render import render_stats

        self._blocked(h)
        text = render_stats(h.store.stats(["adt"]), None, h.clock())
        assert "blocked partitions" in text and "retrying" in text and "paused" in text
        assert "SECRET" not in text

    def test_metrics(self, h: Harness) -> None:
        from agent.runtime.metrics import AgentMetrics

        self._blocked(h)
        stats = h.store.stats(["adt", "lab"])
        metrics = AgentMetrics()
        metrics.bind_stats(lambda: stats)
        text = metrics.exposition_for(None)[0].decode()
        assert 'hl7_agent_partitions_blocked{channel="adt",why="retrying"} 1.0' in text
        assert 'hl7_agent_partitions_blocked{channel="adt",why="paused"} 1.0' in text
        assert 'hl7_agent_partitions_blocked{channel="lab",why="retrying"} 0.0' in text
        assert 'hl7_agent_partition_blocked_head_age_seconds{channel="adt"} 5.0' in text
        assert "SECRET" not in text

    def test_status_page_assessment(self, h: Harness) -> None:
        from agent.core.partition import key_hash
        from agent.core.status import assess

        a1, _ = self._blocked(h)
        view = assess(stats=h.store.stats(["adt"]), activity=None, upstream=None, lease_held=True,
                      listeners_up=True, now=h.clock())
        (channel,) = [c for c in view["channels"] if c["name"] == "adt"]
        assert channel["blocked_partitions"] == 2
        detail = " ".join(channel["detail"])
        assert f"partition {key_hash(self.SECRET_A, h.store.key_hash_secret())} retrying" in detail and a1 in detail
        assert "the other partitions go on" in detail and "SECRET" not in repr(view)
        assert channel["state"] == "retrying"
        assert channel["text"] == "2 partitions blocked, the others go on — 4 waiting"

    def test_a_key_paused_while_partitioned_is_not_reported_once_the_channel_is_strict(self, h: Harness) -> None:
        """partition_key removed from the config: the leftover key pause blocks nothing, so stats
        (and the metric and page built on them) must not report it, or an alert fires for nothing."""
        self._blocked(h)
        assert "blocked_partitions" not in h.store.stats(["adt"], partitioned=[])["channels"]["adt"]
        assert len(h.store.stats(["adt"], partitioned=["adt"])["channels"]["adt"]["blocked_partitions"]) == 2

    def test_status_page_says_paused_when_every_blocked_key_is_paused(self, h: Harness) -> None:
        from agent.core.status import assess

        h.tx(lambda s: s.pause_partition("adt", "MRN-EMPTY", "rejected row x (status 400)"))
        intake(h, "C5", self.SECRET_A)
        h.tx(lambda s: s.pause_partition("adt", self.SECRET_A, "rejected row y (status 400)"))
        view = assess(stats=h.store.stats(["adt"]), activity=None, upstream=None, lease_held=True,
                      listeners_up=True, now=h.clock())
        (channel,) = [c for c in view["channels"] if c["name"] == "adt"]
        assert channel["state"] == "paused"
        assert channel["text"] == "2 partitions paused, the others go on — 1 waiting"
        assert "None" not in " ".join(channel["detail"])  # the key with no rows names no head

    def test_queue_list_names_the_partition_by_hash(self, h: Harness) -> None:
        from agent.app.commands.render import list_item
        from agent.core.partition import key_hash

        self._blocked(h)
        intake(h, "C9", "MRN-X", keyed=False, channel="lab")
        items = [list_item(r, show_body=False, key_secret=h.store.key_hash_secret())
                 for r in h.store.list_rows(RowFilter(limit=0))]
        by_control = {i["control_id"]: i["partition"] for i in items}
        assert by_control["C1"] == by_control["C2"] == key_hash(self.SECRET_A, h.store.key_hash_secret())
        assert by_control["C9"] is None
        assert "SECRET" not in repr(items)
