"""The dispatch policy as tables: each scenario of tests/integration/test_dispatch.py, without a loop, a socket or a database.

``agent.core.dispatch`` is pure, so each rule is a row of a table: a head
row, a channel policy and the session's facts in, one action out. The
scenarios that need a whole run (300 messages on three channels, an outage,
retries) drive the functions through ``Queue`` below: the store's
transitions over rows held in a dict, each move checked against the state
table (``check_event`` below, over ``agent.core.states.Event``). It stands in for SQLite only to
show what the *policy* does; the store's own guarded SQL is tested against
a real database in tests/integration/test_store_contract.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core import acks
from agent.core.dispatch import (
    RECHECK_SECONDS,
    AwaitSession,
    ChannelPolicy,
    Claim,
    GiveUp,
    KeepInflight,
    Loss,
    Note,
    Pause,
    Requeue,
    RetryPolicy,
    Send,
    SessionFacts,
    Settle,
    Wait,
    application_ack_bytes,
    build_transmit,
    decide_head,
    on_loss,
    on_response,
    on_unsendable,
    too_big_victim,
    with_attempt,
)
from agent.core.protocol import EPOCH_REFUSED, MESSAGE_TOO_BIG, Transmit, TransmitResponse
from agent.core.session import SessionClosed, SessionCore, TransmitInProgress, TransmitTooLarge
from agent.core.states import Event, State
from agent.storage.rows import HeadRow

NOW = 1_000_000.0
UP = SessionFacts(up=True, replay=True)
UP_NO_REPLAY = SessionFacts(up=True, replay=False)
DOWN = SessionFacts(up=False)
#: No jitter: the backoff is exact, so a table can say when the next try is due.
EXACT = RetryPolicy(initial=0.1, cap=0.5, jitter=0.0)


def message(control_id: str, *, msh15: str = "", msh16: str = "") -> bytes:
    msh = (f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101120000||ADT^A01^ADT_A01|{control_id}|P|2.5.1"
           + (f"|||{msh15}|{msh16}" if (msh15 or msh16) else ""))
    return (msh + "\rEVN|A01|20260101120000\rPID|1||12345^^^MRN||DOE^JANE\r").encode()


def row(control_id: str = "M1", *, state: State = State.QUEUED, seq: int = 1, attempts: int = 0,
        next_attempt_at: float = 0.0, ack_mode: str = "commit", body: bytes | None = None,
        encoding: str = "utf-8", redrive_base: int = 0, channel: str = "adt") -> HeadRow:
    return HeadRow(
        id=f"id-{control_id}", channel=channel, seq=seq, state=state, attempts=attempts,
        next_attempt_at=next_attempt_at, claim_epoch=None, remote="10.1.2.3:50122",
        control_id=control_id, message_type="ADT^A01", encoding=encoding,
        body=message(control_id) if body is None else body, received_at=NOW - 5,
        ack_mode=ack_mode,  # type: ignore[arg-type]
        redrive_base=redrive_base,
    )


def policy(**overrides: Any) -> ChannelPolicy:
    return ChannelPolicy(**{"name": "adt", "retry": EXACT, **overrides})


def answer(head: HeadRow, attempt: int, status: int, ack: str | None = None) -> TransmitResponse:
    return TransmitResponse(head.id, attempt, status, ack)


def event_of(note: Note | None) -> str | None:
    return None if note is None else note.event


# -- the head -----------------------------------------------------------------------


class TestDecideHead:
    @pytest.mark.parametrize(
        ("head", "pol", "session", "expected"),
        [
            pytest.param(None, policy(), UP, Wait(), id="no-head-waits-for-rows"),
            pytest.param(row(), policy(), UP, Claim("id-M1"), id="due-queued-head-is-claimed"),
            pytest.param(row(), policy(), DOWN, AwaitSession(), id="outage-keeps-it-queued"),
            pytest.param(row(state=State.CLAIMED), policy(), DOWN, AwaitSession(), id="claimed-waits-for-a-session"),
            pytest.param(row(state=State.INFLIGHT, attempts=1), policy(), DOWN, AwaitSession(),
                         id="inflight-waits-for-a-session"),
            pytest.param(row(), policy(paused=True), UP, Wait(NOW + RECHECK_SECONDS), id="paused-holds-queued"),
            pytest.param(row(next_attempt_at=NOW + 0.3), policy(), UP, Wait(NOW + 0.3), id="backoff-until-due"),
            pytest.param(row(next_attempt_at=NOW + 30), policy(), UP, Wait(NOW + RECHECK_SECONDS),
                         id="long-backoff-rechecked-each-second"),
            pytest.param(row(next_attempt_at=NOW), policy(), UP, Claim("id-M1"), id="due-exactly-now"),
        ],
    )
    def test_what_happens_to_the_head(self, head: HeadRow | None, pol: ChannelPolicy, session: SessionFacts,
                                      expected: object) -> None:
        """Each head, policy and session gives exactly one decision."""
        assert decide_head(head, pol, session, NOW) == expected

    @pytest.mark.parametrize("state", [State.CLAIMED, State.INFLIGHT])
    def test_a_paused_channel_starts_no_new_attempt_of_the_head_it_already_took(self, state: State) -> None:
        """Dispatch holds: a claimed head, or an inflight one whose answer timed out, waits for resume (not resent)."""
        head = row(state=state, attempts=1)
        assert decide_head(head, policy(paused=True), UP, NOW) == Wait(NOW + RECHECK_SECONDS)
        assert isinstance(decide_head(head, policy(), UP, NOW), Send)

    def test_a_paused_channel_still_settles_an_ambiguous_head(self) -> None:
        """Without replay an inflight head is no send but bookkeeping: failed (or requeued) even while paused."""
        decision = decide_head(row(state=State.INFLIGHT, attempts=1), policy(paused=True), UP_NO_REPLAY, NOW)
        assert isinstance(decision, GiveUp) and decision.error_code == "ambiguous"

    @pytest.mark.parametrize(("state", "attempts"), [(State.CLAIMED, 0), (State.INFLIGHT, 1), (State.CLAIMED, 4)])
    def test_send_is_the_next_attempt_of_the_same_id(self, state: State, attempts: int) -> None:
        """A claimed head goes as attempt + 1; an inflight one (timeout, reconnect) is resent with the same id."""
        head = row(state=state, attempts=attempts)
        decision = decide_head(head, policy(), UP, NOW)
        assert isinstance(decision, Send)
        assert (decision.id, decision.from_state, decision.attempts) == (head.id, state, attempts)
        assert (decision.transmit.id, decision.transmit.attempt, decision.transmit.seq) == (head.id, attempts + 1, 1)

    @pytest.mark.parametrize(("in_flight", "limit", "claims"), [(0, 1, True), (1, 1, False), (3, 4, True), (4, 4, False)])
    def test_max_in_flight_is_a_parameter(self, in_flight: int, limit: int, claims: bool) -> None:
        """A new head waits while the channel's other rows in flight fill max_in_flight (1 today)."""
        decision = decide_head(row(), policy(max_in_flight=limit), UP, NOW, in_flight=in_flight)
        assert decision == (Claim("id-M1") if claims else Wait())

    def test_an_undecodable_stored_body_is_rejected_with_102(self) -> None:
        """Bytes that no longer decode as the row's encoding are rejected (HL7 table 0357: 102), not resent forever."""
        decision = decide_head(row(state=State.CLAIMED, body=b"MSH|^~\\&|\xff\xfe|\r"), policy(), UP, NOW)
        assert isinstance(decision, GiveUp)
        assert (decision.state, decision.error_code, decision.attempt) == (State.REJECTED, "102", 0)
        assert decision.error_text.startswith("stored message cannot be decoded as utf-8")
        assert event_of(decision.note) == "message_unsendable"


