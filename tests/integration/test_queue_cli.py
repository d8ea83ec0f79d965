"""Operator commands against a real queue database (SPEC 2, SPEC 6).

The database is built with the daemon's own code (``db.open_database`` +
``SqliteStore`` intake and fenced settles under a real lease); the commands
run through ``agent.app.cli.main`` and, for exit codes, as real subprocesses.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.app.cli import main
from agent.app.commands.queue import Progress
from agent.core import mllp
from agent.storage import sqlite as db
from agent.storage.store import AuditItem, IntakeItem, LeaseHolder, SqliteStore

REPO = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO / "docs" / "queue-stats.schema.json"
AGENT_ID = "edge-test"
DAY = 86400.0


def hl7(control_id: str, *, event: str = "A01", pid: str = "12345") -> bytes:
    return (
        f"MSH|^~\\&|LAB|HOSP|RAPP|RFAC|20240101120000||ADT^{event}|{control_id}|P|2.5\r"
        f"PID|1||{pid}||DOE^JOHN\r"
    ).encode()


@dataclass
class Queue:
    """A populated queue database and the ids of its rows by role."""

    data_dir: Path
    config: Path
    ids: dict[str, str] = field(default_factory=dict)
    bodies: dict[str, bytes] = field(default_factory=dict)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "queue.db"

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(self.db_path, isolation_level=None)
        try:
            return conn.execute(query, params).fetchall()
        finally:
            conn.close()

    def state(self, message_id: str) -> str | None:
        rows = self.sql("SELECT state FROM messages WHERE id = ?", message_id)
        return rows[0][0] if rows else None

    def counts(self) -> dict[str, int]:
        return dict(self.sql("SELECT state, count(*) FROM messages GROUP BY state"))


def write_config(path: Path, data_dir: Path, agent_id: str = AGENT_ID) -> Path:
    path.write_text(
        f"""
[agent]
id = "{agent_id}"
data_dir = "{data_dir}"

[admin]
listen = ""

[[channels]]
name = "adt"
listen = "127.0.0.1:42575"

[[channels]]
name = "lab"
listen = "127.0.0.1:42576"
""",
        encoding="utf-8",
    )
    return path


def _settle_head(store: SqliteStore, me: LeaseHolder, epoch: int, channel: str, state: str) -> str:
    """Drive a channel's head through claim → inflight → ``state`` with the fenced methods."""
    head = store.channel_head(channel)
    assert head is not None
    assert store.claim(me.holder, epoch, head.id)
    attempt = store.mark_inflight(me.holder, epoch, head.id, "claimed", head.attempts)
    if state == "processed":
        ok = store.settle(me.holder, epoch, head.id, attempt, "processed", server_status=200,
                          server_ack="MSH|^~\\&|RAPP|RFAC|LAB|HOSP|20240101120001||ACK^A01^ACK|S1|P|2.5\r"
                                     "MSA|AA|" + head.control_id + "\r")  # fmt: skip
    elif state == "rejected":
        ok = store.settle(
            me.holder,
            epoch,
            head.id,
            attempt,
            "rejected",
            server_status=422,
            server_ack=None,
            error_code="http_422",
            error_text="unknown patient",
        )
    else:
        ok = store.fail_live(me.holder, epoch, head.id, attempt, "failed",
                             error_code="max_attempts", error_text="503 x3")  # fmt: skip
    assert ok
    return head.id


