"""Durable MLLP intake end to end: real sockets on 127.0.0.1, a real SQLite file (SPEC 4 and 6).

The daemon runs in process (``agent.app.service.Agent`` on its own event loop
thread, listening on port 0); senders are blocking MLLP clients on the test
thread or on worker threads. "No ACK" is proven by order, never by waiting:
ACKs of one connection are written in arrival order, so when the frame that
follows a silent one is answered first, the silent one got nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agent.app.config import ChannelSettings, QueueSettings, Settings
from agent.app.service import Agent
from tests.agenttest import MllpClient, ack_code, db_rows, err3, hl7_message, msa2, wait_for


class AgentThread:
    """An in-process daemon on its own event loop thread, stopped the way SIGTERM stops it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self.thread.start()
        self.agent = Agent(settings)
        try:
            self._call(self.agent.start())
        except BaseException:
            self.stop()
            raise

    def _call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def port(self) -> int:
        return int(self.agent.listeners[0].sock.getsockname()[1])

    @property
    def db_path(self) -> Path:
        return self.settings.db_path

    def stop(self) -> None:
        async def shutdown() -> None:
            self.agent.stop_requested.set()
            await self.agent.shutdown()

        try:
            if self.thread.is_alive():
                self._call(shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def make_settings(data_dir: Path, **channel: Any) -> Settings:
    """One channel ``adt`` on 127.0.0.1:0, no upstream, no admin endpoint."""
    return Settings(
        agent={"id": "intake-test", "data_dir": data_dir, "shutdown_budget": 10},
        admin={"listen": None},
        queue=QueueSettings(min_free_disk_bytes=0),
        channels=[ChannelSettings(name="adt", listen="127.0.0.1:0", **channel)],
    )


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentThread]:
    running = AgentThread(make_settings(tmp_path / "data"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def small_agent(tmp_path: Path) -> Iterator[AgentThread]:
    """A channel whose max_message_bytes is 2 KiB."""
    running = AgentThread(make_settings(tmp_path / "data", max_message_bytes=2048))
    try:
        yield running
    finally:
        running.stop()


def rows(agent: AgentThread, where: str = "1", params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return db_rows(
        agent.db_path,
        f"SELECT state, seq, control_id, body, error_code, ack_outcome FROM messages WHERE {where} "  # noqa: S608
        "ORDER BY received_at",
        params,
    )


def msh_field(ack: bytes, number: int) -> str:
    """MSH-n of an ACK (MSH-1 is the separator, so MSH-n is split index n - 1)."""
    msh = ack.split(b"\r", 1)[0].decode()
    return msh.split("|")[number - 1]


class TestConcurrentIntake:
    def test_200_messages_from_4_connections_all_acked_and_queued(self, agent: AgentThread) -> None:
        """200 pipelined messages on 4 connections each get AA for their own MSH-10, in order, and all are queued with seq 1..200."""

        def sender(index: int) -> list[tuple[str, bytes]]:
            ids = [f"C{index}-{n:03d}" for n in range(50)]
            with MllpClient(agent.port) as client:
                for n, cid in enumerate(ids):
                    client.send(hl7_message(cid, pid=f"P{index}-{n}"))
                return [(cid, client.read_ack()) for cid in ids]

        with ThreadPoolExecutor(4) as pool:
            results = [ack for batch in pool.map(sender, range(4)) for ack in batch]

        assert len(results) == 200
        for cid, ack in results:
            assert ack_code(ack) == "AA", (cid, ack)
            assert msa2(ack) == cid
        stored = rows(agent, "channel = 'adt'")
        assert {r[0] for r in stored} == {"queued"}
        assert sorted(r[1] for r in stored) == list(range(1, 201))
        assert {r[2] for r in stored} == {cid for cid, _ in results}


class TestDedupe:
    def test_identical_retransmit_replays_the_same_ack_and_adds_no_row(self, agent: AgentThread) -> None:
        """A retransmit with identical bytes gets the first ACK byte for byte and creates no row."""
        message = hl7_message("DUP-1")
        with MllpClient(agent.port) as client:
            first = client.exchange(message)
            second = client.exchange(message)
        with MllpClient(agent.port) as other:
            third = other.exchange(message)
        assert ack_code(first) == "AA"
        assert second == first
        assert third == first
        assert len(rows(agent, "control_id = 'DUP-1'")) == 1

    def test_same_control_id_with_another_body_is_ae_205_and_audited(self, agent: AgentThread) -> None:
        """Same MSH-10 with another body gets AE with ERR-3 205, leaves a nacked row, and the original stays queued as it was."""
        original = hl7_message("DUP-2", pid="111")
        impostor = hl7_message("DUP-2", pid="222")
        with MllpClient(agent.port) as client:
            assert ack_code(client.exchange(original)) == "AA"
            ack = client.exchange(impostor)
        assert ack_code(ack) == "AE"
        assert err3(ack) == "205"
        assert msa2(ack) == "DUP-2"
        found = wait_for(lambda: len(rows(agent, "control_id = 'DUP-2'")) == 2 and rows(agent, "control_id = 'DUP-2'"),
                         what="the audit row")
        by_state = {r[0]: r for r in found}
        assert set(by_state) == {"queued", "nacked"}
        assert by_state["queued"][3] == original
        assert by_state["queued"][1] == 1
        assert by_state["nacked"][3] == impostor
        assert by_state["nacked"][4] == "205"
        assert by_state["nacked"][1] is None


class TestGarbage:
    def test_frame_without_msh_gets_no_ack_and_the_connection_goes_on(self, agent: AgentThread) -> None:
        """A frame with no MSH is dropped without an ACK, kept as a nacked row, and the next message is accepted."""
        with MllpClient(agent.port) as client:
            client.send(b"PID|1||X\rPV1|1|I\r")
            ack = client.exchange(hl7_message("AFTER-NOMSH"))
        assert ack_code(ack) == "AA"
        assert msa2(ack) == "AFTER-NOMSH"
        audit = wait_for(lambda: rows(agent, "state = 'nacked'"), what="audit row")
        assert audit[0][3] == b"PID|1||X\rPV1|1|I\r"
        assert audit[0][4] == "100"

    def test_broken_separators_get_a_minimal_reject(self, agent: AgentThread) -> None:
        """An MSH whose encoding characters are unusable gets AE 102 with default separators, and the next message is accepted."""
        broken = b"MSH|AB12|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|BROKEN-1|P|2.5.1\rPID|1\r"
        with MllpClient(agent.port) as client:
            reject = client.exchange(broken)
            ack = client.exchange(hl7_message("AFTER-BROKEN"))
        assert reject.startswith(b"MSH|^~\\&|")
        assert ack_code(reject) == "AE"
        assert err3(reject) == "102"
        assert msa2(reject) == "BROKEN-1"
        assert ack_code(ack) == "AA"
        assert msa2(ack) == "AFTER-BROKEN"
        audit = wait_for(lambda: rows(agent, "state = 'nacked'"), what="audit row")
        assert audit[0][3] == broken

    def test_missing_control_id_gets_ae_101_with_empty_msa2(self, agent: AgentThread) -> None:
        """An MSH without MSH-10 gets AE 101 and an empty MSA-2, and the connection goes on."""
        message = b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01||P|2.5.1\rPID|1\r"
        with MllpClient(agent.port) as client:
            reject = client.exchange(message)
            ack = client.exchange(hl7_message("AFTER-NOID"))
        assert ack_code(reject) == "AE"
        assert err3(reject) == "101"
        assert msa2(reject) == ""
        assert ack_code(ack) == "AA"

    def test_undecodable_bytes_for_the_declared_charset_are_rejected(self, agent: AgentThread) -> None:
        """Bytes invalid in the MSH-18 character set get AE 102, nothing is queued, and the next message is accepted."""
        bad = (b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|BADCS-1|P|2.5.1||||||UNICODE UTF-8\r"
               b"PID|1||1||M\xfcller^J\xe9r\xf4me\r")
        with MllpClient(agent.port) as client:
            reject = client.exchange(bad)
            ack = client.exchange(hl7_message("AFTER-BADCS"))
        assert ack_code(reject) == "AE"
        assert err3(reject) == "102"
        assert msa2(reject) == "BADCS-1"
        assert ack_code(ack) == "AA"
        audit = wait_for(lambda: rows(agent, "control_id = 'BADCS-1'"), what="audit row")
        assert [r[0] for r in audit] == ["nacked"]
        assert audit[0][3] == bad

    def test_latin1_declared_in_msh18_is_accepted_and_stored_as_received(self, agent: AgentThread) -> None:
        """The same bytes declared 8859/1 decode fine: AA, and the stored body is the bytes as received."""
        good = (b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|LATIN-1|P|2.5.1||||||8859/1\r"
                b"PID|1||1||M\xfcller^J\xe9r\xf4me\r")
        with MllpClient(agent.port) as client:
            ack = client.exchange(good)
        assert ack_code(ack) == "AA"
        assert msh_field(ack, 18) == "8859/1"
        stored = db_rows(agent.db_path, "SELECT body, encoding FROM messages WHERE control_id = 'LATIN-1'")
        assert stored == [(good, "iso8859-1")]

    def test_oversize_frame_gets_ae_207_and_the_connection_goes_on(self, small_agent: AgentThread) -> None:
        """A frame over max_message_bytes gets AE with ERR-3 207, is not queued, and the connection keeps working."""
        big = hl7_message("BIG-1", pid="9" * 5000)
        assert len(big) > 2048
        with MllpClient(small_agent.port) as client:
            reject = client.exchange(big)
            ack = client.exchange(hl7_message("AFTER-BIG"))
        assert ack_code(reject) == "AE"
        assert err3(reject) == "207"
        assert msa2(reject) == "BIG-1"
        assert ack_code(ack) == "AA"
        assert msa2(ack) == "AFTER-BIG"
        assert [r[0] for r in rows(small_agent, "control_id = 'BIG-1' AND state <> 'nacked'")] == []

    def test_junk_between_frames_is_skipped(self, agent: AgentThread) -> None:
        """Bytes outside frames (before, between, after) are skipped and both framed messages are accepted."""
        from agent.core.mllp import encode_frame

        stream = (b"hello\r\n" + encode_frame(hl7_message("JUNK-1")) + b"\x00\xffnoise\r"
                  + encode_frame(hl7_message("JUNK-2")) + b"\n")
        with MllpClient(agent.port) as client:
            client.send_raw(stream)
            first, second = client.read_ack(), client.read_ack()
            third = client.exchange(hl7_message("JUNK-3"))
        assert [ack_code(a) for a in (first, second, third)] == ["AA", "AA", "AA"]
        assert [msa2(a) for a in (first, second, third)] == ["JUNK-1", "JUNK-2", "JUNK-3"]
        assert sorted(r[1] for r in rows(agent, "state = 'queued'")) == [1, 2, 3]

    def test_frames_split_across_writes_and_coalesced_in_one(self, agent: AgentThread) -> None:
        """A frame split byte by byte and two frames in one write are each answered once, in order."""
        from agent.core.mllp import encode_frame

        with MllpClient(agent.port) as client:
            for byte in encode_frame(hl7_message("SPLIT-1")):
                client.send_raw(bytes([byte]))
            client.send_raw(encode_frame(hl7_message("PAIR-1")) + encode_frame(hl7_message("PAIR-2")))
            acks = [client.read_ack() for _ in range(3)]
        assert [msa2(a) for a in acks] == ["SPLIT-1", "PAIR-1", "PAIR-2"]
        assert {ack_code(a) for a in acks} == {"AA"}


class TestAckRules:
    def test_inbound_ack_is_recorded_and_not_answered(self, agent: AgentThread) -> None:
        """An inbound ACK message is kept as a nacked row, never queued, and gets no answer."""
        inbound_ack = b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ACK^A01^ACK|THEIRACK-1|P|2.5.1\rMSA|AA|X1\r"
        with MllpClient(agent.port) as client:
            client.send(inbound_ack)
            ack = client.exchange(hl7_message("AFTER-ACK"))
        assert msa2(ack) == "AFTER-ACK"
        audit = wait_for(lambda: rows(agent, "control_id = 'THEIRACK-1'"), what="audit row")
        assert [(r[0], r[1], r[3]) for r in audit] == [("nacked", None, inbound_ack)]

    def test_enhanced_mode_al_gets_a_commit_accept(self, agent: AgentThread) -> None:
        """MSH-15 AL gets CA once the row is committed."""
        with MllpClient(agent.port) as client:
            ack = client.exchange(hl7_message("ENH-AL", msh15="AL", msh16="NE"))
        assert ack_code(ack) == "CA"
        assert msa2(ack) == "ENH-AL"
        assert [r[0] for r in rows(agent, "control_id = 'ENH-AL'")] == ["queued"]

    def test_enhanced_mode_ne_gets_nothing_and_is_queued(self, agent: AgentThread) -> None:
        """MSH-15 NE (and MSH-16 NE) gets no ACK at all, and the message is queued all the same."""
        with MllpClient(agent.port) as client:
            client.send(hl7_message("ENH-NE", msh15="NE", msh16="NE"))
            ack = client.exchange(hl7_message("AFTER-NE"))
        assert msa2(ack) == "AFTER-NE"
        stored = rows(agent, "control_id = 'ENH-NE'")
        assert [(r[0], r[1]) for r in stored] == [("queued", 1)]
        wait_for(lambda: rows(agent, "control_id = 'ENH-NE'")[0][5] == "not_owed", what="ack_outcome not_owed")

    def test_msh11_and_msh12_are_copied_into_the_ack(self, agent: AgentThread) -> None:
        """MSH-11 (processing id, with its mode) and MSH-12 (version) are copied verbatim, never a hard-coded P."""
        message = (b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ORU^R01|VER-1|T^T|2.3.1\r"
                   b"PID|1||1\rOBR|1\r")
        with MllpClient(agent.port) as client:
            ack = client.exchange(message)
        assert ack_code(ack) == "AA"
        assert msh_field(ack, 11) == "T^T"
        assert msh_field(ack, 12) == "2.3.1"
        assert msh_field(ack, 9) == "ACK^R01^ACK"
        assert (msh_field(ack, 3), msh_field(ack, 4), msh_field(ack, 5), msh_field(ack, 6)) == (
            "EHR", "CENTRAL", "LAB", "NORTH")

    def test_lf_segment_endings_are_stored_byte_exact(self, agent: AgentThread) -> None:
        """A message with \\n (and \\r\\n) segment endings is accepted and stored exactly as received."""
        lf = hl7_message("LF-1").replace(b"\r", b"\n")
        crlf = hl7_message("CRLF-1").replace(b"\r", b"\r\n")
        with MllpClient(agent.port) as client:
            assert ack_code(client.exchange(lf)) == "AA"
            assert ack_code(client.exchange(crlf)) == "AA"
        stored = dict(db_rows(agent.db_path, "SELECT control_id, body FROM messages"))
        assert stored == {"LF-1": lf, "CRLF-1": crlf}

    def test_accept_ack_is_sent_only_after_commit(self, agent: AgentThread) -> None:
        """Every AA the sender holds is already readable from the database by another connection."""
        with MllpClient(agent.port) as client:
            for n in range(20):
                cid = f"ORDER-{n}"
                assert ack_code(client.exchange(hl7_message(cid))) == "AA"
                assert db_rows(agent.db_path, "SELECT state FROM messages WHERE control_id = ?", (cid,)) == [
                    ("queued",)]


class TestLogs:
    def test_logs_carry_ids_but_never_bodies_or_patient_data(self, tmp_path: Path) -> None:
        """Accepted, duplicate, conflicting and garbage frames log ids and codes, never message bytes or PID data."""
        from structlog.testing import capture_logs

        with capture_logs() as logs:
            running = AgentThread(make_settings(tmp_path / "data", max_message_bytes=2048))
            try:
                with MllpClient(running.port) as client:
                    client.exchange(hl7_message("LOG-1", pid="SECRETMRN"))
                    client.exchange(hl7_message("LOG-1", pid="SECRETMRN"))
                    client.exchange(hl7_message("LOG-1", pid="OTHERSECRETMRN"))
                    client.exchange(hl7_message("LOG-2", pid="SECRETMRN" * 400))
                    client.send(b"PID|1||SECRETMRN^^^MRN||DOE^JANE\r")
                    client.exchange(hl7_message("LOG-3", pid="SECRETMRN"))
            finally:
                running.stop()
        events = {e["event"] for e in logs}
        assert {"message_committed", "retransmit_answered_from_dedupe", "control_id_reused_with_other_body",
                "frame_too_large", "frame_without_msh_dropped"} <= events
        committed = [e for e in logs if e["event"] == "message_committed"]
        assert {e.get("control_id") for e in committed} == {"LOG-1", "LOG-3"}
        assert all(e.get("channel") == "adt" and e.get("id") and e.get("peer") for e in committed)
        for entry in logs:
            assert not {"body", "raw", "payload", "message", "data"} & set(entry), entry
            text = repr(entry)
            assert "SECRETMRN" not in text and "DOE" not in text, entry


class TestOversizeWithoutMsh:
    def test_oversize_frame_without_msh_gets_no_ack(self, small_agent: AgentThread) -> None:
        """An oversize frame that does not start with MSH is dropped silently and audited; the connection goes on."""
        with MllpClient(small_agent.port) as client:
            client.send(b"PID|" + b"9" * 5000 + b"\r")
            ack = client.exchange(hl7_message("AFTER-BIGJUNK"))
        assert msa2(ack) == "AFTER-BIGJUNK"
        audit = wait_for(lambda: rows(small_agent, "state = 'nacked'"), what="audit row")
        assert [r[4] for r in audit] == ["207"]
        assert len(audit[0][3]) < 5000  # only the bounded prefix is kept, never the whole frame


class TestSendCommand:
    def test_send_prints_each_ack_and_exits_0_on_aa(self, agent: AgentThread, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
        """``hl7-agent send`` with a file of two LF-ended messages sends both and prints both AAs."""
        from agent.app.client import send_files

        path = tmp_path / "two.hl7"
        path.write_bytes(hl7_message("SEND-1").replace(b"\r", b"\n") + hl7_message("SEND-2").replace(b"\r", b"\n"))
        assert send_files("127.0.0.1", agent.port, [str(path)], timeout=10) == 0
        out = capsys.readouterr().out
        assert "MSA|AA|SEND-1" in out and "MSA|AA|SEND-2" in out
        stored = dict(db_rows(agent.db_path, "SELECT control_id, body FROM messages"))
        assert stored["SEND-1"] == hl7_message("SEND-1")  # \n turned into \r by send (SPEC 2)

    def test_send_exits_1_on_a_reject(self, agent: AgentThread, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
        """A control id reused with another body gets AE, and ``send`` exits 1."""
        from agent.app.client import send_files

        first, second = tmp_path / "a.hl7", tmp_path / "b.hl7"
        first.write_bytes(hl7_message("SEND-X", pid="1"))
        second.write_bytes(hl7_message("SEND-X", pid="2"))
        assert send_files("127.0.0.1", agent.port, [str(first)], timeout=10) == 0
        assert send_files("127.0.0.1", agent.port, [str(second)], timeout=10) == 1
        assert "MSA|AE|SEND-X" in capsys.readouterr().out

    def test_send_mllp_framed_file(self, agent: AgentThread, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
        """A file of MLLP frames (as ``queue export`` writes) is sent frame by frame, bytes unchanged."""
        from agent.app.client import send_files
        from agent.core.mllp import encode_frame

        lf = hl7_message("FRAMED-1").replace(b"\r", b"\n")
        path = tmp_path / "framed.mllp"
        path.write_bytes(encode_frame(lf) + encode_frame(hl7_message("FRAMED-2")))
        assert send_files("127.0.0.1", agent.port, [str(path)], timeout=10) == 0
        stored = dict(db_rows(agent.db_path, "SELECT control_id, body FROM messages"))
        assert stored == {"FRAMED-1": lf, "FRAMED-2": hl7_message("FRAMED-2")}

    def test_a_missing_ack_is_reported_and_the_rest_still_go(self, agent: AgentThread, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
        """A message left without its ACK (MSH-15 NE: none is owed) is named by its file and place;
        the messages after it, in that file and the next, still go (over a new connection); exit 1."""
        from agent.app.client import send_files

        first, second = tmp_path / "a.hl7", tmp_path / "b.hl7"
        first.write_bytes(hl7_message("QUIET-1", msh15="NE", msh16="NE") + hl7_message("LOUD-2"))
        second.write_bytes(hl7_message("LOUD-3"))
        assert send_files("127.0.0.1", agent.port, [str(first), str(second)], timeout=1) == 1
        out, err = capsys.readouterr()
        assert err.splitlines() == [f"# {first} message 1: no ACK within 1s"]
        assert "MSA|AA|LOUD-2" in out and "MSA|AA|LOUD-3" in out
        stored = {r[0] for r in db_rows(agent.db_path, "SELECT control_id FROM messages")}
        assert stored == {"QUIET-1", "LOUD-2", "LOUD-3"}

    def test_send_without_a_listener_exits_1(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Nothing listening: one line on stderr and exit 1."""
        from agent.app.client import send_files
        from tests.agenttest import free_port

        path = tmp_path / "one.hl7"
        path.write_bytes(hl7_message("NOBODY"))
        assert send_files("127.0.0.1", free_port(), [str(path)], timeout=2) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot connect" in err