class TestAmbiguousRows:
    """An inflight row at the head of a server that does not replay: docs/queue.md#ambiguous-rows."""

    def test_failed_for_review(self) -> None:
        """Without replay and without guaranteed delivery the row is failed 'ambiguous'."""
        decision = decide_head(row(state=State.INFLIGHT, attempts=2), policy(), UP_NO_REPLAY, NOW)
        assert decision == GiveUp(
            "id-M1", 2, State.FAILED, "ambiguous", "delivery unknown: server does not replay",
            note=Note.of("warning", "message_failed", error_code="ambiguous",
                         reason="delivery unknown: server does not replay"),
        )

    def test_guaranteed_delivery_requeues_at_once(self) -> None:
        """guaranteed_delivery: back to queued, due now, at the same attempt count."""
        decision = decide_head(row(state=State.INFLIGHT, attempts=2), policy(guaranteed_delivery=True),
                               UP_NO_REPLAY, NOW)
        assert decision == Requeue(
            "id-M1", 2, 0.0, error_code="ambiguous",
            error_text="requeued (guaranteed delivery): server does not replay",
            note=Note.of("warning", "inflight_requeued_guaranteed", reason="server does not replay"),
        )

    def test_pause_follows_a_failed_row(self) -> None:
        """on_reject = pause also pauses after a failed row, in the same commit."""
        decision = decide_head(row(state=State.INFLIGHT, attempts=1), policy(on_reject="pause"), UP_NO_REPLAY, NOW)
        assert isinstance(decision, GiveUp)
        assert decision.pause == Pause("adt", "failed row id-M1: delivery unknown: server does not replay")

    def test_a_claimed_row_is_never_ambiguous(self) -> None:
        """A claimed row was provably not sent: it is sent, replay or not."""
        assert isinstance(decide_head(row(state=State.CLAIMED), policy(), UP_NO_REPLAY, NOW), Send)


# -- the answer ---------------------------------------------------------------------


