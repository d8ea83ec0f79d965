"""The intake policy, row by row: docs/acks.md#which-ack-for-which-situation as a table.

Pure functions on bytes and the channel's settings: no loop, no socket, no
database. Commit results are the store's own ``IntakeResult`` values, as the
writer would hand them back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from agenttest import ack_code, err3, hl7_message, msa2

from agent.core.acks import read_ack_code
from agent.core.intake_policy import (
    decide_frame,
    decide_oversize,
    final_acks,
    handling_failed,
    held_answer,
    replies_for,
    storage_failed,
)
from agent.core.intake_types import (
    Audit,
    ChannelPolicy,
    Committed,
    Count,
    Counter,
    Decision,
    Log,
    NewMessage,
    OwedFrame,
    OwedRelay,
    OwedWait,
    RecordOutcome,
)
from agent.core.states import AckOutcome
from agent.storage.store import IntakeResult

POLICY = ChannelPolicy(name="adt")
ROW = "row-1"


def message(cid: str = "CID-1", *, enhanced: bool = False, **kwargs: str) -> bytes:
    """A good ADT^A01; ``enhanced``: MSH-15 and MSH-16 ``AL``."""
    if enhanced:
        kwargs.setdefault("msh15", "AL")
        kwargs.setdefault("msh16", "AL")
    return hl7_message(cid, **kwargs)


def with_msh(payload: bytes, number: int, value: bytes) -> bytes:
    """``payload`` with MSH-``number`` replaced (fields padded)."""
    msh, rest = payload.split(b"\r", 1)
    fields = msh.split(b"|")
    while len(fields) < number:
        fields.append(b"")
    fields[number - 1] = value
    return b"|".join(fields) + b"\r" + rest


def to_commit(payload: bytes, policy: ChannelPolicy = POLICY) -> NewMessage:
    decision = decide_frame(payload, policy, 1000.0)
    assert decision.commit is not None, decision
    return decision.commit


def committed(payload: bytes, outcome: str, policy: ChannelPolicy = POLICY, **result: object) -> Decision:
    """``payload`` through the checks, then the store's ``outcome`` for it."""
    return replies_for(to_commit(payload, policy), IntakeResult(outcome=outcome, message_id=ROW, **result),  # type: ignore[arg-type]
                       policy)


def acks_of(decision: Decision) -> list[bytes]:
    return [frame.frame for frame in decision.reply.frames]


def audits_of(decision: Decision) -> list[Audit]:
    return [e for e in decision.effects if isinstance(e, Audit)]


@dataclass(frozen=True)
class Row:
    """One row of the table in docs/acks.md: how to cause it, and what the sender gets."""

    situation: str
    answer: Callable[[bool], Decision]  # enhanced -> the decision
    original: str | None  # MSA-1, None: no answer
    enhanced: str | None
    err3: str  # "" on an accept
    text: str  # in MSA-3
    audit: str | None  # the audit row's error code, None: no audit row


def _utf8_declared_but_latin1(enhanced: bool) -> Decision:
    payload = with_msh(message("BAD-UTF8", enhanced=enhanced), 18, b"UNICODE UTF-8").replace(b"DOE", b"D\xd6E")
    return decide_frame(payload, POLICY, 0.0)


def _utf16_frame(enhanced: bool) -> Decision:
    return decide_frame(message("WIDE-1", enhanced=enhanced).decode().encode("utf-16-le"), POLICY, 0.0)


