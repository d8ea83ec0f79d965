"""The hot queries keep their index: ``EXPLAIN QUERY PLAN`` on a real queue file.

Claim, head, intake lookups, the transitions, the relay poll, stats depth
and retention must cost the same on a 1,000,000-row queue as on an empty one
(bench/backlog.py measures it; this test keeps the plans from drifting). Each
plan is read twice: with the planner's defaults (a fresh file) and after
``ANALYZE`` on a queue shaped like a busy site's (mostly processed rows, a
backlog on four channels, a few failures), as ``PRAGMA optimize`` leaves it.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.core.states import State
from agent.storage import sqlite as db
from agent.storage.store import IntakeItem, SqliteStore

T0 = 1_800_000_000.0

#: query name -> (the index its plan must use, the table it must never scan).
#: "PRIMARY KEY" is dedupe_keys' own (WITHOUT ROWID); sqlite_autoindex_messages_1 is messages.id;
#: "a|b": either will do.
HOT: dict[str, tuple[str, str]] = {
    # dispatch: the head and every fenced transition (by id)
    "channel_head": ("messages_live_head (channel=?)", "messages"),
    "claim": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "send": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "claim_and_send": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "resend": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "settle": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "requeue": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "fail_live": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "claimed_ids": ("messages_partition_busy", "messages"),
    "recover_claimed": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "dedupe_set_app_ack": ("PRIMARY KEY (channel=? AND sending_app=? AND sending_facility=? AND control_id=?)",
                           "dedupe_keys"),
    # intake
    "dedupe_prior_row": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    "set_ack_outcome": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    # the application-ACK relay's poll
    "settled_app_acks": ("sqlite_autoindex_messages_1 (id=?)", "messages"),
    # stats depth and the status page: live rows only, never the settled history
    "live_by_channel": ("messages_live_head|messages_partition_head", "messages"),
    "status_live_depth": ("COVERING INDEX messages_live_head", "messages"),
    "status_head": ("messages_live_head (channel=?)", "messages"),
    # retention: a batch costs its size, not the table's
    "purge_expired_dedupe_keys": ("dedupe_keys_expiry (expires_at<?)", "dedupe_keys"),
    "purge_terminal_older_than": ("messages_settled_updated (state=? AND updated_at<?)", "messages"),
}

#: Plans allowed a temp B-tree: grouping the live rows by channel and state (a few groups).
SORTS = {"live_by_channel"}

#: The indexes a plan may scan whole: they hold the live rows only (partial).
PARTIALS = ("USING INDEX messages_live_head", "USING INDEX messages_partition_head",
            "USING INDEX messages_partition_busy", "USING COVERING INDEX messages_live_head")


def item(channel: str, n: int) -> IntakeItem:
    cid = f"{channel}-{n}"
    body = f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|{cid}|P|2.5.1\rPID|1||{n}\r".encode()
    return IntakeItem(channel=channel, remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
                      control_id=cid, message_type="ADT^A01", body=body, encoding="utf-8", ack_mode="commit",
                      commit_ack=b"ACK", received_at=T0)


def _fill(store: SqliteStore) -> None:
    """12,000 rows through the intake path; most processed, a backlog, a few failed and in flight."""
    with store.transaction() as s:
        for channel in ("adt", "lab", "orm", "rad"):
            s.intake_groups([[item(channel, n) for n in range(3000)]])
    conn = store.conn
    with conn:
        conn.execute("UPDATE messages SET state = ?, updated_at = received_at + seq WHERE seq <= 2500",
                     (State.PROCESSED,))
        conn.execute("UPDATE messages SET state = ? WHERE seq BETWEEN 2490 AND 2500", (State.FAILED,))
        conn.execute("UPDATE messages SET state = ? WHERE seq = 2501", (State.INFLIGHT,))


@pytest.fixture(scope="module", params=["fresh", "analyzed"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqliteStore]:
    path = tmp_path_factory.mktemp(f"plans-{request.param}") / "queue.db"
    conn = db.open_database(path, "plan-test", db.DatabaseOptions(), T0)
    s = SqliteStore(conn, db.load_queries(), db_path=path, clock=lambda: T0)
    if request.param == "analyzed":
        _fill(s)
        conn.execute("ANALYZE")
    try:
        yield s
    finally:
        s.close()


def plan(store: SqliteStore, name: str) -> list[str]:
    sql = store.q[name]
    params = {p: 1 for p in re.findall(r":(\w+)", sql)}
    if "ids" in params:
        params["ids"] = '["a", "b"]'
    rows = store.conn.execute("EXPLAIN QUERY PLAN " + sql, params).fetchall()
    return [str(r[3]) for r in rows]


@pytest.mark.parametrize("name", sorted(HOT))
def test_hot_query_uses_its_index(store: SqliteStore, name: str) -> None:
    """The named index is used; the table (or a whole index of it) is never scanned; nothing is sorted."""
    indexes, table = HOT[name]
    steps = plan(store, name)
    assert any(index in step for step in steps for index in indexes.split("|")), steps
    assert not any(step.startswith(f"SCAN {table}") and not any(p in step for p in PARTIALS)
                   for step in steps), steps
    if name not in SORTS:
        assert not any("TEMP B-TREE" in step for step in steps), steps


def test_every_hot_query_exists(store: SqliteStore) -> None:
    """A renamed query must not drop out of this test silently."""
    assert set(HOT) <= set(store.q) and set(SETTLED_READS) <= set(store.q) and set(LIVE_READS) <= set(store.q)
    assert set(MULTIROW_HOT) <= set(store.q)


#: Intake's one-statement-per-batch queries (positional, three rows here): their index.
MULTIROW_HOT = {
    "dedupe_lookup_keys": "SEARCH d USING PRIMARY KEY (channel=? AND sending_app=? AND sending_facility=? "
                          "AND control_id=?)",
    "set_ack_outcomes": "SEARCH messages USING INDEX sqlite_autoindex_messages_1 (id=?)",
}


@pytest.mark.parametrize("name", sorted(MULTIROW_HOT))
def test_multirow_query_searches_its_index(store: SqliteStore, name: str) -> None:
    """One search of the index per row named, never a scan of the table."""
    sql = store._multirow_sql(name, 3)
    steps = [str(r[3]) for r in store.conn.execute("EXPLAIN QUERY PLAN " + sql, [1] * sql.count("?")).fetchall()]
    assert any(MULTIROW_HOT[name] in step for step in steps), steps
    assert not any(step.startswith(("SCAN messages", "SCAN d", "SCAN dedupe_keys")) for step in steps), steps
    assert not any("TEMP B-TREE" in step for step in steps), steps


#: Operator and status queries for rows no longer live: a search of the settled index
#: (only the rows asked for), never a scan of the table.
SETTLED_READS = ("recent_failures", "purge_oldest_terminal", "op_settled_by_channel", "op_count_purgeable",
                 "op_purge_batch", "op_count_state", "op_select_state", "op_export_ids")
#: Their twins for a live state: the live rows' index, never the table.
LIVE_READS = ("op_count_live_state", "op_select_live_state", "op_export_live_ids")


@pytest.mark.parametrize("name", SETTLED_READS)
def test_settled_reads_search_the_settled_index(store: SqliteStore, name: str) -> None:
    steps = plan(store, name)
    assert any("USING INDEX messages_settled_updated (state=?" in step
               or "USING COVERING INDEX messages_settled_updated (state=?" in step for step in steps), steps
    assert not any(step.startswith("SCAN messages") for step in steps), steps


@pytest.mark.parametrize("name", LIVE_READS)
def test_live_state_reads_use_the_live_index(store: SqliteStore, name: str) -> None:
    steps = plan(store, name)
    assert any("messages_live_head" in step for step in steps), steps
    assert not any(step.startswith("SCAN messages") and not any(p in step for p in PARTIALS) for step in steps), steps


def test_intake_and_dispatch_marks_write_no_state_index_entry(tmp_path: Path) -> None:
    """Every index that leads with the state is partial: a queued row gets no entry in the settled one.

    Then intake writes one B-tree entry (and a page of the commit) fewer, and
    the claim and inflight marks move none there; only a settle adds one.
    """
    path = tmp_path / "queue.db"
    conn = db.open_database(path, "plan-test", db.DatabaseOptions(), T0)
    try:
        listed = {str(r[1]): bool(r[4]) for r in conn.execute("PRAGMA index_list(messages)")}
        leading = {name for name in listed
                   if [str(r[2]) for r in conn.execute(f"PRAGMA index_info({name})")][:1] == ["state"]}
        assert leading == {"messages_settled_updated"}
        assert all(listed[name] for name in leading), listed
        sql = conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'messages_settled_updated'").fetchone()[0]
        assert "WHERE state NOT IN ('queued', 'claimed', 'inflight')" in sql
    finally:
        conn.close()


def test_the_plans_were_checked_on_a_busy_queue(store: SqliteStore) -> None:
    """The analyzed file really holds the shape the statistics describe."""
    n = store.conn.execute("SELECT count(*) FROM messages").fetchone()[0]
    assert n in (0, 12000)
    if n:
        assert store.conn.execute("SELECT count(*) FROM sqlite_stat1").fetchone()[0] > 0


def test_dedupe_app_ack_is_kept_with_its_key(tmp_path: Path) -> None:
    """The rewritten dedupe_set_app_ack (by the key, read from the row) still finds the key."""
    path = tmp_path / "queue.db"
    conn = db.open_database(path, "plan-test", db.DatabaseOptions(), T0)
    s = SqliteStore(conn, db.load_queries(), db_path=path, clock=lambda: T0)
    try:
        with s.transaction() as t:
            (_first, r2), = t.intake_groups([[item("adt", 1), item("adt", 2)]])
            t._exec("dedupe_set_app_ack", message_id=r2.message_id, app_ack=b"MSA|AA")
        got = sqlite3.connect(path).execute("SELECT control_id, app_ack FROM dedupe_keys ORDER BY control_id")
        assert got.fetchall() == [("adt-1", None), ("adt-2", b"MSA|AA")]
    finally:
        s.close()


def test_state_counts_read_only_the_state_indexes(store: SqliteStore) -> None:
    """``stats()``' count by state reads index entries alone, never the rows.

    Settled and audit rows from messages_settled_updated, live ones from
    messages_live_head (which carries the state for this). Still a pass over
    every row's index entry (O(rows), about 0.3 s at 500,000 rows):
    maintained per-state counters would make it O(1); until then this keeps it
    from getting worse (a scan of the table reads every body too).
    """
    steps = plan(store, "count_by_state")
    scans = [step for step in steps if step.startswith(("SCAN", "SEARCH"))]
    assert scans == ["SCAN messages USING COVERING INDEX messages_settled_updated",
                     "SCAN messages USING COVERING INDEX messages_live_head"], steps