class TestOnResponse:
    def test_2xx_settles_processed(self) -> None:
        """200: processed for this attempt, no error, no pause."""
        head = row(state=State.INFLIGHT, attempts=1)
        action = on_response(head, 1, answer(head, 1, 200), policy(on_reject="pause"), NOW)
        assert action == Settle("id-M1", 1, State.PROCESSED, answer(head, 1, 200),
                                note=Note.of("debug", "message_processed", status=200, attempt=1),
                                stale=Note.of("info", "stale_settle_ignored", attempt=1))

    @pytest.mark.parametrize(("on_reject", "pause"), [("continue", None), ("pause", Pause("adt", "rejected row id-M1 (status 400)"))])
    def test_4xx_rejects_and_pauses_only_when_asked(self, on_reject: str, pause: Pause | None) -> None:
        """400: rejected for good with the status as its code; on_reject = pause sets the flag in the same commit."""
        head = row(state=State.INFLIGHT, attempts=1)
        action = on_response(head, 1, answer(head, 1, 400), policy(on_reject=on_reject), NOW)
        assert isinstance(action, Settle)
        assert (action.state, action.error_code, action.error_text) == (
            State.REJECTED, "400", "rejected by server (status 400)")
        assert action.pause == pause
        assert event_of(action.note) == "message_rejected_by_server" and action.note is not None and action.note.level == "warning"

    @pytest.mark.parametrize(("attempt", "delay"), [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (9, 0.5)])
    def test_503_is_retried_after_a_doubling_backoff(self, attempt: int, delay: float) -> None:
        """5xx: back to queued, due after retry_initial doubling to retry_cap, the status kept."""
        head = row(state=State.INFLIGHT, attempts=attempt)
        action = on_response(head, attempt, answer(head, attempt, 503), policy(), NOW)
        assert isinstance(action, Requeue)
        assert action.next_attempt_at == pytest.approx(NOW + delay)
        assert (action.attempt, action.server_status, action.error_code) == (attempt, 503, "503")
        assert action.error_text == f"transient status 503; retry in {delay:.1f}s"
        assert action.note == action.stale == Note.of("info", "transmit_retry_scheduled", status=503,
                                                      attempt=attempt, delay_s=delay)

    def test_jitter_only_shortens_the_backoff(self) -> None:
        """With jitter 0.2 the delay lies in [0.8 x base, base]."""
        head = row(state=State.INFLIGHT, attempts=3)
        rng = random.Random(5)
        for _ in range(50):
            action = on_response(head, 3, answer(head, 3, 429), policy(retry=RetryPolicy(0.1, 0.5, 0.2)), NOW, rng=rng)
            assert isinstance(action, Requeue)
            assert NOW + 0.4 * 0.8 <= action.next_attempt_at <= NOW + 0.4

    @pytest.mark.parametrize(("max_attempts", "attempt", "redrive_base", "gives_up"),
                             [(2, 1, 0, False), (2, 2, 0, True), (0, 500, 0, False), (2, 3, 2, False), (2, 4, 2, True)])
    def test_max_attempts_ends_failed(self, max_attempts: int, attempt: int, redrive_base: int, gives_up: bool) -> None:
        """The attempts since the last re-drive count against max_attempts (0: forever); spent ones end failed."""
        head = row(state=State.INFLIGHT, attempts=attempt, redrive_base=redrive_base)
        action = on_response(head, attempt, answer(head, attempt, 503), policy(max_attempts=max_attempts), NOW)
        if not gives_up:
            assert isinstance(action, Requeue)
            return
        assert isinstance(action, GiveUp)
        assert (action.state, action.error_code, action.error_text) == (
            State.FAILED, "503", f"max_attempts {max_attempts} reached; last status 503")

    @pytest.mark.parametrize("status", [0, 100, 302, 600])
    def test_statuses_without_meaning_are_retried(self, status: int) -> None:
        """A status protocol v1 gives no meaning is neither dropped nor taken as delivered."""
        head = row(state=State.INFLIGHT, attempts=1)
        assert isinstance(on_response(head, 1, answer(head, 1, status), policy(), NOW), Requeue)


