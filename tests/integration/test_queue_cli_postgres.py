"""Every queue and channel command against a PostgreSQL queue, as against SQLite (docs/operations.md).

The queue is built with the daemon's own store code on the session's real
server (intake, fenced settles under a real lease); the commands run through
``agent.app.cli.main`` with ``[queue] backend = "postgresql"``. What differs
from SQLite is only what ``stats`` says about the database: the masked dsn,
``pg_database_size``, no WAL file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pgserver import PgDatabase
from test_queue_cli import check_schema, load_schema

from agent.app.cli import main
from agent.app.commands import moves
from agent.app.commands.common import operator
from agent.core import mllp
from agent.storage import postgres
from agent.storage.postgres import PgOptions, PostgresDialect
from agent.storage.sql import POSTGRESQL, load_queries
from agent.storage.store import AuditItem, IntakeItem, LeaseHolder, Store

AGENT_ID = "edge-pg"


def hl7(control_id: str, channel: str = "adt") -> bytes:
    return f"MSH|^~\\&|LAB|HOSP|RAPP|RFAC|20240101120000||ADT^A01|{control_id}|P|2.5\rPID|1||{channel}\r".encode()


@dataclass
class PgQueue:
    db: PgDatabase
    config: Path
    ids: dict[str, str] = field(default_factory=dict)
    bodies: dict[str, bytes] = field(default_factory=dict)

    def state(self, message_id: str) -> str | None:
        found = self.db.rows("SELECT state FROM messages WHERE id = %s", (message_id,))
        return str(found[0][0]) if found else None

    def counts(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.db.rows("SELECT state, count(*) FROM messages GROUP BY state")}  # type: ignore[call-overload]


def write_config(tmp_path: Path, db: PgDatabase, agent_id: str = AGENT_ID) -> Path:
    secret = tmp_path / "db-password"
    secret.write_text(db.server.password + "\n")
    path = tmp_path / f"{agent_id}.toml"
    path.write_text(f"""
[agent]
id = "{agent_id}"
data_dir = "{tmp_path / 'data'}"

[admin]
listen = ""

[queue]
backend = "postgresql"
dsn = "{db.dsn_without_password}"
password_file = "{secret}"

[[channels]]
name = "adt"
listen = "127.0.0.1:42575"