TABLE = [
    Row("committed", lambda e: committed(message(enhanced=e), "accepted", seq=1), "AA", "CA", "", "", None),
    Row("storage failure", lambda e: storage_failed(to_commit(message(enhanced=e)), "disk I/O error"),
        "AR", "CE", "207", "storage failure: message not accepted, resend later", None),
    Row("backpressure", lambda e: committed(message(enhanced=e), "backpressure", refused_for="size"),
        "AR", "CE", "207", "queue full: message not accepted, resend later", None),
    Row("backpressure, disk below the floor", lambda e: committed(message(enhanced=e), "backpressure", refused_for="disk"),
        "AR", "CE", "207", "disk space low: message not accepted, resend later", None),
    Row("message type not taken",
        lambda e: decide_frame(message(enhanced=e), ChannelPolicy("adt", accept_message_types=("ORU",)), 0.0),
        "AR", "CR", "200", "message type ADT is not accepted on this channel", "200"),
    Row("event not taken",
        lambda e: decide_frame(message(enhanced=e), ChannelPolicy("adt", accept_message_types=("ADT^A08",)), 0.0),
        "AR", "CR", "201", "event ADT^A01 is not accepted on this channel", "201"),
    Row("processing id not taken",
        lambda e: decide_frame(message(enhanced=e), ChannelPolicy("adt", accept_processing_ids=("T",)), 0.0),
        "AR", "CR", "202", "processing id P is not accepted on this channel", "202"),
    Row("version not taken",
        lambda e: decide_frame(message(enhanced=e), ChannelPolicy("adt", accept_versions=("2.3",)), 0.0),
        "AR", "CR", "203", "version 2.5.1 is not accepted on this channel", "203"),
    Row("control id reused with another body", lambda e: committed(message(enhanced=e), "conflict"),
        "AE", "CE", "205", "duplicate key identifier: MSH-10 CID-1 was used for another message", "205"),
    Row("MSH-9 missing", lambda e: decide_frame(with_msh(message(enhanced=e), 9, b""), POLICY, 0.0),
        "AE", "CE", "101", "MSH-9 message type missing", "101"),
    Row("MSH-10 missing", lambda e: decide_frame(message("", enhanced=e), POLICY, 0.0),
        "AE", "CE", "101", "MSH-10 message control id missing", "101"),
    Row("MSH-12 missing", lambda e: decide_frame(with_msh(message(enhanced=e), 12, b""), POLICY, 0.0),
        "AE", "CE", "101", "MSH-12 version id missing", "101"),
    # Unusable separators: MSH-15 cannot be read either, so the minimal reject is AE in both modes.
    Row("unusable encoding characters",
        lambda e: decide_frame(message(enhanced=e).replace(b"MSH|^~\\&|", b"MSH|A~\\&|", 1), POLICY, 0.0),
        "AE", "AE", "102", "MSH-2 encoding character 'A' is unusable", "102"),
    Row("bytes not valid in the character set", _utf8_declared_but_latin1,
        "AE", "CE", "102", "bytes not valid utf-8 at offset", "102"),
    Row("a frame in UTF-16", _utf16_frame,
        "AE", "CE", "102", "UTF-16-LE is not allowed for HL7 over MLLP", "102"),
    Row("MSH-18 names UTF-16",
        lambda e: decide_frame(with_msh(message(enhanced=e), 18, b"UNICODE UTF-16"), POLICY, 0.0),
        "AE", "CE", "102", "(UTF-16/UTF-32) is forbidden with MLLP", "102"),
    Row("MSH-18 names an unknown character set",
        lambda e: decide_frame(with_msh(message(enhanced=e), 18, b"KLINGON"), POLICY, 0.0),
        "AE", "CE", "103", "unknown character set 'KLINGON'", "103"),
    Row("frame larger than max_message_bytes",
        lambda e: decide_oversize(message(enhanced=e)[:1024], 1235, ChannelPolicy("adt", max_message_bytes=1024), 0.0),
        "AE", "CE", "207", "message of 1235 bytes exceeds max_message_bytes 1024", "207"),
    Row("an inbound ACK",
        lambda e: decide_frame(b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK^A01^ACK|A-1|P|2.5.1"
                               + (b"|||AL|AL" if e else b"") + b"\rMSA|AA|X-1\r", POLICY, 0.0),
        None, None, "", "", "0"),
    Row("an inbound ACK whose encoding characters are unusable",
        lambda e: decide_frame(b"MSH|A~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK|A-2|P|2.5"
                               + (b"|||AL|AL" if e else b"") + b"\rMSA|AA|X-2\r", POLICY, 0.0),
        None, None, "", "", "0"),
    Row("another segment before the MSH", lambda e: decide_frame(b"BHS\r" + message(enhanced=e), POLICY, 0.0),
        "AE", "CE", "100", "segment sequence error: the message must start with its MSH segment", "100"),
    Row("an inbound ACK after another segment",
        lambda e: decide_frame(b"bhs|^~\\&|\rMSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK|A-3|P|2.5"
                               + (b"|||AL|AL" if e else b"") + b"\rMSA|AA|X-3\r", POLICY, 0.0),
        None, None, "", "", "0"),
    Row("a frame with no MSH segment", lambda e: decide_frame(b"PID|1||4711^^^MRN||DOE^JANE\r", POLICY, 0.0),
        None, None, "", "", "100"),
]