class TestApplicationAck:
    """The ACK a source with ack = application is owed (docs/acks.md#relayed-application-acks)."""

    def test_the_servers_ack_text_is_relayed(self) -> None:
        """The server's ack text becomes the sender's ACK bytes (CR segment ends, no block bytes)."""
        head = row(state=State.INFLIGHT, attempts=1, ack_mode="application")
        text = "MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101120001||ACK^A01^ACK|SRV-M1|P|2.5.1\nMSA|AA|M1|custom\n"
        action = on_response(head, 1, answer(head, 1, 200, ack=text), policy(), NOW)
        assert isinstance(action, Settle)
        assert action.app_ack == text.replace("\n", "\r").encode()

    @pytest.mark.parametrize("text", [
        "MSH", "MSA|", "MSHX", "\r\r\r", "MSH|\x00~\\&|EHR|C\rMSA|AA|M1\r", "MSA|AA|X\rMSH|^~\\&|EHR|C\r",
        "MSH|^~\\&|EHR|C\rPID|1\r", "MSH|^~\\&|EHR|C\rMSA||M1\r", "not hl7 at all"])
    def test_an_ack_that_is_no_ack_is_replaced_by_one_built_from_the_status(self, text: str) -> None:
        """The sender would get (and get again on every retransmit) an ACK it cannot read: the agent builds one."""
        head = row(state=State.INFLIGHT, attempts=1, ack_mode="application")
        action = on_response(head, 1, answer(head, 1, 200, ack=text), policy(), NOW)
        assert isinstance(action, Settle) and action.app_ack is not None
        assert acks.read_ack_code(action.app_ack) == "AA"
        assert action.app_ack.split(b"\r")[1].split(b"|")[2] == b"M1"
        assert [n.event for n in action.notes] == ["server_ack_unusable"]

    @pytest.mark.parametrize("text", [
        "MSH|^~\\&|EHR|C\rMSA|AE|M1|no\r", "MSH#^~\\&#E\nMSA#CA#M1\n", "\x0bMSH|^~\\&\r\nMSA|AA\r\n\x1c",
        "MSH|...\rMSA|AA|MSG0001\r"])  # SPEC 5's own example, placeholder and all
    def test_an_ack_with_an_msh_and_an_msa_code_is_relayed_as_sent(self, text: str) -> None:
        head = row(state=State.INFLIGHT, attempts=1, ack_mode="application")
        action = on_response(head, 1, answer(head, 1, 200, ack=text), policy(), NOW)
        assert isinstance(action, Settle) and action.notes == ()
        assert action.app_ack == acks.relayed_ack(text, "utf-8")

    @pytest.mark.parametrize(("status", "code"), [(200, "AA"), (201, "AA"), (400, "AE"), (422, "AE")])
    def test_without_ack_text_one_is_built_from_the_status(self, status: int, code: str) -> None:
        """No ack from the server: AA for 2xx, AE for 4xx, answering the row's own MSH-10."""
        head = row(state=State.INFLIGHT, attempts=1, ack_mode="application")
        action = on_response(head, 1, answer(head, 1, status), policy(), NOW)
        assert isinstance(action, Settle) and action.app_ack is not None
        assert acks.read_ack_code(action.app_ack) == code
        assert action.app_ack.split(b"\r")[1].split(b"|")[2] == b"M1"

    def test_a_row_given_up_on_owes_an_ae(self) -> None:
        """max_attempts spent: the source gets the AE a 5xx would have earned."""
        head = row(state=State.INFLIGHT, attempts=1, ack_mode="enhanced")
        action = on_response(head, 1, answer(head, 1, 503), policy(max_attempts=1), NOW)
        assert isinstance(action, GiveUp) and action.app_ack is not None
        assert acks.read_ack_code(action.app_ack) == "AE"

    def test_commit_mode_rows_owe_nothing(self) -> None:
        """ack = commit: the accept ACK was the last word, nothing is relayed."""
        head = row(state=State.INFLIGHT, attempts=1)
        action = on_response(head, 1, answer(head, 1, 200, ack="MSH|^~\\&|X\rMSA|AA|M1\r"), policy(), NOW)
        assert isinstance(action, Settle) and action.app_ack is None

    def test_an_unbuildable_ack_never_stops_the_settle(self) -> None:
        """A row whose ACK cannot be built settles without one, and the failure is logged (no body)."""
        head = dataclasses.replace(row(state=State.INFLIGHT, attempts=1, ack_mode="application"),
                                   encoding=None)  # type: ignore[arg-type] - what no codec lookup survives
        action = on_response(head, 1, answer(head, 1, 200, ack="MSA|AA|M1"), policy(), NOW)
        assert isinstance(action, Settle) and action.state == State.PROCESSED and action.app_ack is None
        assert [n.event for n in action.notes] == ["application_ack_unbuildable"]
        assert set(dict(action.notes[0].fields)) == {"id", "channel", "error_type"}

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(st.binary(max_size=200), st.sampled_from(["utf-8", "latin-1", "idna", "rot13", "utf-16", "punycode", "x"]),
           st.one_of(st.none(), st.text(max_size=80)), st.integers(0, 999))
    def test_never_raises(self, body: bytes, encoding: str, ack_text: str | None, status: int) -> None:
        """Whatever a stored row holds and the server says: bytes or None, never an exception."""
        head = row(ack_mode="application", body=b"MSH|^~\\&|A|B|C|D|20260101||ADT^A01|X1|P|2.5\r" + body,
                   encoding=encoding)
        ack = application_ack_bytes(head, status, ack_text, now=datetime(2026, 1, 1, tzinfo=UTC))
        assert ack is None or (b"\x0b" not in ack and b"\x1c" not in ack)


# -- no answer -------------------------------------------------------------------------