def build_queue(tmp_path: Path, *, hold_lease: bool = False) -> Queue:
    """adt: processed, failed, rejected, processed, queued, queued; lab: inflight, queued; one nacked."""
    data_dir = tmp_path / "data"
    q = Queue(data_dir, write_config(tmp_path / "agent.toml", data_dir))
    conn = db.open_database(q.db_path, AGENT_ID, db.DatabaseOptions(), time.time())
    store = SqliteStore(conn, db.load_queries(), db_path=q.db_path)
    try:
        with store.transaction():
            for i in range(1, 7):
                body = hl7(f"ADT{i:04d}")
                r = store.intake(IntakeItem(channel="adt", remote="10.0.0.5:5000", sending_app="LAB",
                                            sending_facility="HOSP", control_id=f"ADT{i:04d}",
                                            message_type="ADT^A01", body=body, encoding="utf-8",
                                            ack_mode="commit", commit_ack=b"MSH|^~\\&|ACK\rMSA|AA|x\r"))  # fmt: skip
                q.ids[f"adt{i}"] = r.message_id
                q.bodies[r.message_id] = body
            for i in range(1, 3):
                body = hl7(f"LAB{i:04d}", event="A08")
                r = store.intake(IntakeItem(channel="lab", remote="10.0.0.6:5000", sending_app="LAB",
                                            sending_facility="HOSP", control_id=f"LAB{i:04d}",
                                            message_type="ADT^A08", body=body, encoding="utf-8",
                                            ack_mode="commit"))  # fmt: skip
                q.ids[f"lab{i}"] = r.message_id
                q.bodies[r.message_id] = body
            q.ids["nacked"] = store.record_audit(AuditItem(channel="adt", remote="10.0.0.5:5001",
                                                           body=b"garbage", error_code="101",
                                                           error_text="no MSH"))  # fmt: skip
        me = LeaseHolder.for_this_process(AGENT_ID)
        with store.transaction():
            epoch = store.try_acquire_lease(me, 300.0)
            assert epoch is not None
        with store.transaction():
            for state in ("processed", "failed", "rejected", "processed"):
                _settle_head(store, me, epoch, "adt", state)
            head = store.channel_head("lab")
            assert head is not None and store.claim(me.holder, epoch, head.id)
            store.mark_inflight(me.holder, epoch, head.id, "claimed", head.attempts)
        if not hold_lease:
            with store.transaction():
                assert store.release_lease(me.holder, epoch)
    finally:
        conn.close()
    return q


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("HL7_AGENT_"):
            monkeypatch.delenv(name)


@pytest.fixture
def queue(tmp_path: Path) -> Queue:
    return build_queue(tmp_path)