class TestWhichAckForWhichSituation:
    @pytest.mark.parametrize("row", TABLE, ids=[r.situation for r in TABLE])
    @pytest.mark.parametrize("enhanced", [False, True], ids=["original", "enhanced"])
    def test_row(self, row: Row, enhanced: bool) -> None:
        """Each situation gets the MSA-1 code, ERR-3 and text of its row, and keeps what the row says."""
        decision = row.answer(enhanced)
        answers = acks_of(decision)
        want = row.enhanced if enhanced else row.original
        if want is None:
            assert answers == []
        else:
            (ack,) = answers
            assert ack_code(ack) == want
            assert err3(ack) == row.err3
            msa3 = ack.decode("latin-1").split("\r")[1].split("|")[3]
            assert row.text in msa3.replace("\\S\\", "^")  # the text, HL7-escaped in the ACK
            if want not in ("AA", "CA"):
                assert not any(isinstance(e, Committed) for e in decision.effects)
        audits = audits_of(decision)
        if row.audit is None:
            assert audits == []
        else:
            (audit,) = audits
            assert audit.record.error_code == row.audit
            assert audit.record.ack_sent == (answers[0] if answers else None)

    @pytest.mark.parametrize("before", [b"BHS\r", b"bhs|^~\\&|\r", b"ZZZ|1\n", b"\xef\xbb\xbfXYZ\r\n"])
    def test_an_msh_after_another_segment_addresses_its_reject(self, before: bytes) -> None:
        """The MSH further in is read for the ACK: MSA-2 is its MSH-10, sender and receiver swapped; nothing before it shows."""
        (ack,) = acks_of(decide_frame(before + message("LATE-1") + b"BTS|1\r", POLICY, 0.0))
        assert (ack_code(ack), msa2(ack), err3(ack)) == ("AE", "LATE-1", "100")
        inbound = message("LATE-1").split(b"\r")[0].split(b"|")
        answer = ack.split(b"\r")[0].split(b"|")
        assert (answer[2:4], answer[4:6]) == (inbound[4:6], inbound[2:4])  # MSH-3/4 and MSH-5/6 swapped
        assert b"ZZZ" not in ack and b"XYZ" not in ack

    def test_an_accept_comes_only_from_a_commit_result(self) -> None:
        """Before the store answered there is nothing to send: the accept ACK waits for the COMMIT."""
        decision = decide_frame(message(), POLICY, 0.0)
        assert decision.commit is not None
        assert decision.reply.frames == ()
        assert read_ack_code(decision.commit.commit_ack or b"") == "AA"

    def test_the_text_is_decoded_once_with_cr_segment_ends(self) -> None:
        """The message to commit carries its text, decoded with its codec, segments ended by \\r."""
        payload = message().replace(b"\r", b"\r\n")
        item = to_commit(payload)
        assert item.body == payload  # stored exactly as received
        assert item.text == message().decode()
        assert item.codec == "utf-8"

    def test_retransmit_replays_the_original_final_ack_byte_for_byte(self) -> None:
        """An identical retransmit gets the stored ACK again, recorded when written, and no new row or audit."""
        decision = committed(message(), "duplicate", ack_mode="commit", commit_ack=b"ORIGINAL-ACK",
                             prior_state="processed")
        assert decision.reply.frames == (OwedFrame(b"ORIGINAL-ACK", ROW),)
        assert audits_of(decision) == []
        assert not any(isinstance(e, Committed) for e in decision.effects)
        logs = [e for e in decision.effects if isinstance(e, Log)]
        assert [(entry.event, entry.fields["prior_state"]) for entry in logs] == [
            ("retransmit_answered_from_dedupe", "processed")]

    def test_retransmit_is_answered_in_the_mode_it_was_accepted_in(self) -> None:
        """The stored row's ack_mode decides, not the channel's setting now."""
        decision = committed(message(), "duplicate", ChannelPolicy("adt", ack="application"), ack_mode="commit",
                             commit_ack=b"AA-ONCE")
        assert acks_of(decision) == [b"AA-ONCE"]

    def test_committed_logs_ids_and_wakes_the_dispatcher(self) -> None:
        decision = committed(message("LOG-1"), "accepted", seq=7)
        assert Committed(ROW) in decision.effects
        assert Count(Counter.MESSAGE_COMMITTED) in decision.effects
        (logged,) = [e for e in decision.effects if isinstance(e, Log)]
        assert (logged.event, logged.fields) == ("message_committed", {
            "control_id": "LOG-1", "message_type": "ADT^A01^ADT_A01", "id": ROW, "seq": 7})
        # A line per message at info cost a fifth of intake's CPU: debug (failures stay info and up).
        assert logged.level == "debug"