class TestOnLoss:
    @pytest.mark.parametrize("loss", [Loss.RESPONSE_TIMEOUT, Loss.CONNECTION_LOST])
    def test_a_replaying_server_gets_the_same_id_again(self, loss: Loss) -> None:
        """Timeout or lost connection with replay: the row stays inflight (no store call) and is resent as the head."""
        head = row(state=State.INFLIGHT, attempts=1)
        assert on_loss(head, 1, loss, policy(), replay=True) == KeepInflight()
        resend = decide_head(head, policy(), UP, NOW)
        assert isinstance(resend, Send) and (resend.from_state, resend.transmit.attempt) == (State.INFLIGHT, 2)

    @pytest.mark.parametrize("loss", [Loss.RESPONSE_TIMEOUT, Loss.CONNECTION_LOST])
    def test_an_unanswered_max_attempts_th_send_fails_the_row(self, loss: Loss) -> None:
        """Unanswered sends count against max_attempts (since the last re-drive): then failed, not resent for ever."""
        head = row(state=State.INFLIGHT, attempts=3)
        assert on_loss(head, 2, loss, policy(max_attempts=3), replay=True) == KeepInflight()
        assert on_loss(head, 3, loss, policy(), replay=True) == KeepInflight()  # 0: no limit
        failed = on_loss(head, 3, loss, policy(max_attempts=3), replay=True)
        assert isinstance(failed, GiveUp)
        assert (failed.state, failed.error_code, failed.error_text) == (
            State.FAILED, "no_answer", f"max_attempts 3 reached; last attempt: {loss.value}")
        assert event_of(failed.note) == "message_failed"
        assert on_loss(head, 3, loss, policy(max_attempts=3, on_reject="pause"), replay=True).pause is not None

    def test_an_inflight_head_left_by_a_restart_after_its_last_attempt_fails(self) -> None:
        """After a crash or takeover the successor does not send it a max_attempts + 1-th time (paused or not)."""
        head = row(state=State.INFLIGHT, attempts=3)
        for pol in (policy(max_attempts=3), policy(max_attempts=3, paused=True)):
            failed = decide_head(head, pol, UP, NOW)
            assert isinstance(failed, GiveUp)
            assert (failed.state, failed.error_code) == (State.FAILED, "no_answer")
        assert isinstance(decide_head(head, policy(max_attempts=4), UP, NOW), Send)

    @pytest.mark.parametrize(("loss", "why"), [(Loss.RESPONSE_TIMEOUT, "response timeout"),
                                               (Loss.CONNECTION_LOST, "connection lost")])
    def test_without_replay_the_row_is_ambiguous(self, loss: Loss, why: str) -> None:
        """No replay: failed for review, or requeued on a guaranteed_delivery channel."""
        head = row(state=State.INFLIGHT, attempts=1)
        failed = on_loss(head, 1, loss, policy(), replay=False)
        assert isinstance(failed, GiveUp)
        assert (failed.state, failed.error_code, failed.error_text) == (
            State.FAILED, "ambiguous", f"delivery unknown: {why}; server does not replay")
        requeued = on_loss(head, 1, loss, policy(guaranteed_delivery=True), replay=False)
        assert isinstance(requeued, Requeue)
        assert requeued.error_text == f"requeued (guaranteed delivery): {why}; server does not replay"

    @pytest.mark.parametrize(("loss", "event"), [(Loss.NOT_WRITTEN, "transmit_not_sent_session_closed"),
                                                 (Loss.LEASE_UNPROVEN, "transmit_not_sent_lease_unproven")])
    @pytest.mark.parametrize("replay", [True, False])
    @pytest.mark.parametrize("guaranteed", [True, False])
    def test_a_frame_provably_not_written_goes_back_to_the_head(self, loss: Loss, event: str, replay: bool,
                                                                 guaranteed: bool) -> None:
        """Session closed before the write, or the lease not proven valid (stalled holder): due at once, never ambiguous."""
        head = row(state=State.INFLIGHT, attempts=3)
        action = on_loss(head, 3, loss, policy(guaranteed_delivery=guaranteed), replay=replay)
        assert action == Requeue("id-M1", 3, 0.0, error_code="not_sent", error_text=loss.value,
                                 note=Note.of("info", event, attempt=3))


class TestTooBig:
    def test_our_own_limit_rejects_with_207(self) -> None:
        """A frame over max_frame_bytes is never sent: rejected 207 with the reason."""
        action = on_unsendable(row(state=State.INFLIGHT, attempts=1), 1, "too big", policy())
        assert (action.state, action.error_code, action.error_text, action.attempt) == (State.REJECTED, "207", "too big", 1)

    @pytest.mark.parametrize(("in_flight", "victim"), [
        ([("small", 300), ("big", 9000), ("mid", 800)], "big"),
        ([("a", 500), ("b", 500)], "a"),
        ([("only", 1)], "only"),
        ([], None),
    ])
    def test_1009_blames_the_largest_transmit_in_flight(self, in_flight: list[tuple[str, int]], victim: str | None) -> None:
        """The largest frame in flight on that session is the victim (the first sent on a tie)."""
        assert too_big_victim(in_flight) == victim


# -- the transmit --------------------------------------------------------------------


class TestTransmit:
    def test_fields_come_from_the_row(self) -> None:
        """id, seq, channel, control id, type, remote, encoding and received_at (RFC 3339 UTC) as stored."""
        head = row(seq=17)
        t = build_transmit(head, policy(), 3)
        assert t == Transmit(id="id-M1", channel="adt", control_id="M1", message_type="ADT^A01", seq=17,
                             attempt=3, received_at=datetime.fromtimestamp(NOW - 5, UTC).isoformat(
                                 timespec="milliseconds").replace("+00:00", "Z"),
                             remote="10.1.2.3:50122", body=message("M1").decode(), encoding="utf-8")

    def test_a_partition_of_absent_fields_is_sent_as_the_empty_key(self) -> None:
        """SPEC: all key fields absent is the key "" on the wire; the row keeps its stored key."""
        head = dataclasses.replace(row(), partition_key="\x1f")
        assert build_transmit(head, policy(partitioned=True), 1).partition == ""
        head = dataclasses.replace(row(), partition_key="FAC\x1fMRN1")
        assert build_transmit(head, policy(partitioned=True), 1).partition == "FAC\x1fMRN1"

    def test_assign_sequence_numbers_sets_msh13_only(self) -> None:
        """MSH-13 of the forwarded text is seq; every other byte is the stored message's."""
        head = row(seq=42)
        stamped = build_transmit(head, policy(assign_sequence_numbers=True), 1).body
        plain = build_transmit(head, policy(), 1).body
        assert stamped.split("\r")[0].split("|")[12] == "42"
        assert stamped.split("\r")[1:] == plain.split("\r")[1:] == message("M1").decode().split("\r")[1:]
        assert head.body == message("M1")

    def test_the_attempt_the_store_committed_wins(self) -> None:
        """with_attempt keeps the transmit when the store's attempt is the expected one, else restamps it."""
        send = decide_head(row(state=State.CLAIMED), policy(), UP, NOW)
        assert isinstance(send, Send)
        assert with_attempt(send, 1) is send.transmit
        assert with_attempt(send, 5).attempt == 5


# -- the upstream session's bookkeeping -------------------------------------------------