[[channels]]
name = "lab"
listen = "127.0.0.1:42576"
""", encoding="utf-8")
    return path


def settle_head(store: Store, me: LeaseHolder, epoch: int, channel: str, state: str) -> str:
    head = store.channel_head(channel)
    assert head is not None and store.claim(me.holder, epoch, head.id)
    attempt = store.mark_inflight(me.holder, epoch, head.id, "claimed", head.attempts)
    if state == "failed":
        assert store.fail_live(me.holder, epoch, head.id, attempt, "failed", error_code="max_attempts",
                               error_text="503 x3")
    else:
        assert store.settle(me.holder, epoch, head.id, attempt, state, server_status=200 if state == "processed"
                            else 422, server_ack=None)
    return head.id


@pytest.fixture
def queue(tmp_path: Path, pg_database: PgDatabase, monkeypatch: pytest.MonkeyPatch) -> PgQueue:
    """adt: processed, failed, rejected, queued, queued; lab: inflight, queued; one nacked."""
    for name in list(os.environ):
        if name.startswith("HL7_AGENT_"):
            monkeypatch.delenv(name)
    q = PgQueue(pg_database, write_config(tmp_path, pg_database))
    d = PostgresDialect(PgOptions(dsn=pg_database.dsn, agent_id=AGENT_ID), role="writer")
    store = Store(postgres.open_database(d, AGENT_ID, time.time()), load_queries(POSTGRESQL),
                  db_path=Path("unused"), dialect=d)
    try:
        with store.transaction():
            for i in range(1, 6):
                body = hl7(f"ADT{i:04d}")
                r = store.intake(IntakeItem(channel="adt", remote="10.0.0.5:5000", sending_app="LAB",
                                            sending_facility="HOSP", control_id=f"ADT{i:04d}",
                                            message_type="ADT^A01", body=body, encoding="utf-8",
                                            ack_mode="commit", commit_ack=b"MSH|^~\\&|ACK\rMSA|AA|x\r"))
                q.ids[f"adt{i}"], q.bodies[r.message_id] = r.message_id, body
            for i in range(1, 3):
                body = hl7(f"LAB{i:04d}", "lab")
                r = store.intake(IntakeItem(channel="lab", remote="10.0.0.6:5000", sending_app="LAB",
                                            sending_facility="HOSP", control_id=f"LAB{i:04d}",
                                            message_type="ADT^A08", body=body, encoding="utf-8",
                                            ack_mode="commit"))
                q.ids[f"lab{i}"], q.bodies[r.message_id] = r.message_id, body
            q.ids["nacked"] = store.record_audit(AuditItem(channel="adt", remote="10.0.0.5:5001",
                                                           body=b"garbage", error_code="101", error_text="no MSH"))
        me = LeaseHolder.for_this_process(AGENT_ID)
        with store.transaction():
            epoch = store.try_acquire_lease(me, 300.0)
            assert epoch is not None
            for state in ("processed", "failed", "rejected"):
                settle_head(store, me, epoch, "adt", state)
            head = store.channel_head("lab")
            assert head is not None and store.claim(me.holder, epoch, head.id)
            store.mark_inflight(me.holder, epoch, head.id, "claimed", head.attempts)
            assert store.release_lease(me.holder, epoch)
    finally:
        store.close()
    return q


def run(q: PgQueue, capsys: pytest.CaptureFixture[str], *argv: str, config: Path | None = None) -> tuple[int, str, str]:
    code = main([*argv, "--config", str(config or q.config)])
    out, err = capsys.readouterr()
    return code, out, err


class TestReads:
    def test_stats_json_counts_rows_and_describes_the_database(self, queue: PgQueue,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
        """Counts as the table holds them; db: the masked dsn, pg_database_size, wal_bytes null; the schema holds."""
        code, out, _ = run(queue, capsys, "queue", "stats", "--json")
        assert code == 0
        data = json.loads(out)
        schema = load_schema()
        check_schema(data, schema, schema)
        expected = dict.fromkeys(("queued", "claimed", "inflight", "processed", "rejected", "failed", "nacked"), 0)
        expected.update(queue.counts())
        assert data["states"] == expected
        assert (data["channels"]["adt"]["queued"], data["channels"]["lab"]["inflight"]) == (2, 1)
        db = data["db"]
        assert db["backend"] == "postgresql" and db["path"] is None and db["wal_bytes"] is None
        assert db["dsn"] == queue.db.dsn_without_password and queue.db.server.password not in out
        assert db["size_bytes"] > 0 and db["agent_id"] == AGENT_ID and db["schema_version"] == 2

    def test_stats_table_names_the_database(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """The terminal form shows the dsn (masked) where SQLite shows the file."""
        code, out, _ = run(queue, capsys, "queue", "stats")
        assert code == 0 and queue.db.dsn_without_password in out and "WAL" not in out
        assert "lease     none held" in out

    def test_list_filters_and_show_raw(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """list --state/--channel/--json, show ID, show --raw (the stored bytes exactly), an id prefix."""
        code, out, _ = run(queue, capsys, "queue", "list", "--state", "queued", "--json")
        assert code == 0
        listed = json.loads(out)
        assert {r["id"] for r in listed} == {queue.ids["adt4"], queue.ids["adt5"], queue.ids["lab2"]}
        code, out, _ = run(queue, capsys, "queue", "list", "--channel", "lab", "--json")
        assert {r["id"] for r in json.loads(out)} == {queue.ids["lab1"], queue.ids["lab2"]}
        code, out, _ = run(queue, capsys, "queue", "show", queue.ids["adt2"][:8])
        assert code == 0 and "failed" in out and "max_attempts" in out
        code = main(["queue", "show", queue.ids["adt4"], "--raw", "--config", str(queue.config)])
        raw = capsys.readouterr().out
        assert code == 0 and raw.encode() == queue.bodies[queue.ids["adt4"]]

    def test_read_commands_never_write(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """The read-only session refuses writes: stats/list/show leave every row and the meta table alone."""
        before = queue.db.rows("SELECT key, value FROM meta ORDER BY key")
        for argv in (("queue", "stats"), ("queue", "list"), ("queue", "show", queue.ids["adt1"])):
            assert run(queue, capsys, *argv)[0] == 0
        assert queue.db.rows("SELECT key, value FROM meta ORDER BY key") == before

    def test_a_database_without_the_queue_is_one_line(self, tmp_path: Path, pg_database: PgDatabase,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
        """No schema there: exit 1 and one line; nothing is created."""
        config = write_config(tmp_path, pg_database)
        code = main(["queue", "stats", "--config", str(config)])
        err = capsys.readouterr().err.strip()
        assert code == 1 and "holds no hl7-agent queue" in err and len(err.splitlines()) == 1
        assert pg_database.rows("SELECT to_regclass('meta')") == [(None,)]

    def test_an_unreachable_database_is_one_line(self, tmp_path: Path, pg_database: PgDatabase,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
        """The server down: exit 1, one line naming the masked dsn."""
        config = write_config(tmp_path, pg_database)
        with pg_database.server.stopped():
            code = main(["queue", "stats", "--config", str(config)])
        err = capsys.readouterr().err.strip()
        assert code == 1 and "cannot connect to the queue database" in err and len(err.splitlines()) == 1
        assert pg_database.server.password not in err


class TestWrites:
    def test_retry_by_id_and_by_state(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """retry ID moves a failed row; retry --state rejected the rejected ones; live rows refuse."""
        code, _, _ = run(queue, capsys, "queue", "retry", queue.ids["adt2"])
        assert code == 0 and queue.state(queue.ids["adt2"]) == "queued"
        code, _, _ = run(queue, capsys, "queue", "retry", "--state", "rejected")
        assert code == 0 and queue.state(queue.ids["adt3"]) == "queued"
        code, _, _ = run(queue, capsys, "queue", "retry", queue.ids["lab1"])
        assert code != 0 and queue.state(queue.ids["lab1"]) == "inflight"

    def test_purge_deletes_terminal_rows_only(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """purge --state processed deletes it; the dedupe key stays (a retransmit is still a duplicate)."""
        code, _, _ = run(queue, capsys, "queue", "purge", "--state", "processed", "--older-than", "0s")
        assert code == 0 and queue.state(queue.ids["adt1"]) is None
        assert queue.db.rows("SELECT count(*) FROM dedupe_keys WHERE control_id = 'ADT0001'") == [(1,)]
        code, _, _ = run(queue, capsys, "queue", "purge", "--state", "queued", "--older-than", "0s")
        assert code != 0 and queue.state(queue.ids["adt4"]) == "queued"

    def test_export_writes_mllp_frames_in_delivery_order(self, queue: PgQueue, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
        """export --state queued: the stored bytes, MLLP-framed, by channel then seq."""
        out = tmp_path / "queued.mllp"
        code, _, _ = run(queue, capsys, "queue", "export", "--state", "queued", str(out))
        assert code == 0
        frames = [e.payload for e in mllp.MllpDecoder(1 << 20).feed(out.read_bytes()) if isinstance(e, mllp.Frame)]
        assert frames == [queue.bodies[queue.ids[k]] for k in ("adt4", "adt5", "lab2")]

    def test_channel_pause_and_resume(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """The durable pause flag is set and cleared in the shared database."""
        assert run(queue, capsys, "channel", "pause", "adt")[0] == 0
        assert queue.db.rows("SELECT paused FROM channels WHERE channel = 'adt'") == [(1,)]
        assert run(queue, capsys, "channel", "resume", "adt")[0] == 0
        assert queue.db.rows("SELECT paused FROM channels WHERE channel = 'adt'") == [(0,)]

    def test_another_agent_id_changes_nothing(self, queue: PgQueue, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
        """A write command configured with another agent.id is refused before it writes."""
        other = write_config(tmp_path, queue.db, agent_id="someone-else")
        code, _, err = run(queue, capsys, "queue", "retry", queue.ids["adt2"], config=other)
        assert code == 1 and "belongs to agent.id" in err
        assert queue.state(queue.ids["adt2"]) == "failed"



    def test_fail_sets_a_queued_row_aside_and_never_a_live_one(self, queue: PgQueue,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
        """queue fail: queued → failed with who and why; the inflight row is refused and left alone."""
        target = queue.ids["adt4"]
        code, out, err = run(queue, capsys, "queue", "fail", target, "--reason", "wrong patient")
        assert code == 0, err
        assert f"{target}: set aside as failed (was queued, channel adt, seq 4)" in out
        ((state, error_code, error_text),) = queue.db.rows(
            "SELECT state, error_code, error_text FROM messages WHERE id = %s", (target,))
        assert (state, error_code) == ("failed", moves.SET_ASIDE_CODE)
        assert error_text == f"set aside by {operator()}: wrong patient"
        code, _, err = run(queue, capsys, "queue", "fail", queue.ids["lab1"])
        assert code == 1 and "it is inflight" in err and queue.state(queue.ids["lab1"]) == "inflight"

    def test_ids_by_prefix_in_any_case(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """8 characters of an id, upper case too, name the row (show, retry)."""
        target = queue.ids["adt2"]
        code, out, err = run(queue, capsys, "queue", "show", target[:8].upper())
        assert code == 0 and target in out, err
        assert run(queue, capsys, "queue", "retry", target[:8])[0] == 0
        assert queue.state(target) == "queued"

    def test_each_change_writes_one_operator_action(self, queue: PgQueue,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
        """The audit trail on the shared database: one entry per command that changed something."""
        for argv in (["channel", "pause", "adt"], ["queue", "retry", queue.ids["adt2"]],
                     ["queue", "fail", queue.ids["adt5"], "--reason", "bad MRN"],
                     ["queue", "fail", queue.ids["lab1"]]):  # refused: nothing changed, nothing recorded
            run(queue, capsys, *argv)
        got = queue.db.rows("SELECT action, os_user, channel, reason, rows, detail, status, logged_at "
                            "FROM operator_actions ORDER BY id")
        me = operator()
        assert [(a, u, c, r, n, s, logged) for a, u, c, r, n, _d, s, logged in got] == [
            ("pause", me, "adt", None, 0, "done", None), ("retry", me, "adt", None, 1, "done", None),
            ("fail", me, "adt", "bad MRN", 1, "done", None)]
        assert json.loads(str(got[2][5])) == {"ids": [queue.ids["adt5"]], "channels": {"adt": 1}}


class TestListShowsTheServersReason:
    def test_list_and_show_carry_server_reason(self, queue: PgQueue, capsys: pytest.CaptureFixture[str]) -> None:
        """A rejection's reason stored with the row (schema 2) is in list --json and show --json."""
        queue.db.rows("UPDATE messages SET server_reason = 'unknown patient' WHERE id = %s", (queue.ids["adt3"],))
        code, out, _ = run(queue, capsys, "queue", "list", "--state", "rejected", "--json")
        assert code == 0
        (entry,) = json.loads(out)
        assert entry["id"] == queue.ids["adt3"] and entry["server_reason"] == "unknown patient"
        code, out, _ = run(queue, capsys, "queue", "show", queue.ids["adt3"], "--json")
        assert code == 0 and json.loads(out)["server_reason"] == "unknown patient"