class TestAcceptAckTypes:
    """MSH-15 governs the commit ACK (HL7 table 0155): AL always, NE never, ER on error, SU on success."""

    @pytest.mark.parametrize(("msh15", "on_success", "on_error"), [
        ("AL", "CA", "CR"), ("NE", None, None), ("ER", None, "CR"), ("SU", "CA", None), ("al", "CA", "CR"),
    ])
    def test_commit_ack_per_msh15(self, msh15: str, on_success: str | None, on_error: str | None) -> None:
        success = to_commit(message(msh15=msh15, msh16="NE"))
        assert (read_ack_code(success.commit_ack) if success.commit_ack else None) == on_success
        refused = decide_frame(message(msh15=msh15, msh16="NE"), ChannelPolicy("adt", accept_versions=("2.3",)), 0.0)
        assert [ack_code(a) for a in acks_of(refused)] == ([on_error] if on_error else [])
        assert len(audits_of(refused)) == 1, "the audit row is kept whether or not an ACK went out"

    def test_a_waived_commit_ack_is_recorded_not_owed(self) -> None:
        """Commit mode with no ACK owed (a retransmit of a row that got none): ack_outcome not_owed."""
        decision = committed(message(), "duplicate", ack_mode="commit", commit_ack=None)
        assert decision.reply.frames == ()
        assert RecordOutcome(ROW, AckOutcome.NOT_OWED) in decision.effects


