"""Hostile MSH-18 values against the daemon as a subprocess: no crash loop, every row settles.

MSH-18 names a character set. A name that Python's codec registry accepts but
that is no character set (``idna``, ``punycode``, ``rot13``, UTF-16, a name
with a NUL byte) used to be stored as the row's encoding; building the
application ACK with it then raised inside the dispatcher, the daemon exited
and the row stayed ``inflight`` — the same crash at every restart. Intake now
refuses such names (AE/CE, ERR-3 103), and the dispatcher settles any row,
also one an older version stored, even when its ACK cannot be built.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.storage import sqlite as db
from agent.storage.store import IntakeItem, SqliteStore
from tests.agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    err3,
    free_port,
    hl7_message,
    toml_config,
    wait_for,
)

pytestmark = pytest.mark.slow


def with_msh18(message: bytes, charset: str, *, msh15: str = "", msh16: str = "") -> bytes:
    """``message`` (whose MSH ends at MSH-12) with MSH-15/16 and MSH-18 set."""
    msh, rest = message.split(b"\r", 1)
    return msh + f"|||{msh15}|{msh16}||{charset}".encode("latin-1") + b"\r" + rest


def config(tmp_path: Path, server: DevServerThread, port: int, **channel: Any) -> str:
    return toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}", **channel}],
                       server_url=server.url)


def states(tmp_path: Path) -> dict[str, str]:
    rows = db_rows(tmp_path / "data" / "queue.db",
                   "SELECT control_id, state FROM messages WHERE state <> 'nacked'")
    return {str(cid): str(state) for cid, state in rows}


def audit_codes(tmp_path: Path) -> dict[str, str]:
    rows = db_rows(tmp_path / "data" / "queue.db",
                   "SELECT control_id, error_code FROM messages WHERE state = 'nacked'")
    return {str(cid): str(code) for cid, code in rows}


@pytest.fixture
def server() -> Iterator[DevServerThread]:
    s = DevServerThread().start()
    try:
        yield s
    finally:
        s.stop()


def assert_alive(daemon: Daemon) -> None:
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, f"daemon exited with {daemon.proc.returncode}:\n{daemon.log_tail()}"


class TestIntake:
    @pytest.mark.parametrize(
        ("channel", "msh15", "msh16"),
        [({}, "NE", "AL"), ({}, "AL", "AL"), ({"ack": "application"}, "", "")],
        ids=["enhanced-NE-AL", "enhanced-AL-AL", "application-channel"],
    )
    def test_msh18_idna_is_refused_and_the_daemon_keeps_serving(
        self, tmp_path: Path, server: DevServerThread, daemons: list[Daemon],
        channel: dict[str, Any], msh15: str, msh16: str,
    ) -> None:
        """MSH-18 ``idna`` gets AE/CE 103 (or nothing, where MSH-15 NE waives it), an audit row, and no row to dispatch."""
        port = free_port()
        daemon = Daemon(tmp_path, config(tmp_path, server, port, **channel)).start()
        daemons.append(daemon)
        daemon.wait_started()
        hostile = with_msh18(hl7_message("IDNA-1"), "idna", msh15=msh15, msh16=msh16)
        with MllpClient(port) as client:
            client.send(hostile)
            if msh15 != "NE":
                ack = client.read_ack()
                assert (ack_code(ack), err3(ack)) == ("CE" if msh15 else "AE", "103")
            wait_for(lambda: audit_codes(tmp_path).get("IDNA-1") == "103", 10, what="audit row 103")
            # The channel still works end to end after it.
            client.send(hl7_message("AFTER-1", msh15="AL", msh16="AL"))
            assert ack_code(client.read_ack()) == "CA"
            wait_for(lambda: states(tmp_path).get("AFTER-1") == "processed", 15, what="AFTER-1 processed")
            assert ack_code(client.read_ack()) == "AA"  # the server's application ACK, relayed
        assert "IDNA-1" not in states(tmp_path)
        assert_alive(daemon)
        assert daemon.stop() == 0


class TestStoredRowsFromOlderVersions:
    #: Encodings an older version could store from MSH-18: each one broke ACK building or decoding.
    HOSTILE = ("idna", "punycode", "utf-16", "rot13", "a\x00b", "raw_unicode_escape")

    def _seed(self, tmp_path: Path) -> list[str]:
        """Rows as the old intake wrote them, through the real store, before the daemon ever runs."""
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "test-agent", db.DatabaseOptions(), time.time())
        store = SqliteStore(conn, db.load_queries(), db_path=path)
        ids = []
        try:
            for n, encoding in enumerate(self.HOSTILE):
                for mode in ("enhanced", "application"):
                    cid = f"OLD-{mode[:3].upper()}-{n}"
                    msh16 = "AL" if mode == "enhanced" else ""
                    body = with_msh18(hl7_message(cid), encoding.replace("\x00", ""),
                                      msh15="NE" if mode == "enhanced" else "", msh16=msh16)
                    result = store.intake(IntakeItem(
                        channel="adt", remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
                        control_id=cid, message_type="ADT^A01^ADT_A01", body=body, encoding=encoding,
                        ack_mode=mode,  # type: ignore[arg-type]
                        accept_ack_type="NE" if mode == "enhanced" else "", application_ack_type=msh16,
                    ))
                    assert result.outcome == "accepted"
                    ids.append(cid)
        finally:
            conn.close()
        return ids

    def test_every_stored_row_settles_and_the_daemon_keeps_running(
        self, tmp_path: Path, server: DevServerThread, daemons: list[Daemon]
    ) -> None:
        """A queue an older version filled with hostile encodings drains: each row settles, no crash, no loop."""
        ids = self._seed(tmp_path)
        port = free_port()
        daemon = Daemon(tmp_path, config(tmp_path, server, port)).start()
        daemons.append(daemon)
        daemon.wait_started()

        def all_settled() -> bool:
            assert_alive(daemon)
            current = states(tmp_path)
            return all(current.get(cid) in ("processed", "rejected", "failed") for cid in ids)

        wait_for(all_settled, 30, what="every stored row settled")
        with MllpClient(port) as client:
            assert ack_code(client.exchange(hl7_message("FRESH-1"))) == "AA"
        wait_for(lambda: states(tmp_path).get("FRESH-1") == "processed", 15, what="FRESH-1 processed")
        assert_alive(daemon)
        assert daemon.stop() == 0