def transmit(message_id: str = "id-1", attempt: int = 1, body: str = "MSH|^~\\&|A\r") -> Transmit:
    return Transmit(id=message_id, channel="adt", control_id="C", message_type="ADT^A01", seq=1, attempt=attempt,
                    received_at="2026-01-01T00:00:00.000Z", remote="r", body=body, encoding="utf-8")


class TestSessionCore:
    def test_an_answer_goes_to_the_waiter_of_its_id_and_attempt(self) -> None:
        """Routing by id and attempt: an answer to another attempt is dropped and logged as stale."""
        core: SessionCore[str] = SessionCore(1 << 20)
        t = transmit(attempt=2)
        core.expect(t, core.prepare(t), "waiter-2")
        stale = core.receive(TransmitResponse("id-1", 1, 200).to_json())
        assert stale.waiter is None and event_of(stale.note) == "upstream_response_stale"
        assert stale.note is not None and dict(stale.note.fields)["waiting_attempt"] == 2
        got = core.receive(TransmitResponse("id-1", 2, 200).to_json())
        assert (got.waiter, got.response) == ("waiter-2", TransmitResponse("id-1", 2, 200))
        again = core.receive(TransmitResponse("id-1", 2, 200).to_json())
        assert again.waiter is None and event_of(again.note) == "upstream_response_unmatched"
        assert core.in_flight == 0

    @pytest.mark.parametrize(("frame", "event"), [
        ('{"type":"error","message":"slow down"}', "upstream_error_message"),
        ('{"type":"welcome","replay":true}', "upstream_unexpected_welcome"),
        ("not json", "upstream_protocol_error"),
        ('{"type":"transmit_response","id":"x"}', "upstream_protocol_error"),
    ])
    def test_other_frames_are_noted_not_fatal(self, frame: str, event: str) -> None:
        """An error frame, a second welcome or garbage is logged; the session goes on."""
        core: SessionCore[str] = SessionCore(1 << 20)
        got = core.receive(frame)
        assert got.waiter is None and event_of(got.note) == event

    def test_prepare_refuses_what_must_not_be_written(self) -> None:
        """Too large, the same id already waiting, or the session over: nothing is written."""
        core: SessionCore[str] = SessionCore(300)
        with pytest.raises(TransmitTooLarge):
            core.prepare(transmit(body="X" * 400))
        t = transmit()
        core.expect(t, core.prepare(t), "w")
        with pytest.raises(TransmitInProgress):
            core.prepare(transmit(attempt=2))
        core.forget("id-1", "someone else")  # not its waiter: nothing changes
        assert core.in_flight == 1
        core.forget("id-1", "w")
        core.close(1000, "bye", by_server=True)
        with pytest.raises(SessionClosed):
            core.prepare(transmit(message_id="id-2"))

    @pytest.mark.parametrize(("code", "by_server", "victim", "too_big", "refused"), [
        (MESSAGE_TOO_BIG, True, "id-big", True, False),
        (MESSAGE_TOO_BIG, False, None, False, False),  # our 1009: the server's frame was too big for us
        (EPOCH_REFUSED, True, None, False, True),
        (1006, False, None, False, False),
    ])
    def test_close_facts_reach_every_waiter(self, code: int, by_server: bool, victim: str | None, too_big: bool,
                                            refused: bool) -> None:
        """Each waiter gets the close facts; a server's 1009 names the largest frame in flight as the victim."""
        core: SessionCore[str] = SessionCore(1 << 20)
        for message_id, body in (("id-small", "MSH|A\r"), ("id-big", "MSH|" + "B" * 5000 + "\r")):
            t = transmit(message_id, body=body)
            core.expect(t, core.prepare(t), message_id)
        info, waiters = core.close(code, "why", by_server=by_server)
        assert sorted(waiters) == ["id-big", "id-small"] and core.in_flight == 0
        assert (info.victim, info.too_big, info.epoch_refused) == (victim, too_big, refused)
        assert info.copy().victim == victim
        later, nobody = core.close(1000, "again", by_server=False)
        assert later is info and nobody == []  # the first close counts


# -- whole scenarios through the policy --------------------------------------------------


def check_event(event: Event, old: State, new: State) -> None:
    """The state table as a predicate: ``event`` may move a row from ``old`` to ``new``."""
    assert old in event.sources and new in event.targets, f"{event.name.lower()}: a {old} row cannot become {new}"


class Queue:
    """The store's transitions over rows in a dict, each move checked against the Event table."""

    def __init__(self) -> None:
        self.rows: dict[str, HeadRow] = {}
        self.seq: dict[str, int] = {}
        self.paused: set[str] = set()

    def add(self, channel: str, control_id: str) -> None:
        seq = self.seq[channel] = self.seq.get(channel, 0) + 1
        self.rows[f"id-{control_id}"] = row(control_id, seq=seq, channel=channel)

    def head(self, channel: str) -> HeadRow | None:
        live = [r for r in self.rows.values() if r.channel == channel and r.state in (State.QUEUED, State.CLAIMED,
                                                                                          State.INFLIGHT)]
        return min(live, key=lambda r: r.seq) if live else None

    def _move(self, event: Event, message_id: str, new: State, **changes: Any) -> None:
        old = self.rows[message_id]
        check_event(event, old.state, new)
        self.rows[message_id] = dataclasses.replace(old, state=new, **changes)

    def apply(self, action: object, now: float) -> Any:
        match action:
            case Claim(id=mid):
                if self.rows[mid].state != State.QUEUED or self.rows[mid].next_attempt_at > now:
                    return False
                self._move(Event.CLAIM, mid, State.CLAIMED)
                return True
            case Send(id=mid, from_state=old, attempts=n):
                r = self.rows[mid]
                assert r.attempts == n and r.state == old
                self._move(Event.RESEND if old == State.INFLIGHT else Event.SEND, mid, State.INFLIGHT, attempts=n + 1)
                return n + 1
            case Settle(id=mid, attempt=a, state=new, pause=pause):
                if self.rows[mid].attempts != a or self.rows[mid].state != State.INFLIGHT:
                    return False
                self._move(Event.SETTLE, mid, new)
                if pause is not None:
                    self.paused.add(pause.channel)
                return True
            case Requeue(id=mid, attempt=a, next_attempt_at=due):
                assert self.rows[mid].attempts == a
                self._move(Event.RETRY, mid, State.QUEUED, next_attempt_at=due)
                return True
            case GiveUp(id=mid, attempt=a, state=new, pause=pause):
                assert self.rows[mid].attempts == a
                self._move(Event.GIVE_UP, mid, new)
                if pause is not None:
                    self.paused.add(pause.channel)
                return True
            case KeepInflight():
                return None
        raise AssertionError(f"not a store action: {action!r}")


