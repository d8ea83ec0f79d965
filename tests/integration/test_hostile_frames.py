"""Hostile frames over real TCP: every readable MSH gets an answer, every ACK is one clean frame.

The agent runs in process on 127.0.0.1 (port 0) with a real SQLite file.
Frames are pipelined: ACKs of one connection are written in arrival order,
so the ACK of the good frame sent after a hostile one proves, by order, what
the hostile one got — and that the connection kept serving.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.app.config import ChannelSettings
from agent.core import intake_policy, mllp
from agent.storage import sqlite as db
from agent.storage.store import IntakeItem, SqliteStore
from tests.agenttest import (
    ack_code,
    db_rows,
    err3,
    hl7_message,
    log_events,
    msa2,
    run_async,
    run_with_agent,
)

CHANNEL = ChannelSettings(name="adt", listen="127.0.0.1:0")


def with_msh18(message: bytes, charset: bytes) -> bytes:
    msh, rest = message.split(b"\r", 1)
    return msh + b"||||||" + charset + b"\r" + rest


class Wire:
    """One sender connection that keeps every MLLP event it reads (frames and junk)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = mllp.MllpDecoder(1 << 20)
        self.frames: list[bytes] = []
        self.junk = 0

    @classmethod
    async def open(cls, port: int) -> Wire:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, *payloads: bytes) -> None:
        self.writer.write(b"".join(mllp.encode_frame(p) for p in payloads))
        await self.writer.drain()

    async def read_frames(self, count: int) -> list[bytes]:
        """The next ``count`` ACK frames (a deadline, never a fixed sleep)."""
        async with asyncio.timeout(10):
            while len(self.frames) < count:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("closed by the agent")
                for event in self.decoder.feed(data):
                    if isinstance(event, mllp.Frame):
                        self.frames.append(event.payload)
                    elif isinstance(event, mllp.JunkSkipped):
                        self.junk += event.count
        taken, self.frames = self.frames[:count], self.frames[count:]
        return taken

    def close(self) -> None:
        self.writer.close()


def assert_clean_ack(ack: bytes) -> None:
    """One ACK: no block byte inside, an MSH first and an MSA."""
    assert b"\x0b" not in ack and b"\x1c" not in ack, ack
    assert ack.startswith(b"MSH") and b"\rMSA" in ack, ack


def audit_rows(tmp_path: Path) -> dict[str, str]:
    rows = db_rows(tmp_path / "data" / "queue.db",
                   "SELECT control_id, error_code FROM messages WHERE state = 'nacked'")
    return {str(cid): str(code) for cid, code in rows}


class TestUnusableCharset:
    @pytest.mark.parametrize(
        "charset", [b"idna", b"a\x00b", b"\x00", b"rot13", b"base64", b"zlib", b"punycode", b"cp1252", b"UTF\x1c8"],
        ids=["idna", "nul-inside", "nul", "rot13", "base64", "zlib", "punycode", "cp1252", "fs-inside"],
    )
    def test_gets_ae_103_and_an_audit_row(self, tmp_path: Path, charset: bytes) -> None:
        """MSH-18 naming no character set (a Python transform, a NUL) gets AE 103 and an audit row; the connection goes on."""

        async def scenario(port: int) -> None:
            wire = await Wire.open(port)
            try:
                await wire.send(with_msh18(hl7_message("BAD-CS"), charset), hl7_message("GOOD-1"))
                bad, good = await wire.read_frames(2)
            finally:
                wire.close()
            assert (ack_code(bad), err3(bad), msa2(bad)) == ("AE", "103", "BAD-CS")
            assert_clean_ack(bad)
            assert (ack_code(good), msa2(good)) == ("AA", "GOOD-1")
            assert wire.junk == 0

        run_with_agent(tmp_path, CHANNEL, scenario)
        assert audit_rows(tmp_path) == {"BAD-CS": "103"}


class TestAuditRowIds:
    def test_the_log_lines_of_audit_rows_name_the_rows(self, tmp_path: Path) -> None:
        """A reject, a frame without MSH and an inbound ACK: each line carries its audit row's id."""

        async def scenario(port: int) -> None:
            wire = await Wire.open(port)
            try:
                await wire.send(with_msh18(hl7_message("BAD-CS"), b"rot13"), b"PID|1||4711\r",
                                b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK|IN-ACK|P|2.5\rMSA|AA|X\r",
                                hl7_message("GOOD-1"))
                bad, good = await wire.read_frames(2)
            finally:
                wire.close()
            assert (ack_code(bad), ack_code(good)) == ("AE", "AA")

        with capture_logs() as logs:
            run_with_agent(tmp_path, CHANNEL, scenario)
        ids = {str(code): str(row_id) for row_id, code in db_rows(
            tmp_path / "data" / "queue.db", "SELECT id, error_code FROM messages WHERE state = 'nacked'")}
        assert set(ids) == {"103", "100", "0"}
        assert [e["id"] for e in log_events(logs, "message_rejected")] == [ids["103"]]
        assert [e["id"] for e in log_events(logs, "frame_without_msh_dropped")] == [ids["100"]]
        assert [e["id"] for e in log_events(logs, "inbound_ack_recorded")] == [ids["0"]]