class TestApplicationAcks:
    """MSH-16 governs the application ACK; channels with ack = "application" hold the answer."""

    def test_enhanced_commit_ack_then_a_relay(self) -> None:
        """CA now (recorded by nobody: the application ACK is the final one), the server's ACK relayed later."""
        payload = message(enhanced=True)
        decision = committed(payload, "accepted", seq=1)
        (ca,) = decision.reply.frames
        assert (ack_code(ca.frame), ca.message_id) == ("CA", None)
        assert decision.reply.relay == OwedRelay(ROW, to_commit(payload).envelope)

    def test_enhanced_ne_application_ack_is_not_owed(self) -> None:
        decision = committed(message(msh15="AL", msh16="NE"), "accepted", seq=1)
        assert decision.reply.relay is None
        assert RecordOutcome(ROW, AckOutcome.NOT_OWED) in decision.effects

    @pytest.mark.parametrize(("msh16", "server_code", "relayed"), [
        ("AL", "AA", True), ("AL", "AE", True), ("ER", "AA", False), ("ER", "AE", True),
        ("SU", "AA", True), ("SU", "AR", False), ("", "AA", True),
    ])
    def test_known_application_ack_on_retransmit(self, msh16: str, server_code: str, relayed: bool) -> None:
        """A retransmit gets the commit ACK replayed, then the application ACK if MSH-16 wants it."""
        app_ack = f"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK^A01^ACK|S-1|P|2.5.1\rMSA|{server_code}|CID-1\r".encode()
        env = to_commit(message(msh15="AL", msh16=msh16 or "AL")).envelope
        if not msh16:
            env = to_commit(message(msh15="AL")).envelope
        decision = final_acks(env, "utf-8", ROW, "enhanced", POLICY, commit_ack=b"CA-ONCE", app_ack=app_ack)
        want = [OwedFrame(b"CA-ONCE"), OwedFrame(app_ack, ROW)] if relayed else [OwedFrame(b"CA-ONCE")]
        assert list(decision.reply.frames) == want
        assert (RecordOutcome(ROW, AckOutcome.NOT_OWED) in decision.effects) is not relayed

    def test_application_channel_holds_the_answer(self) -> None:
        """Original mode on an application channel: no ACK at commit; the server's answer is awaited."""
        policy = ChannelPolicy("adt", ack="application", application_ack_timeout=12.5)
        decision = committed(message(), "accepted", policy, seq=1)
        assert decision.reply.frames == ()
        wait = decision.reply.wait
        assert wait is not None
        assert (wait.message_id, wait.timeout) == (ROW, 12.5)
        assert to_commit(message(), policy).commit_ack is None

    def test_held_ack_arrives(self) -> None:
        wait = OwedWait(ROW, to_commit(message()).envelope, "utf-8", 30.0)
        decision = held_answer(wait, b"SERVER-ACK", at_stop=False)
        assert decision.reply.frames == (OwedFrame(b"SERVER-ACK", ROW),)

    @pytest.mark.parametrize(("at_stop", "event"), [(False, "application_ack_timed_out"),
                                                    (True, "application_ack_deferred_at_stop")])
    def test_held_ack_not_in_time_is_ar_207_resend_later(self, at_stop: bool, event: str) -> None:
        """The row stays queued; the sender hears AR 207 "resend later", the row is recorded undelivered."""
        wait = OwedWait(ROW, to_commit(message("SLOW-1")).envelope, "utf-8", 30.0)
        decision = held_answer(wait, None, at_stop=at_stop)
        (ar,) = acks_of(decision)
        assert (ack_code(ar), err3(ar), msa2(ar)) == ("AR", "207", "SLOW-1")
        assert b"accepted and queued; resend later for the application response" in ar
        assert RecordOutcome(ROW, AckOutcome.UNDELIVERED) in decision.effects
        assert [e.event for e in decision.effects if isinstance(e, Log)] == [event]


class TestLastResort:
    """A bug in handling still answers: AE/CE 207 and an audit row, never silence (HL7 table 0357: 207)."""

    @staticmethod
    def failure() -> BaseException:
        try:
            raise RuntimeError("PID|1||SECRET-PATIENT")
        except RuntimeError as exc:
            return exc

    @pytest.mark.parametrize(("payload", "code"), [
        (message("BUG-1"), "AE"), (message("BUG-2", msh15="AL", msh16="NE"), "CE"),
        (message("BUG-3", msh15="NE"), None), (b"PID|1\r", None),
        (b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK|A-1|P|2.5.1\rMSA|AA|X\r", None),
    ], ids=["original", "enhanced", "waived", "no MSH", "inbound ACK"])
    def test_answered_and_audited(self, payload: bytes, code: str | None) -> None:
        decision = handling_failed(self.failure(), payload, 0.0)
        assert [ack_code(a) for a in acks_of(decision)] == ([code] if code else [])
        assert all(err3(a) == "207" for a in acks_of(decision))
        (audit,) = audits_of(decision)
        assert audit.record.error_code == "207"
        failed = [e for e in decision.effects if isinstance(e, Log) and e.event == "frame_handling_failed"]
        assert failed[0].fields["error_type"] == "RuntimeError"
        assert failed[0].fields["where"].startswith("test_intake_policy.py:")
        assert "SECRET" not in repr(decision.effects)


class TestNoBodiesInLogs:
    def test_no_decision_logs_message_bytes(self) -> None:
        """Every row's log lines carry ids and codes, never the message's data."""
        for row in TABLE:
            for enhanced in (False, True):
                decision = row.answer(enhanced)
                logs = [e for e in decision.effects if isinstance(e, Log)]
                logs += [line for e in decision.effects if isinstance(e, Audit) for line in e.then]
                assert "DOE" not in repr(logs) and "12345" not in repr(logs), (row.situation, logs)