Server = Callable[[Transmit, float], "int | Loss"]


def run_channels(queue: Queue, channels: list[str], server: Server, *, session: SessionFacts = UP,
                 rng: random.Random | None = None, pol: dict[str, ChannelPolicy] | None = None,
                 horizon: float = 60.0) -> list[Transmit]:
    """Step the channels in a random interleaving, time jumping to the next due head, until none can go on.

    A channel whose decision is to wait for new rows (or for a session) is
    done; one waiting for a time is stepped again once the clock got there.
    The run ends when every channel is done or waits beyond ``horizon``.
    """
    rng = rng or random.Random(0)
    now = NOW
    sent: list[Transmit] = []
    waiting: dict[str, float | None] = {}  # channel -> due again at (None: done)
    while True:
        ready = [c for c in channels if c not in waiting]
        if not ready:
            dues = [u for u in waiting.values() if u is not None and u <= NOW + horizon]
            if not dues:
                return sent
            now = max(now, min(dues))
            waiting = {c: u for c, u in waiting.items() if u is None or u > now}
            continue
        channel = rng.choice(ready)
        p = dataclasses.replace((pol or {}).get(channel, policy(name=channel)), paused=channel in queue.paused)
        head = queue.head(channel)
        decision = decide_head(head, p, session, now)
        if isinstance(decision, Wait):
            waiting[channel] = decision.until
        elif isinstance(decision, AwaitSession):
            waiting[channel] = None
        elif isinstance(decision, Send):
            assert head is not None
            attempt = queue.apply(decision, now)
            t = with_attempt(decision, attempt)
            sent.append(t)
            outcome = server(t, now)
            if isinstance(outcome, Loss):
                action: object = on_loss(head, attempt, outcome, p, replay=session.replay)
            else:
                action = on_response(head, attempt, TransmitResponse(t.id, attempt, outcome), p, now, rng=rng)
            queue.apply(action, now)
        else:
            queue.apply(decision, now)