class TestFramingBytesInFields:
    def test_fs_at_the_end_of_msh12_gives_one_clean_accept_ack(self, tmp_path: Path) -> None:
        """A 0x1C at the end of MSH-12 (payload: LF, not CR, after it) is committed and answered by one readable AA frame.

        The ACK ends its MSH with CR: a raw copy of that 0x1C made an end block there.
        """
        message = hl7_message("FS-12").replace(b"\r", b"\n").replace(b"|2.5.1\n", b"|2.5.1\x1c\n", 1)
        assert mllp.MllpDecoder(1 << 20).feed(mllp.encode_frame(message)) == [mllp.Frame(message)]

        async def scenario(port: int) -> None:
            wire = await Wire.open(port)
            try:
                await wire.send(message, hl7_message("AFTER-FS"))
                first, second = await wire.read_frames(2)
                # A retransmit gets the stored ACK replayed: just as clean.
                await wire.send(message)
                (replayed,) = await wire.read_frames(1)
            finally:
                wire.close()
            assert_clean_ack(first)
            assert (ack_code(first), msa2(first)) == ("AA", "FS-12")
            assert b"|2.5.1\\X1C\\\r" in first
            assert (ack_code(second), msa2(second)) == ("AA", "AFTER-FS")
            assert replayed == first
            assert wire.junk == 0

        run_with_agent(tmp_path, CHANNEL, scenario)

    def test_reject_ack_of_a_broken_msh_is_clean_too(self, tmp_path: Path) -> None:
        """MSH-9 missing and 0x1C in MSH-3 and MSH-12: AE 101 in one frame, the 0x1C escaped."""
        message = b"MSH|^~\\&|LA\x1cB|NORTH|EHR|CENTRAL|20260101||||P|2.5.1\x1c\nPID|1\n"

        async def scenario(port: int) -> None:
            wire = await Wire.open(port)
            try:
                await wire.send(message, hl7_message("AFTER-REJECT"))
                reject, good = await wire.read_frames(2)
            finally:
                wire.close()
            assert_clean_ack(reject)
            assert (ack_code(reject), err3(reject)) == ("AE", "101")
            assert b"|LA\\X1C\\B|" in reject
            assert ack_code(good) == "AA"
            assert wire.junk == 0

        run_with_agent(tmp_path, CHANNEL, scenario)

    def test_ack_stored_by_an_older_version_is_replayed_as_one_frame(self, tmp_path: Path) -> None:
        """A commit ACK stored with a raw 0x1C (older versions copied it) goes out as one frame on a retransmit."""
        message = hl7_message("OLD-ACK")
        stored = b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK^A01^ACK|A1|P|2.5.1\x1c\rMSA|AA|OLD-ACK\r"
        path = tmp_path / "data" / "queue.db"
        conn = db.open_database(path, "inproc", db.DatabaseOptions(), time.time())
        try:
            result = SqliteStore(conn, db.load_queries(), db_path=path).intake(IntakeItem(
                channel="adt", remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
                control_id="OLD-ACK", message_type="ADT^A01^ADT_A01", body=message, encoding="utf-8",
                ack_mode="commit", commit_ack=stored,
            ))
            assert result.outcome == "accepted"
        finally:
            conn.close()

        async def scenario(port: int) -> None:
            wire = await Wire.open(port)
            try:
                await wire.send(message, hl7_message("AFTER-OLD"))
                replayed, good = await wire.read_frames(2)
            finally:
                wire.close()
            assert_clean_ack(replayed)
            assert (ack_code(replayed), msa2(replayed)) == ("AA", "OLD-ACK")
            assert (ack_code(good), msa2(good)) == ("AA", "AFTER-OLD")
            assert wire.junk == 0

        run_with_agent(tmp_path, CHANNEL, scenario)


class TestHandlerFailure:
    def test_a_bug_in_the_handler_still_answers_ae_207_with_an_audit_row(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A fault no real input causes any more (so it is injected): the sender still gets AE 207, an audit row is kept.

        ``intake_policy.unsupported_reason`` is replaced by one that raises with
        message text in its error; the log names only the exception type.
        """

        def broken(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError("PID|1||SECRET-PATIENT")

        monkeypatch.setattr(intake_policy, "unsupported_reason", broken)

        async def scenario(port: int) -> None:
            wire = await Wire.open(port)
            try:
                await wire.send(hl7_message("BUG-1"), hl7_message("BUG-2", msh15="AL", msh16="NE"),
                                hl7_message("BUG-3", msh15="NE"))
                first, second = await wire.read_frames(2)
                monkeypatch.undo()
                await wire.send(hl7_message("AFTER-BUG"))
                (after,) = await wire.read_frames(1)
            finally:
                wire.close()
            assert (ack_code(first), err3(first), msa2(first)) == ("AE", "207", "BUG-1")
            assert (ack_code(second), err3(second), msa2(second)) == ("CE", "207", "BUG-2")
            assert (ack_code(after), msa2(after)) == ("AA", "AFTER-BUG")

        with capture_logs() as logs:
            run_async(asyncio.to_thread(run_with_agent, tmp_path, CHANNEL, scenario))
        failed = log_events(logs, "frame_handling_failed")
        assert [e["error_type"] for e in failed] == ["RuntimeError"] * 3
        assert "SECRET" not in repr(logs)
        # BUG-3 waived its ACK (MSH-15 NE) but is kept as an audit row like the others.
        assert audit_rows(tmp_path) == {"BUG-1": "207", "BUG-2": "207", "BUG-3": "207"}
