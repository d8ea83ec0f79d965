"""`queue fail`, id prefixes, the audit entries, and what list/show print (docs/operations.md).

The same real queue database as tests/integration/test_queue_cli.py (built
with the daemon's own store code); commands through ``agent.app.cli.main``,
and as real processes where the terminal matters (a real pseudo-terminal
for ``show --raw``).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.app.cli import main
from agent.app.commands import moves
from agent.app.commands.common import operator
from agent.core.acks import read_ack_code, server_reason
from agent.storage import sqlite as db
from agent.storage.store import IntakeItem, SqliteStore
from tests.integration.test_queue_cli import (
    AGENT_ID,
    REPO,
    Queue,
    build_queue,
    check_schema,
    load_schema,
    run,
    run_process,
)

ACK_422 = ("MSH|^~\\&|RAPP|RFAC|LAB|HOSP|20240101120001||ACK^A01^ACK|S9|P|2.5\r"
           "MSA|AE|ADT0003|unknown patient identifier in PID-3\rERR|||204^Unknown key identifier^HL70357|E\r")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("HL7_AGENT_") or name == "COLUMNS":
            monkeypatch.delenv(name)


@pytest.fixture
def queue(tmp_path: Path) -> Queue:
    q = build_queue(tmp_path)
    # The rejected row as the dispatcher now settles it: the server's ACK and its reason.
    q.sql("UPDATE messages SET server_ack = ?, server_reason = ?, error_code = '422' WHERE id = ?",
          ACK_422, server_reason(ACK_422), q.ids["adt3"])
    return q


def entries(q: Queue) -> list[dict[str, Any]]:
    rows = q.sql("SELECT action, os_user, pid, channel, reason, rows, detail, status, logged_at "
                 "FROM operator_actions ORDER BY id")
    keys = ("action", "os_user", "pid", "channel", "reason", "rows", "detail", "status", "logged_at")
    out = [dict(zip(keys, r, strict=True)) for r in rows]
    for e in out:
        e["detail"] = json.loads(e["detail"])
    return out


def add_row(q: Queue, message_id: str, *, state: str = "queued", channel: str = "adt",
            body: bytes = b"MSH|^~\\&|LAB|HOSP|R|F|2024||ADT^A01|X1|P|2.5\rPID|1\r") -> None:
    """A row with a chosen id (for prefixes) or odd bytes, as test data."""
    seq = q.sql("SELECT coalesce(max(seq), 0) + 1 FROM messages WHERE channel = ?", channel)[0][0]
    q.sql("INSERT INTO messages (id, channel, seq, state, remote, body, body_sha256, received_at, updated_at)"
          " VALUES (?, ?, ?, ?, '10.0.0.9:1', ?, '', ?, ?)", message_id, channel, seq, state, body,
          time.time(), time.time())


class TestFail:
    def test_sets_a_queued_row_aside_with_the_reason(self, queue: Queue,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
        """A queued row becomes failed (code set_aside, who and why in error_text); exit 0."""
        target = queue.ids["adt5"]
        code, out, err = run(queue, capsys, "queue", "fail", target, "--reason", "wrong patient\n(MRN)")
        assert code == 0, err
        assert f"{target}: set aside as failed (was queued, channel adt, seq 5)" in out
        assert "channel adt goes on with its next row" in err
        ((state, error_code, error_text),) = queue.sql(
            "SELECT state, error_code, error_text FROM messages WHERE id = ?", target)
        assert (state, error_code) == ("failed", moves.SET_ASIDE_CODE)
        assert error_text == f"set aside by {operator()}: wrong patient (MRN)"
        assert queue.state(queue.ids["adt6"]) == "queued"

    def test_never_touches_claimed_or_inflight(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """A row the dispatcher holds is refused with its state and what to do; it stays as it was."""
        queue.sql("UPDATE messages SET state = 'claimed' WHERE id = ?", queue.ids["lab2"])
        before = queue.sql("SELECT * FROM messages ORDER BY id")
        code, out, err = run(queue, capsys, "queue", "fail", queue.ids["lab1"], queue.ids["lab2"])
        assert code == 1 and out == ""
        lines = err.splitlines()
        assert len(lines) == 2
        assert "it is inflight (it was sent and waits for the server's answer)" in lines[0]
        assert "it is claimed (the dispatcher has taken it to send it now)" in lines[1]
        assert all("`hl7-agent channel pause lab`" in ln and "try again" in ln for ln in lines)
        assert queue.sql("SELECT * FROM messages ORDER BY id") == before

    def test_settled_rows_refused(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """processed, rejected, failed and nacked rows are named and left alone; the queued one moves."""
        code, _, err = run(queue, capsys, "queue", "fail", queue.ids["adt1"], queue.ids["adt3"],
                           queue.ids["adt2"], queue.ids["nacked"], queue.ids["adt6"])
        assert code == 1
        assert "it is processed (settled" in err and "it is rejected (settled" in err
        assert "it is failed already" in err and "audit row" in err
        assert [queue.state(queue.ids[k]) for k in ("adt1", "adt3", "adt2", "nacked", "adt6")] == [
            "processed", "rejected", "failed", "nacked", "failed"]

    def test_retry_brings_it_back_with_its_seq(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """queue retry re-queues a set-aside row with the same id and seq (it is the head again)."""
        target = queue.ids["adt5"]
        assert run(queue, capsys, "queue", "fail", target)[0] == 0
        assert run(queue, capsys, "queue", "retry", target)[0] == 0
        assert queue.sql("SELECT state, seq, next_attempt_at FROM messages WHERE id = ?", target) == [
            ("queued", 5, 0)]

    def test_no_pause_and_no_other_row_changes(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """Setting aside never pauses a channel (on_reject is the dispatcher's) and moves nothing else."""
        others = queue.sql("SELECT id, state, updated_at FROM messages WHERE id <> ? ORDER BY id",
                           queue.ids["adt5"])
        assert run(queue, capsys, "queue", "fail", queue.ids["adt5"])[0] == 0
        assert queue.sql("SELECT count(*) FROM channels WHERE paused = 1") == [(0,)]
        assert queue.sql("SELECT id, state, updated_at FROM messages WHERE id <> ? ORDER BY id",
                         queue.ids["adt5"]) == others

    def test_a_waiting_sender_is_owed_an_ae(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """On an application channel the row gets the AE its sender is relayed: not delivered, and why."""
        conn = db.open_database(queue.db_path, AGENT_ID, db.DatabaseOptions(), time.time())
        store = SqliteStore(conn, db.load_queries(), db_path=queue.db_path)
        try:
            with store.transaction():
                result = store.intake(IntakeItem(
                    channel="adt", remote="10.0.0.5:5000", sending_app="LAB", sending_facility="HOSP",
                    control_id="APP00001", message_type="ADT^A01", encoding="utf-8", ack_mode="application",
                    body=b"MSH|^~\\&|LAB|HOSP|RAPP|RFAC|20240101||ADT^A01|APP00001|P|2.5\rPID|1\r"))
        finally:
            conn.close()
        assert run(queue, capsys, "queue", "fail", result.message_id, "--reason", "duplicate order")[0] == 0
        ((app_ack,),) = queue.sql("SELECT app_ack FROM messages WHERE id = ?", result.message_id)
        assert read_ack_code(app_ack) == "AE" and b"MSA|AE|APP00001|" in app_ack
        assert server_reason(app_ack.decode()) == f"not delivered: set aside by {operator()}: duplicate order"
        assert queue.sql("SELECT app_ack FROM dedupe_keys WHERE message_id = ?", result.message_id) == [(app_ack,)]

    def test_needs_ids(self, queue: Queue) -> None:
        """Without an id it is a usage error (exit 2)."""
        assert run_process(queue.config, "queue", "fail").returncode == 2

    def test_missing_database(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """On a missing database: one line, exit 1, nothing created."""
        from tests.integration.test_queue_cli import write_config

        config = write_config(tmp_path / "agent.toml", tmp_path / "nodata")
        code = main(["queue", "fail", "ccf67946", "--config", str(config)])
        _, err = capsys.readouterr()
        assert code == 1 and "no queue database at" in err and not (tmp_path / "nodata").exists()


class TestIdPrefixes:
    """show, retry and fail take ids by the same rules."""

    COMMANDS = (("queue", "show"), ("queue", "retry"), ("queue", "fail"))

    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[1])
    def test_too_short(self, queue: Queue, capsys: pytest.CaptureFixture[str], command: tuple[str, str]) -> None:
        """Fewer than 8 hex digits: 'give at least 8 characters of the id', exit 1, nothing changes."""
        before = queue.sql("SELECT id, state FROM messages ORDER BY id")
        code, out, err = run(queue, capsys, *command, queue.ids["adt2"][:4])
        assert code == 1 and out == ""
        assert err == f"hl7-agent: {queue.ids['adt2'][:4]}: give at least 8 characters of the id\n"
        assert queue.sql("SELECT id, state FROM messages ORDER BY id") == before

    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[1])
    def test_unknown(self, queue: Queue, capsys: pytest.CaptureFixture[str], command: tuple[str, str]) -> None:
        """A long enough prefix of no row: 'no row with id …', exit 1."""
        code, _, err = run(queue, capsys, *command, "ffffffff-ffff")
        assert code == 1 and err == "hl7-agent: no row with id ffffffff-ffff\n"

    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[1])
    def test_ambiguous_names_the_candidates(self, queue: Queue, capsys: pytest.CaptureFixture[str],
                                            command: tuple[str, str]) -> None:
        """A prefix of two rows names both (with state and channel) on one line; neither moves."""
        add_row(queue, "abcdef12-0000-4000-8000-000000000001", state="failed")
        add_row(queue, "abcdef12-1111-4000-8000-000000000002", state="queued", channel="lab")
        code, _, err = run(queue, capsys, *command, "ABCDEF12")
        assert code == 1 and err.count("\n") == 1
        assert ("id prefix abcdef12 matches several rows: abcdef12-0000-4000-8000-000000000001 (failed, adt), "
                "abcdef12-1111-4000-8000-000000000002 (queued, lab); give more of the id") in err
        assert queue.state("abcdef12-0000-4000-8000-000000000001") == "failed"
        assert queue.state("abcdef12-1111-4000-8000-000000000002") == "queued"

    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[1])
    def test_unique_prefix_in_any_case(self, queue: Queue, capsys: pytest.CaptureFixture[str],
                                       command: tuple[str, str]) -> None:
        """8 characters of the id, upper case too, name the row for each command."""
        target = queue.ids["adt2"] if command[1] != "fail" else queue.ids["adt5"]
        code, out, err = run(queue, capsys, *command, target[:8].upper())
        assert code == 0, err
        assert target in out

    def test_retry_by_prefix_moves_the_row(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """retry took no prefix before (it said 'no such row' for one show accepted)."""
        assert run(queue, capsys, "queue", "retry", queue.ids["adt2"][:8])[0] == 0
        assert queue.state(queue.ids["adt2"]) == "queued"


class TestAuditEntries:
    def test_each_action_writes_one_entry(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """pause, resume, retry, fail and purge each record what they did, who and where."""
        queue.sql("UPDATE messages SET updated_at = 0 WHERE state = 'processed'")
        for argv in (["channel", "pause", "adt"], ["channel", "resume", "adt"],
                     ["queue", "retry", queue.ids["adt2"]], ["queue", "retry", "--state", "rejected"],
                     ["queue", "fail", queue.ids["adt6"], "--reason", "bad MRN"],
                     ["queue", "purge", "--state", "processed", "--older-than", "1d"]):
            assert run(queue, capsys, *argv)[0] == 0, argv
        got = entries(queue)
        me = operator()
        assert [(e["action"], e["channel"], e["rows"], e["status"], e["os_user"]) for e in got] == [
            ("pause", "adt", 0, "done", me), ("resume", "adt", 0, "done", me),
            ("retry", "adt", 1, "done", me), ("retry", None, 1, "done", me),
            ("fail", "adt", 1, "done", me), ("purge", None, 2, "done", me)]
        assert got[2]["detail"] == {"ids": [queue.ids["adt2"]], "channels": {"adt": 1}}
        assert got[3]["detail"] == {"state": "rejected", "channels": {"adt": 1}}
        assert got[4]["detail"] == {"ids": [queue.ids["adt6"]], "channels": {"adt": 1}}
        assert got[4]["reason"] == "bad MRN"
        assert got[5]["detail"]["state"] == "processed" and got[5]["detail"]["older_than"] == "1d"
        assert all(e["logged_at"] is None and e["pid"] > 0 for e in got)

    def test_nothing_changed_nothing_recorded(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """Dry runs, an already paused channel, a purge of nothing and refused ids leave no entry."""
        run(queue, capsys, "channel", "pause", "lab")
        before = len(entries(queue))
        for argv in (["channel", "pause", "lab"], ["channel", "resume", "adt"],
                     ["queue", "retry", "--state", "failed", "--dry-run"],
                     ["queue", "retry", queue.ids["adt2"], "--dry-run"],
                     ["queue", "purge", "--state", "processed", "--older-than", "30d"],
                     ["queue", "fail", queue.ids["lab1"]], ["queue", "retry", queue.ids["adt1"]]):
            run(queue, capsys, *argv)
        assert len(entries(queue)) == before

    def test_batches_make_one_entry(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """A re-drive over several batches keeps one entry, finished with the last batch."""
        for i in range(1234):
            add_row(queue, f"bulk-{i:05d}", state="failed", channel="lab")
        assert run(queue, capsys, "queue", "retry", "--state", "failed")[0] == 0
        (entry,) = entries(queue)
        assert (entry["action"], entry["rows"], entry["status"]) == ("retry", 1235, "done")
        assert entry["detail"] == {"state": "failed", "channels": {"adt": 1, "lab": 1234}}

    def test_cut_short_says_interrupted(self, queue: Queue, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """Ctrl-C between batches leaves the entry 'interrupted' with what did commit.

        A fake for the interruption only (KeyboardInterrupt raised by the second
        batch): the moment between two batches cannot be hit by a real signal reliably.
        """
        for i in range(1500):
            add_row(queue, f"bulk-{i:05d}", state="failed", channel="lab")
        real = SqliteStore.redrive_state
        calls = {"n": 0}

        def second_fails(self: SqliteStore, *args: Any, **kwargs: Any) -> list[str]:
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)

        monkeypatch.setattr(SqliteStore, "redrive_state", second_fails)
        assert main(["queue", "retry", "--state", "failed", "--config", str(queue.config)]) == 130
        capsys.readouterr()
        (entry,) = entries(queue)
        assert (entry["rows"], entry["status"]) == (moves.RETRY_BATCH, "interrupted")


class TestList:
    def test_fits_100_columns_when_not_a_terminal(self, queue: Queue) -> None:
        """Piped, the table is at most 100 columns: ids as unique 8-character prefixes, the error cut."""
        proc = run_process(queue.config, "queue", "list")
        assert proc.returncode == 0
        lines = proc.stdout.decode().splitlines()
        assert max(len(ln) for ln in lines) <= 100, lines
        shown = {ln.split()[0] for ln in lines[1:]}
        assert shown == {i[:8] for i in queue.ids.values()}
        rejected = next(ln for ln in lines if ln.startswith(queue.ids["adt3"][:8]))
        assert rejected.split("  ")[-1].startswith("422: unknow") and rejected.endswith("…")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rejected.split()[7])  # times stay whole

    def test_wide_terminal_gets_everything(self, queue: Queue, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
        """With room ($COLUMNS wide), whole ids, millisecond times and the whole server reason."""
        monkeypatch.setenv("COLUMNS", "250")
        code, out, _ = run(queue, capsys, "queue", "list")
        assert code == 0
        assert queue.ids["adt3"] in out and "422: unknown patient identifier in PID-3" in out
        assert all(len(ln) <= 250 for ln in out.splitlines())

    def test_narrow_terminal_cuts_text_columns(self, queue: Queue, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
        """At 95 columns the error text gives way (ending in …); ids, states and times stay whole."""
        monkeypatch.setenv("COLUMNS", "95")
        _, out, _ = run(queue, capsys, "queue", "list")
        lines = out.splitlines()
        assert max(len(ln) for ln in lines) <= 95
        assert any("…" in ln for ln in lines)
        assert all(ln.split()[0] in {i[:8] for i in queue.ids.values()} for ln in lines[1:])

    def test_json_unchanged_plus_reason(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """JSON is not fitted: whole ids and times, and the added error_text and server_reason."""
        _, out, _ = run(queue, capsys, "queue", "list", "--control-id", "ADT0003", "--json")
        (item,) = json.loads(out)
        assert item["id"] == queue.ids["adt3"] and item["received_at"].endswith("Z")
        assert item["server_reason"] == "unknown patient identifier in PID-3"
        assert item["error_text"] == "unknown patient"
        schema = load_schema("queue-list.schema.json")
        check_schema([item], schema, schema)
        assert {"error_text", "server_reason"} <= set(schema["items"]["properties"])


class TestShow:
    def test_unset_fields_are_one_dash(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """In text every field without a value — NULL or empty — is '-'; JSON keeps null and ''."""
        nacked = queue.ids["nacked"]
        _, out, _ = run(queue, capsys, "queue", "show", nacked)
        fields = dict(ln.split(None, 1) for ln in out.split("\n\n")[0].splitlines())
        for key in ("sending_app", "sending_facility", "control_id", "message_type", "seq",
                    "claimed_at", "server_status", "server_reason"):
            assert fields[key] == "-", key
        _, out, _ = run(queue, capsys, "queue", "show", nacked, "--json")
        data = json.loads(out)
        assert data["sending_app"] == "" and data["claimed_at"] is None and data["server_reason"] is None

    def test_server_reason_shown(self, queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
        """The server's reason is a field of its own, in text and JSON (docs/queue-show.schema.json)."""
        _, out, _ = run(queue, capsys, "queue", "show", queue.ids["adt3"])
        assert "server_reason" in out and "unknown patient identifier in PID-3" in out.split("\n\n")[0]
        _, out, _ = run(queue, capsys, "queue", "show", queue.ids["adt3"], "--json")
        data = json.loads(out)
        assert data["server_reason"] == "unknown patient identifier in PID-3"
        schema = load_schema("queue-show.schema.json")
        check_schema(data, schema, schema)
        assert "server_reason" in schema["properties"]

    def test_raw_on_a_terminal_does_not_overwrite_itself(self, queue: Queue) -> None:
        """On a real pseudo-terminal, one segment per line (no CR) and control bytes escaped."""
        hostile = b"MSH|^~\\&|LAB|HOSP|R|F|2024||ADT^A01|X1|P|2.5\rPID|1||\x1b[2J\x07|\r\nPV1|1\r"
        add_row(queue, "feedface-0000-4000-8000-000000000001", body=hostile)
        out = run_on_pty(queue.config, "queue", "show", "feedface", "--raw")
        assert b"\r" not in out.replace(b"\r\n", b"\n")  # the pty turns \n into \r\n, nothing else
        lines = out.replace(b"\r\n", b"\n").decode().splitlines()
        assert lines == ["MSH|^~\\&|LAB|HOSP|R|F|2024||ADT^A01|X1|P|2.5", "PID|1||\\x1b[2J\\x07|", "PV1|1"]

    def test_raw_redirected_is_the_exact_bytes(self, queue: Queue) -> None:
        """Into a pipe or a file, the stored bytes exactly, CRs and all."""
        hostile = b"MSH|^~\\&|LAB|HOSP|R|F|2024||ADT^A01|X1|P|2.5\rPID|1||\x1b[2J|\r"
        add_row(queue, "feedface-0000-4000-8000-000000000001", body=hostile)
        proc = run_process(queue.config, "queue", "show", "feedface", "--raw")
        assert proc.returncode == 0 and proc.stdout == hostile


def run_on_pty(config: Path, *argv: str, timeout: float = 30.0) -> bytes:
    """Run one command with stdout on a pseudo-terminal; what it printed there."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    proc = subprocess.Popen([sys.executable, "-m", "agent", *argv, "--config", str(config)],
                            stdout=slave, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed its side
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return out


class TestOlderSchema:
    def test_read_commands_say_so_write_commands_upgrade(self, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """A schema-1 file (its daemon not upgraded yet): list says what to do instead of a SQL error;
        a write command applies the additive migration first, then everything reads it."""
        from tests.integration.test_queue_cli import write_config

        data_dir = tmp_path / "data"
        config = write_config(tmp_path / "agent.toml", data_dir)
        first = db.load_migrations()[:1]
        monkeypatch.setattr(db, "load_migrations", lambda: first)
        monkeypatch.setattr(db, "SCHEMA_VERSION", 1)
        db.open_database(data_dir / "queue.db", AGENT_ID, db.DatabaseOptions(), time.time()).close()
        monkeypatch.undo()
        for name in list(os.environ):
            if name.startswith("HL7_AGENT_"):
                monkeypatch.delenv(name)
        code = main(["queue", "list", "--config", str(config)])
        _, err = capsys.readouterr()
        assert code == 1 and err.count("\n") == 1
        assert "has schema 1, this hl7-agent reads schema 2: start this version's daemon once" in err
        assert main(["channel", "pause", "adt", "--config", str(config)]) == 0
        capsys.readouterr()
        assert main(["queue", "list", "--config", str(config)]) == 0
        conn = db.connect(data_dir / "queue.db", db.DatabaseOptions(), create=False)
        try:
            assert db.read_meta(conn)["schema_version"] == "2"
        finally:
            conn.close()