class TestScenarios:
    def test_three_channels_of_300_each_delivered_once_in_order_one_at_a_time(self) -> None:
        """900 rows on 3 channels: each id sent once, attempt 1, in seq order, never two of a channel live in flight."""
        queue = Queue()
        channels = ["adt", "lab", "orm"]
        for c in channels:
            for i in range(300):
                queue.add(c, f"{c}{i:05d}")

        def server(t: Transmit, now: float) -> int:
            # When a frame is written, no other row of its channel is in flight.
            assert [r.id for r in queue.rows.values() if r.channel == t.channel and r.state == State.INFLIGHT] == [t.id]
            return 200

        sent = run_channels(queue, channels, server, rng=random.Random(11))
        assert len(sent) == 900 and len({t.id for t in sent}) == 900
        for c in channels:
            got = [t for t in sent if t.channel == c]
            assert [t.seq for t in got] == list(range(1, 301))
            assert {t.attempt for t in got} == {1}
        assert {r.state for r in queue.rows.values()} == {State.PROCESSED}

    def test_an_outage_keeps_every_head_queued_then_delivers_in_order(self) -> None:
        """Server down: nothing is claimed (rows stay queued); up again: all 40 go, in order, once."""
        queue = Queue()
        for c in ("adt", "lab"):
            for i in range(20):
                queue.add(c, f"{c}{i}")
        sent = run_channels(queue, ["adt", "lab"], lambda t, now: 200, session=DOWN)
        assert sent == [] and {r.state for r in queue.rows.values()} == {State.QUEUED}
        sent = run_channels(queue, ["adt", "lab"], lambda t, now: 200)
        for c in ("adt", "lab"):
            assert [t.control_id for t in sent if t.channel == c] == [f"{c}{i}" for i in range(20)]
        assert len(sent) == 40

    def test_503_twice_then_200_is_delivered_once_after_backoff_and_blocks_the_next(self) -> None:
        """Same id, attempts 1, 2, 3 after 0.1 s then 0.2 s; R2 goes only after R1 settled."""
        queue = Queue()
        queue.add("adt", "R1")
        queue.add("adt", "R2")
        script = {("R1", 1): 503, ("R1", 2): 503}
        times: list[float] = []

        def server(t: Transmit, now: float) -> int:
            times.append(now)
            return script.get((t.control_id, t.attempt), 200)

        sent = run_channels(queue, ["adt"], server)
        assert [(t.control_id, t.attempt) for t in sent] == [("R1", 1), ("R1", 2), ("R1", 3), ("R2", 1)]
        assert times[1] - times[0] == pytest.approx(0.1) and times[2] - times[1] == pytest.approx(0.2)
        assert (queue.rows["id-R1"].state, queue.rows["id-R1"].attempts) == (State.PROCESSED, 3)

    def test_max_attempts_with_503s_ends_failed_and_the_channel_goes_on(self) -> None:
        """max_attempts = 2: F1 fails after two sends with 503 as its code; F2 is processed."""
        queue = Queue()
        queue.add("adt", "F1")
        queue.add("adt", "F2")
        sent = run_channels(queue, ["adt"], lambda t, now: 503 if t.control_id == "F1" else 200,
                               pol={"adt": policy(max_attempts=2)})
        assert [(t.control_id, t.attempt) for t in sent] == [("F1", 1), ("F1", 2), ("F2", 1)]
        assert (queue.rows["id-F1"].state, queue.rows["id-F2"].state) == (State.FAILED, State.PROCESSED)

    @pytest.mark.parametrize(("on_reject", "p2"), [("continue", State.PROCESSED), ("pause", State.QUEUED)])
    def test_400_rejects_then_continues_or_holds_the_channel(self, on_reject: str, p2: State) -> None:
        """A 4xx row is rejected, never retried; the next row goes (continue) or waits paused while another channel goes on."""
        queue = Queue()
        for cid in ("P1", "P2"):
            queue.add("adt", cid)
        queue.add("lab", "L1")
        sent = run_channels(queue, ["adt", "lab"], lambda t, now: 400 if t.control_id == "P1" else 200,
                               pol={"adt": policy(on_reject=on_reject), "lab": policy(name="lab")})
        assert [t.attempt for t in sent if t.control_id == "P1"] == [1]
        assert queue.rows["id-P1"].state == State.REJECTED
        assert queue.rows["id-P2"].state == p2
        assert queue.rows["id-L1"].state == State.PROCESSED
        if on_reject == "pause":
            # The operator resumes: the held row goes.
            queue.paused.clear()
            run_channels(queue, ["adt"], lambda t, now: 200)
            assert queue.rows["id-P2"].state == State.PROCESSED

    def test_response_timeout_resends_the_same_id_to_a_replaying_server(self) -> None:
        """No answer to attempt 1: attempt 2 with the same id is processed; T2 follows."""
        queue = Queue()
        queue.add("adt", "T1")
        queue.add("adt", "T2")
        sent = run_channels(queue, ["adt"], lambda t, now: Loss.RESPONSE_TIMEOUT if (t.control_id, t.attempt) == ("T1", 1)
                               else 200)
        assert [(t.control_id, t.attempt) for t in sent] == [("T1", 1), ("T1", 2), ("T2", 1)]
        assert {t.id for t in sent if t.control_id == "T1"} == {"id-T1"}

    @pytest.mark.parametrize(("guaranteed", "t1_state", "t1_sends"), [(False, State.FAILED, 1), (True, State.PROCESSED, 2)])
    def test_a_lost_connection_without_replay(self, guaranteed: bool, t1_state: State, t1_sends: int) -> None:
        """Non-replaying server, connection lost mid-answer: failed for review, or sent again (guaranteed delivery)."""
        queue = Queue()
        queue.add("adt", "T1")
        queue.add("adt", "T2")
        sent = run_channels(queue, ["adt"],
                               lambda t, now: Loss.CONNECTION_LOST if (t.control_id, t.attempt) == ("T1", 1) else 200,
                               session=UP_NO_REPLAY, pol={"adt": policy(guaranteed_delivery=guaranteed)})
        assert queue.rows["id-T1"].state == t1_state
        assert len([t for t in sent if t.control_id == "T1"]) == t1_sends
        assert queue.rows["id-T2"].state == State.PROCESSED

    @pytest.mark.parametrize("replay", [True, False])
    def test_a_lapsed_lease_writes_nothing_and_the_row_is_resent_never_failed(self, replay: bool) -> None:
        """The write guard refused (a stall past the lease): the row is put back and sent again, replay or not."""
        queue = Queue()
        queue.add("adt", "M1")
        session = UP if replay else UP_NO_REPLAY
        sent = run_channels(queue, ["adt"], lambda t, now: Loss.LEASE_UNPROVEN if t.attempt == 1 else 200,
                               session=session)
        assert [t.attempt for t in sent] == [1, 2]
        assert queue.rows["id-M1"].state == State.PROCESSED


class TestEpochRefused:
    def test_a_server_refusing_the_epoch_is_told_apart_from_other_closes(self) -> None:
        """Only a 4001 the server sent ends the tenure as refused; the dispatcher then backs off, doubling to the cap."""
        from agent.core.retry import backoff
        from agent.runtime import dispatcher

        assert SessionClosed(EPOCH_REFUSED, "stale", by_server=True).epoch_refused
        assert not SessionClosed(EPOCH_REFUSED, "ours", by_server=False).epoch_refused
        assert not SessionClosed(1006).epoch_refused
        delays = backoff(dispatcher.EPOCH_REFUSED_INITIAL, 2.0, dispatcher.EPOCH_REFUSED_CAP, jitter=0.0)
        assert [next(delays) for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