def run(q: Queue, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--config", str(q.config)])
    out, err = capsys.readouterr()
    return code, out, err


def run_process(
    config: Path, *argv: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    return subprocess.run(
        [sys.executable, "-m", "agent", *argv, "--config", str(config)],
        capture_output=True, input=stdin, env=env, timeout=60, check=False, cwd=REPO,
    )  # fmt: skip


# -- a small structural JSON Schema check (jsonschema is not a dependency) -------


def check_schema(
    value: Any, schema: dict[str, Any], root: dict[str, Any], where: str = "$"
) -> None:
    """Enough of JSON Schema for our own schema files: type, required, properties,
    additionalProperties (schema), enum, minimum, $ref to #/$defs."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        schema = root["$defs"][name]
    types = schema.get("type")
    if types is not None:
        allowed = types if isinstance(types, list) else [types]
        py = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
        ok = False
        for t in allowed:
            if t == "integer":
                ok |= isinstance(value, int) and not isinstance(value, bool)
            elif t == "number":
                ok |= isinstance(value, int | float) and not isinstance(value, bool)
            else:
                ok |= isinstance(value, py[t])
        assert ok, f"{where}: {value!r} is not {allowed}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if "minimum" in schema and isinstance(value, int | float) and not isinstance(value, bool):
        assert value >= schema["minimum"], f"{where}: {value} < {schema['minimum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{where}: missing {key!r}"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                check_schema(item, props[key], root, f"{where}.{key}")
            elif isinstance(extra, dict):
                check_schema(item, extra, root, f"{where}.{key}")
            else:
                assert extra is not False, f"{where}: unexpected key {key!r}"
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check_schema(item, schema["items"], root, f"{where}[{i}]")


def load_schema(name: str = "queue-stats.schema.json") -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((REPO / "docs" / name).read_text(encoding="utf-8"))
    return schema


# -- tests --------------------------------------------------------------------


class TestStats:
    def test_json_counts_match_rows(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """`queue stats --json` counts every state and each channel's live rows as the table holds them."""
        code, out, _ = run(queue, capsys, "queue", "stats", "--json")
        assert code == 0
        data = json.loads(out)
        expected = {
            s: 0
            for s in ("queued", "claimed", "inflight", "processed", "rejected", "failed", "nacked")
        }
        expected.update(queue.counts())
        assert data["states"] == expected
        assert data["states"]["processed"] == 2 and data["states"]["nacked"] == 1
        adt, lab = data["channels"]["adt"], data["channels"]["lab"]
        assert (adt["queued"], adt["claimed"], adt["inflight"], adt["failed"], adt["rejected"]) == (
            2,
            0,
            0,
            1,
            1,
        )
        assert (lab["queued"], lab["inflight"]) == (1, 1)
        assert adt["oldest_queued_age_s"] is not None and adt["paused"] is False
        assert data["lease"] is None
        assert data["db"]["path"] == str(queue.db_path) and data["db"]["size_bytes"] > 0

    def test_json_matches_schema(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """The JSON object validates against docs/queue-stats.schema.json, lease null or not."""
        schema = load_schema()
        _, out, _ = run(queue, capsys, "queue", "stats", "--json")
        check_schema(json.loads(out), schema, schema)

    def test_lease_holder_shown(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A held lease appears with holder, epoch and an RFC 3339 expiry, in JSON and in the table."""
        q = build_queue(tmp_path, hold_lease=True)
        schema = load_schema()
        _, out, _ = run(q, capsys, "queue", "stats", "--json")
        data = json.loads(out)
        check_schema(data, schema, schema)
        assert data["lease"]["epoch"] == 1 and data["lease"]["holder"].startswith(AGENT_ID)
        assert data["lease"]["expires_at"].endswith("Z")
        code, out, _ = run(q, capsys, "queue", "stats")
        assert code == 0 and data["lease"]["holder"] in out and "epoch 1" in out

    def test_table_lists_channels(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """The terminal form shows the state counts and one line per channel."""
        code, out, _ = run(queue, capsys, "queue", "stats")
        assert code == 0
        assert "processed" in out and "lease     none held" in out
        lines = {
            ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith(("adt", "lab"))
        }
        assert lines["adt"][1:6] == ["2", "0", "0", "1", "1"]
        assert lines["lab"][1:4] == ["1", "0", "1"]

    def test_read_only_leaves_file_unchanged(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Read commands change no row (they run under PRAGMA query_only)."""
        before = queue.sql("SELECT id, state, updated_at FROM messages ORDER BY id")
        for argv in (["queue", "stats"], ["queue", "list"], ["queue", "show", queue.ids["adt2"]]):
            assert run(queue, capsys, *argv)[0] == 0
        assert queue.sql("SELECT id, state, updated_at FROM messages ORDER BY id") == before


class TestMissingDatabase:
    def test_missing_db_exit_1_and_not_created(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Every queue command on a missing database exits 1 with one line and creates nothing."""
        data_dir = tmp_path / "nodata"
        config = write_config(tmp_path / "agent.toml", data_dir)
        for argv in (["queue", "stats"], ["queue", "list"], ["queue", "show", "x"],
                     ["queue", "export", "--state", "failed", str(tmp_path / "out.mllp")],
                     ["queue", "retry", "--state", "failed"],
                     ["queue", "purge", "--state", "processed", "--older-than", "1d"],
                     ["channel", "pause", "adt"]):  # fmt: skip
            code = main([*argv, "--config", str(config)])
            _, err = capsys.readouterr()
            assert code == 1, argv
            assert err.strip().count("\n") == 0
            assert "no queue database at" in err and "has the daemon run" in err
        assert not data_dir.exists()
        assert not (tmp_path / "out.mllp").exists()

    def test_missing_db_subprocess(self, tmp_path: Path) -> None:
        """As a real process: exit 1, one line on stderr, no traceback, no file."""
        data_dir = tmp_path / "nodata"
        config = write_config(tmp_path / "agent.toml", data_dir)
        proc = run_process(config, "queue", "stats", "--json")
        assert proc.returncode == 1
        assert proc.stdout == b""
        assert proc.stderr.decode().count("\n") == 1 and b"Traceback" not in proc.stderr
        assert not data_dir.exists()


class TestList:
    def test_newest_first_with_columns(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Rows come newest first with id, channel, seq, state, control id, type, attempts, time, error."""
        queue.sql("UPDATE messages SET received_at = 1000 + coalesce(seq, 0) + "
                  "CASE channel WHEN 'lab' THEN 100 ELSE 0 END")  # fmt: skip
        code, out, _ = run(queue, capsys, "queue", "list", "--json")
        assert code == 0
        items = json.loads(out)
        assert len(items) == 9
        times = [i["received_at"] for i in items]
        assert times == sorted(times, reverse=True)
        assert items[0]["id"] == queue.ids["lab2"]
        assert "body" not in items[0]
        code, out, _ = run(queue, capsys, "queue", "list")
        header = out.splitlines()[0].split()
        assert header[:4] == ["id", "channel", "seq", "state"] and "error" in header
        assert b"PID" not in out.encode()

    def test_filters(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """--state, --channel, --control-id and --limit narrow the rows."""
        _, out, _ = run(queue, capsys, "queue", "list", "--state", "failed", "--json")
        assert [i["id"] for i in json.loads(out)] == [queue.ids["adt2"]]
        _, out, _ = run(queue, capsys, "queue", "list", "--channel", "lab", "--json")
        assert {i["id"] for i in json.loads(out)} == {queue.ids["lab1"], queue.ids["lab2"]}
        _, out, _ = run(queue, capsys, "queue", "list", "--control-id", "ADT0003", "--json")
        assert [i["state"] for i in json.loads(out)] == ["rejected"]
        _, out, _ = run(queue, capsys, "queue", "list", "--limit", "3", "--json")
        assert len(json.loads(out)) == 3

    def test_since_duration_and_time(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--since takes a duration back from now or an RFC 3339 time with offset."""
        queue.sql("UPDATE messages SET received_at = received_at - 3 * 86400 WHERE channel = 'adt'")
        _, out, _ = run(queue, capsys, "queue", "list", "--since", "2h", "--json")
        assert {i["channel"] for i in json.loads(out)} == {"lab"}
        _, out, _ = run(queue, capsys, "queue", "list", "--since", "2000-01-01T00:00:00Z", "--json")
        assert len(json.loads(out)) == 9
        code, _, err = run(queue, capsys, "queue", "list", "--since", "2000-01-01T00:00:00")
        assert code == 2 and "offset" in err

    def test_show_body(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """--show-body adds the message text, segment per line on a terminal, as text in JSON."""
        _, out, _ = run(
            queue, capsys, "queue", "list", "--control-id", "ADT0005", "--show-body", "--json"
        )
        assert json.loads(out)[0]["body"] == hl7("ADT0005").decode()
        _, out, _ = run(queue, capsys, "queue", "list", "--control-id", "ADT0005", "--show-body")
        assert "    PID|1||12345||DOE^JOHN" in out

    def test_bad_state_is_usage_error(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An unknown --state is a usage error (exit 2)."""
        code, _, err = run(queue, capsys, "queue", "list", "--state", "done")
        assert code == 2 and "--state" in err


class TestShow:
    def test_fields_without_body(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """show --json gives every field but the body, RFC 3339 times, ACKs as text."""
        code, out, _ = run(queue, capsys, "queue", "show", queue.ids["adt1"], "--json")
        assert code == 0
        row = json.loads(out)
        assert "body" not in row and row["body_bytes"] == len(hl7("ADT0001"))
        assert row["state"] == "processed" and row["server_status"] == 200
        assert row["received_at"].endswith("Z") and row["settled_at"].endswith("Z")
        assert row["server_ack"].startswith("MSH|") and "MSA|AA|ADT0001" in row["server_ack"]
        assert row["ack_sent"].startswith("MSH|")
        assert row["attempts"] == 1 and row["attempts_since_redrive"] == 1

    def test_text_renders_ack_segments_as_lines(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The terminal form puts each ACK segment on its own line."""
        code, out, _ = run(queue, capsys, "queue", "show", queue.ids["adt1"])
        assert code == 0
        assert "    MSA|AA|ADT0001" in out.splitlines()
        assert "PID|" not in out

    def test_raw_is_exact_bytes(self, queue: Queue, tmp_path: Path) -> None:
        """--raw writes the stored bytes exactly (checked through a real process)."""
        proc = run_process(queue.config, "queue", "show", queue.ids["adt3"], "--raw")
        assert proc.returncode == 0
        assert proc.stdout == queue.bodies[queue.ids["adt3"]]

    def test_unique_prefix(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """A unique id prefix of 8+ characters finds the row."""
        code, out, _ = run(queue, capsys, "queue", "show", queue.ids["adt2"][:13], "--json")
        assert code == 0 and json.loads(out)["id"] == queue.ids["adt2"]

    def test_unknown_id_exit_1(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown id exits 1 with one line."""
        code, out, err = run(queue, capsys, "queue", "show", "00000000-0000-0000-0000-000000000000")
        assert code == 1 and out == "" and err.count("\n") == 1 and "no row" in err

    def test_unknown_id_subprocess(self, queue: Queue) -> None:
        """As a real process an unknown id also exits 1."""
        proc = run_process(queue.config, "queue", "show", "nope")
        assert proc.returncode == 1 and proc.stderr.count(b"\n") == 1


class TestRetry:
    def test_by_state_moves_only_failed(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--state failed re-drives failed rows only; same id, queued, due now, redrive_base = attempts."""
        before = queue.counts()
        code, out, _ = run(queue, capsys, "queue", "retry", "--state", "failed")
        assert code == 0 and "re-drove 1 failed" in out
        failed_id = queue.ids["adt2"]
        assert queue.state(failed_id) == "queued"
        ((attempts, base, due, code_),) = queue.sql(
            "SELECT attempts, redrive_base, next_attempt_at, error_code FROM messages WHERE id = ?",
            failed_id,
        )
        assert (attempts, base, due) == (1, 1, 0) and code_ == "max_attempts"
        after = queue.counts()
        assert after.get("failed", 0) == 0 and after["queued"] == before["queued"] + 1
        assert after["rejected"] == before["rejected"] and after["processed"] == before["processed"]

    def test_by_state_and_channel(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """--channel limits the re-drive to one channel."""
        code, out, _ = run(
            queue, capsys, "queue", "retry", "--state", "rejected", "--channel", "lab"
        )
        assert code == 0 and "re-drove 0" in out
        assert queue.state(queue.ids["adt3"]) == "rejected"
        run(queue, capsys, "queue", "retry", "--state", "rejected", "--channel", "adt")
        assert queue.state(queue.ids["adt3"]) == "queued"

    def test_dry_run_changes_nothing(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--dry-run lists what would move and moves nothing."""
        code, out, err = run(queue, capsys, "queue", "retry", "--state", "failed", "--dry-run")
        assert code == 0 and queue.ids["adt2"] in out and "would re-drive 1" in err
        assert queue.state(queue.ids["adt2"]) == "failed"
        code, out, _ = run(queue, capsys, "queue", "retry", queue.ids["adt3"], "--dry-run")
        assert code == 0 and "would be queued" in out
        assert queue.state(queue.ids["adt3"]) == "rejected"

    def test_by_id_refuses_live_and_settled(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Ids of live or processed rows are named and left alone; the failed one moves; exit 1."""
        code, out, err = run(queue, capsys, "queue", "retry", queue.ids["adt2"], queue.ids["lab1"],
                             queue.ids["adt5"], queue.ids["adt1"], "nope")  # fmt: skip
        assert code == 1
        assert queue.state(queue.ids["adt2"]) == "queued"
        assert queue.state(queue.ids["lab1"]) == "inflight"
        assert queue.state(queue.ids["adt5"]) == "queued"
        assert queue.state(queue.ids["adt1"]) == "processed"
        assert "inflight" in err and "processed" in err
        assert "nope: give at least 8 characters of the id" in err
        assert f"{queue.ids['adt2']}: queued" in out

    def test_usage_errors(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """Ids with --state, neither, or --state processed are usage errors (exit 2)."""
        assert run(queue, capsys, "queue", "retry")[0] == 2
        assert run(queue, capsys, "queue", "retry", "x", "--state", "failed")[0] == 2
        assert run(queue, capsys, "queue", "retry", "x", "--channel", "adt")[0] == 2

    def test_batches(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """More rows than one batch all move, each keeping its id."""
        q = build_queue(tmp_path)
        conn = sqlite3.connect(q.db_path, isolation_level=None)
        try:
            conn.execute("BEGIN")
            for i in range(1234):
                conn.execute(
                    "INSERT INTO messages (id, channel, seq, state, remote, body, body_sha256, attempts,"
                    " received_at, updated_at) VALUES (?, 'lab', ?, 'failed', 'x', ?, '', 3, 1, 1)",
                    (f"bulk-{i:05d}", 1000 + i, b"MSH|x"),
                )
            conn.execute("COMMIT")
        finally:
            conn.close()
        code, out, _ = run(q, capsys, "queue", "retry", "--state", "failed", "--channel", "lab")
        assert code == 0 and "re-drove 1234" in out
        assert q.sql("SELECT count(*), min(redrive_base) FROM messages WHERE id LIKE 'bulk-%' "
                     "AND state = 'queued'") == [(1234, 3)]  # fmt: skip


class TestPurge:
    def test_deletes_old_terminal_rows_only(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Purge deletes rows of the state older than the duration; younger rows and dedupe keys stay."""
        queue.sql(
            "UPDATE messages SET updated_at = updated_at - 10 * 86400 WHERE id = ?",
            queue.ids["adt1"],
        )
        keys_before = queue.sql("SELECT count(*) FROM dedupe_keys")
        code, out, _ = run(
            queue, capsys, "queue", "purge", "--state", "processed", "--older-than", "7d"
        )
        assert code == 0 and "deleted 1 processed" in out
        assert queue.state(queue.ids["adt1"]) is None
        assert queue.state(queue.ids["adt4"]) == "processed"
        assert queue.sql("SELECT count(*) FROM dedupe_keys") == keys_before

    def test_never_live_rows(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """queued, claimed and inflight are refused with exit 2 and no row goes."""
        queue.sql("UPDATE messages SET updated_at = 0")
        before = queue.counts()
        for state in ("queued", "claimed", "inflight"):
            code, _, err = run(
                queue, capsys, "queue", "purge", "--state", state, "--older-than", "0"
            )
            assert code == 2 and "refusing" in err
        assert queue.counts() == before

    def test_live_rows_survive_purge_of_every_terminal_state(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Purging every terminal state with --older-than 0 leaves exactly the live rows."""
        queue.sql("UPDATE messages SET updated_at = 0")
        live = queue.sql(
            "SELECT id FROM messages WHERE state IN ('queued','claimed','inflight') ORDER BY id"
        )
        for state in ("processed", "rejected", "failed", "nacked"):
            assert (
                run(queue, capsys, "queue", "purge", "--state", state, "--older-than", "0")[0] == 0
            )
        assert queue.sql("SELECT id FROM messages ORDER BY id") == live

    def test_dry_run_and_channel(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """--dry-run counts without deleting; --channel restricts."""
        queue.sql("UPDATE messages SET updated_at = 0")
        code, out, _ = run(queue, capsys, "queue", "purge", "--state", "processed", "--older-than", "1h",
                           "--dry-run")  # fmt: skip
        assert code == 0 and "would delete 2" in out and queue.counts()["processed"] == 2
        run(
            queue,
            capsys,
            "queue",
            "purge",
            "--state",
            "processed",
            "--older-than",
            "1h",
            "--channel",
            "lab",
        )
        assert queue.counts()["processed"] == 2

    def test_bad_duration_exit_2_subprocess(self, queue: Queue) -> None:
        """A bad duration and a live state are exit 2 in a real process too."""
        proc = run_process(
            queue.config, "queue", "purge", "--state", "processed", "--older-than", "soon"
        )
        assert proc.returncode == 2 and proc.stderr.count(b"\n") == 1
        proc = run_process(
            queue.config, "queue", "purge", "--state", "queued", "--older-than", "1d"
        )
        assert proc.returncode == 2


class TestExport:
    def test_mllp_round_trip(
        self, queue: Queue, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An MLLP export decodes back, in seq order, to the stored bytes."""
        out_file = tmp_path / "export.mllp"
        code, _, err = run(queue, capsys, "queue", "export", "--state", "processed", str(out_file))
        assert code == 0 and "exported 2 processed" in err
        decoder = mllp.MllpDecoder(1 << 20)
        frames = [
            e.payload for e in decoder.feed(out_file.read_bytes()) if isinstance(e, mllp.Frame)
        ]
        assert frames == [queue.bodies[queue.ids["adt1"]], queue.bodies[queue.ids["adt4"]]]
        assert out_file.stat().st_mode & 0o777 == 0o600
        assert not list(tmp_path.glob("*.partial"))

    def test_lines_to_stdout(self, queue: Queue) -> None:
        """--format lines to `-` writes one segment per line, messages in channel order."""
        proc = run_process(
            queue.config, "queue", "export", "--state", "queued", "--format", "lines", "-"
        )
        assert proc.returncode == 0
        lines = proc.stdout.decode().splitlines()
        assert [ln.split("|")[9] for ln in lines if ln.startswith("MSH")] == [
            "ADT0005",
            "ADT0006",
            "LAB0002",
        ]
        assert b"\r" not in proc.stdout
        assert b"exported 3 queued" in proc.stderr

    def test_empty_selection(
        self, queue: Queue, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """No matching row writes an empty file and says 0."""
        out_file = tmp_path / "none.mllp"
        code, _, err = run(queue, capsys, "queue", "export", "--state", "claimed", str(out_file))
        assert code == 0 and out_file.read_bytes() == b"" and "exported 0" in err


class TestChannel:
    def test_pause_resume_durable(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """pause sets the durable flag (shown in stats), resume clears it."""
        code, out, _ = run(queue, capsys, "channel", "pause", "adt")
        assert code == 0 and "paused" in out
        assert queue.sql("SELECT paused FROM channels WHERE channel = 'adt'") == [(1,)]
        _, out, _ = run(queue, capsys, "queue", "stats", "--json")
        adt = json.loads(out)["channels"]["adt"]
        assert adt["paused"] is True and adt["paused_reason"].startswith("operator")
        code, out, _ = run(queue, capsys, "channel", "pause", "adt")
        assert code == 0 and "already paused" in out
        code, out, _ = run(queue, capsys, "channel", "resume", "adt")
        assert code == 0 and "resumed" in out
        assert queue.sql("SELECT paused FROM channels WHERE channel = 'adt'") == [(0,)]

    def test_unknown_channel_exit_1(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """A channel that is not in the configuration exits 1 with one line."""
        code, _, err = run(queue, capsys, "channel", "pause", "nope")
        assert code == 1 and err.count("\n") == 1 and "no channel named 'nope'" in err

    def test_other_agent_id_refused_for_writes(self, queue: Queue, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
        """A config with another agent.id may read but not change the queue."""
        other = write_config(tmp_path / "other.toml", queue.data_dir, agent_id="edge-other")
        assert main(["queue", "stats", "--config", str(other)]) == 0
        code = main(["channel", "pause", "adt", "--config", str(other)])
        _, err = capsys.readouterr()
        assert code == 1 and "belongs to agent.id 'edge-test'" in err


class TestLocked:
    def test_locked_beyond_busy_timeout(self, queue: Queue, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
        """A write lock held past busy_timeout is one clear line and exit 1; nothing changes."""
        monkeypatch.setenv("HL7_AGENT_QUEUE__BUSY_TIMEOUT", "0.2")
        blocker = sqlite3.connect(queue.db_path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            code, _, err = run(queue, capsys, "queue", "retry", "--state", "failed")
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert code == 1 and "locked" in err and err.count("\n") == 1
        assert queue.state(queue.ids["adt2"]) == "failed"


class TestJsonSchemas:
    def test_list_json_matches_schema(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`queue list --json` (with and without bodies) validates against docs/queue-list.schema.json."""
        schema = load_schema("queue-list.schema.json")
        for extra in ([], ["--show-body"]):
            _, out, _ = run(queue, capsys, "queue", "list", "--json", *extra)
            check_schema(json.loads(out), schema, schema)

    def test_show_json_matches_schema(
        self, queue: Queue, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`queue show --json` of every row validates against docs/queue-show.schema.json."""
        schema = load_schema("queue-show.schema.json")
        for message_id in queue.ids.values():
            _, out, _ = run(queue, capsys, "queue", "show", message_id, "--json")
            check_schema(json.loads(out), schema, schema)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class TestProgress:
    def test_progress_only_on_a_terminal(self) -> None:
        """Progress is drawn in place on a terminal and stays silent when piped."""
        tty, pipe = _Tty(), io.StringIO()
        for stream in (tty, pipe):
            progress = Progress("purge processed", 1500, stream=stream)
            progress.advance(1000)
            progress.advance(500)
            progress.close()
        assert tty.getvalue() == "\rpurge processed 1000/1500\rpurge processed 1500/1500\n"
        assert pipe.getvalue() == ""
