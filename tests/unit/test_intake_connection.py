"""The intake connection core without a loop, a socket or a database.

``IntakeConnection`` is driven the way the shell drives it: bytes, commit
results, write results, relay answers and clock ticks in; actions out. The
clock is a plain object the test moves; commit results are the store's own
``IntakeResult`` values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from agenttest import ack_code, hl7_message, msa2

from agent.core import mllp
from agent.core.intake import (
    AUDIT_ROWS_PER_WINDOW,
    AUDIT_WINDOW,
    FEED_CHUNK,
    JUNK_READ_PAUSE,
    MAX_PENDING_AUDITS,
    MAX_PENDING_RELAYS,
    MAX_PIPELINED_FRAMES,
    REPLAY_LOGS_PER_WINDOW,
    STEP_EVENTS,
    IntakeConnection,
)
from agent.core.intake_actions import (
    DONE,
    PHASES,
    Abort,
    Action,
    AwaitApplicationAck,
    Close,
    Commit,
    HalfClose,
    HandOver,
    Phase,
    Send,
    StopWaiting,
    check_move,
)
from agent.core.intake_types import (
    Audit,
    ChannelPolicy,
    Count,
    Counter,
    Log,
    Owed,
    OwedFrame,
    OwedRelay,
    OwedReply,
    OwedWait,
    RecordOutcome,
)
from agent.core.states import AckOutcome, IllegalTransition
from agent.errors import StorageError
from agent.storage.store import IntakeResult


@dataclass
class FakeClock:
    """Time that moves only when the test says so."""

    now: float = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now


def framed(*payloads: bytes) -> bytes:
    return b"".join(mllp.encode_frame(p) for p in payloads)


def app_ack(code: str = "AA", cid: str = "X") -> bytes:
    return f"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK^A01^ACK|S-1|P|2.5.1\rMSA|{code}|{cid}\r".encode()


@dataclass
class Peer:
    """The shell's side: applies nothing, records every action; writes succeed unless told otherwise."""

    conn: IntakeConnection
    clock: FakeClock
    actions: list[Action] = field(default_factory=list)
    wire: list[bytes] = field(default_factory=list)  # ACK payloads written, in order
    commits: dict[int, Commit] = field(default_factory=dict)
    waits: dict[int, AwaitApplicationAck] = field(default_factory=dict)
    writes_ok: bool = True
    seq: int = 0
    audits_open: int = 0

    @classmethod
    def open(cls, policy: ChannelPolicy | None = None) -> Peer:
        clock = FakeClock()
        return cls(IntakeConnection(policy or ChannelPolicy("adt"), clock), clock)

    def pump(self) -> list[Action]:
        """Take the connection's actions; write every Send at once (as ``transport.write`` does)."""
        taken: list[Action] = []
        while batch := self.conn.next_actions():
            for action in batch:
                taken.append(action)
                if isinstance(action, Send):
                    self.wire.append(mllp.MllpDecoder(1 << 20).feed(action.frame)[0].payload)  # type: ignore[union-attr]
                    self.conn.written(action, self.writes_ok)
                elif isinstance(action, Commit):
                    self.commits[action.ticket] = action
                elif isinstance(action, AwaitApplicationAck):
                    self.waits[action.token] = action
                elif isinstance(action, StopWaiting):
                    self.waits.pop(action.token, None)
                elif isinstance(action, Audit):
                    self.audits_open += 1
        self.actions += taken
        return taken

    def send(self, data: bytes) -> list[Action]:
        self.conn.receive_data(data)
        return self.pump()

    def commit(self, ticket: int | None = None, outcome: str = "accepted", **result: Any) -> list[Action]:
        """Answer one commit (the oldest by default) as the store would."""
        ticket = min(self.commits) if ticket is None else ticket
        action = self.commits.pop(ticket)
        self.seq += 1
        message = action.items[0]
        result.setdefault("ack_mode", message.ack_mode)
        self.conn.commit_done(ticket, (IntakeResult(outcome=outcome, message_id=f"row-{message.envelope.control_id}",  # type: ignore[arg-type]
                                                    seq=self.seq, **result),))
        return self.pump()

    def audits_done(self, count: int | None = None) -> None:
        """The writer stored ``count`` (default: every) audit row asked for so far."""
        for _ in range(self.audits_open if count is None else count):
            self.audits_open -= 1
            self.conn.audit_done()
            self.pump()

    def commit_all(self) -> None:
        while self.commits:
            self.commit()

    def of(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    def logs(self, event: str) -> list[Log]:
        return [a for a in self.actions if isinstance(a, Log) and a.event == event]

    def outcomes(self) -> dict[str, AckOutcome]:
        return {a.message_id: a.outcome for a in self.of(RecordOutcome)}


class TestPhaseTable:
    @pytest.mark.parametrize("phase", list(Phase))
    def test_only_the_table_s_moves_are_allowed(self, phase: Phase) -> None:
        """Every move the table lists passes; every other raises IllegalTransition (our bug, h11's way)."""
        for to in Phase:
            if to in PHASES[phase]:
                check_move(phase, to)
            else:
                with pytest.raises(IllegalTransition):
                    check_move(phase, to)

    def test_final_phases_go_nowhere(self) -> None:
        assert all(PHASES[phase] == frozenset() for phase in DONE)

    def test_graceful_close_mid_frame(self) -> None:
        """open -> finishing (the frame in progress) -> draining (its ACK) -> lingering (FIN) -> closed."""
        peer = Peer.open()
        whole = framed(hl7_message("LAST"))
        peer.send(whole[:30])
        peer.conn.request_close(can_hand_over=False)
        assert peer.conn.phase is Phase.FINISHING
        peer.send(whole[30:] + framed(hl7_message("NOT-HANDLED")))
        assert peer.conn.phase is Phase.DRAINING
        assert len(peer.commits) == 1, "only the frame being read when the close came"
        peer.commit()
        assert [msa2(a) for a in peer.wire] == ["LAST"]
        assert peer.conn.phase is Phase.LINGERING and peer.of(HalfClose)
        peer.conn.receive_data(b"late bytes")
        peer.conn.receive_eof()
        peer.pump()
        assert peer.conn.phase is Phase.CLOSED and peer.of(Close)
        assert [e.fields["count"] for e in peer.logs("bytes_after_close_discarded")] == [10]
        assert peer.conn.finished

    def test_close_between_frames_does_not_wait(self) -> None:
        peer = Peer.open()
        peer.conn.request_close(can_hand_over=False)
        peer.pump()
        assert peer.conn.phase is Phase.LINGERING

    def test_linger_ends_after_two_seconds(self) -> None:
        peer = Peer.open()
        peer.conn.request_close(can_hand_over=False)
        peer.pump()
        deadline = peer.conn.next_deadline()
        assert deadline == pytest.approx(peer.clock.now + 2.0)
        peer.clock.now = deadline
        peer.conn.tick()
        peer.pump()
        assert peer.conn.phase is Phase.CLOSED

    def test_eof_closes_after_the_owed_acks(self) -> None:
        """A half-closing sender still gets its ACK written; it counts undelivered (it may not read it)."""
        peer = Peer.open()
        peer.send(framed(hl7_message("HALF")))
        peer.conn.receive_eof()
        peer.pump()
        assert peer.conn.phase is Phase.DRAINING
        peer.commit()
        assert [msa2(a) for a in peer.wire] == ["HALF"]
        assert peer.outcomes() == {"row-HALF": AckOutcome.UNDELIVERED}
        assert peer.conn.phase is Phase.CLOSED and peer.of(Close)


class TestOrderAndBounds:
    def test_acks_in_arrival_order_whatever_order_commits_finish_in(self) -> None:
        peer = Peer.open()
        peer.send(framed(*(hl7_message(f"M{n}") for n in range(5))))
        assert len(peer.commits) == 5, "pipelined frames are all committing at once (they share commits)"
        for ticket in sorted(peer.commits, reverse=True)[:4]:
            peer.commit(ticket)
        assert peer.wire == [], "nothing before the first frame's ACK"
        peer.commit_all()
        assert [msa2(a) for a in peer.wire] == [f"M{n}" for n in range(5)]
        assert peer.outcomes() == {f"row-M{n}": AckOutcome.DELIVERED for n in range(5)}

    def test_an_accept_is_written_only_after_its_commit(self) -> None:
        peer = Peer.open()
        actions = peer.send(framed(hl7_message("C1")))
        assert [type(a) for a in actions if isinstance(a, (Commit, Send))] == [Commit]
        actions = peer.commit()
        assert ack_code(peer.wire[0]) == "AA"

    def test_rejects_wait_their_turn_behind_a_commit(self) -> None:
        peer = Peer.open()
        peer.send(framed(hl7_message("GOOD"), hl7_message("")))
        assert peer.wire == [], "the reject of the second frame waits for the first one's ACK"
        peer.commit()
        assert [(ack_code(a), msa2(a)) for a in peer.wire] == [("AA", "GOOD"), ("AE", "")]

    def test_pipelining_is_bounded(self) -> None:
        """At most 32 frames are handled ahead of their ACK writes; reading pauses until one is written."""
        peer = Peer.open()
        peer.send(framed(*(hl7_message(f"P{n}") for n in range(MAX_PIPELINED_FRAMES + 8))))
        assert len(peer.commits) == MAX_PIPELINED_FRAMES
        assert not peer.conn.reading
        peer.commit()
        assert len(peer.commits) == MAX_PIPELINED_FRAMES, "one written, one more taken"
        peer.commit_all()
        assert len(peer.wire) == MAX_PIPELINED_FRAMES + 8
        assert peer.conn.reading

    def test_a_sender_that_does_not_read_is_not_answered_into_memory(self) -> None:
        """While the socket buffer is full, ACKs wait; so do new frames, once the pipeline is full."""
        peer = Peer.open()
        peer.conn.writing_paused(True)
        peer.send(framed(*(hl7_message(f"W{n}") for n in range(MAX_PIPELINED_FRAMES + 1))))
        peer.commit_all()
        assert peer.wire == []
        assert not peer.conn.reading
        peer.conn.writing_paused(False)
        peer.pump()
        peer.commit_all()
        assert len(peer.wire) == MAX_PIPELINED_FRAMES + 1

    def test_big_reads_are_framed_a_slice_at_a_time(self) -> None:
        """One decoder pass stays short (16 KiB): the rest waits for the next step, so other senders go first."""
        peer = Peer.open()
        big = hl7_message("BIG", pid="9" * 40_000)
        peer.send(framed(big))
        steps = 1
        while not peer.commits:
            assert peer.conn.more_to_do and not peer.conn.reading
            peer.conn.step()
            peer.pump()
            steps += 1
        assert steps == 3
        assert peer.commits[min(peer.commits)].items[0].body == big
        assert peer.conn.reading and not peer.conn.more_to_do

    def test_audit_rows_are_bounded_then_counted(self) -> None:
        """100 audit rows per connection per minute; past it frames are counted, and summed up once."""
        peer = Peer.open()
        for n in range(AUDIT_ROWS_PER_WINDOW + 30):
            peer.send(framed(b"JUNK%d" % n))
            peer.audits_done()
            if not peer.conn.reading:  # the junk pause
                peer.clock.now += 0.01
                peer.conn.tick()
                peer.pump()
        assert len(peer.of(Audit)) == AUDIT_ROWS_PER_WINDOW
        assert len(peer.logs("frame_without_msh_dropped")) == AUDIT_ROWS_PER_WINDOW
        assert [a for a in peer.of(Count) if a.counter is Counter.AUDIT_ROW_NOT_STORED] == [
            Count(Counter.AUDIT_ROW_NOT_STORED)] * 30
        assert peer.logs("audit_rows_not_stored") == []
        peer.clock.now += AUDIT_WINDOW
        peer.conn.tick()
        peer.pump()
        assert [e.fields["count"] for e in peer.logs("audit_rows_not_stored")] == [30]

    def test_replay_log_lines_are_bounded_then_counted(self) -> None:
        """A sender in a resend loop: 20 replay lines per connection per minute, then one line with the count."""
        peer = Peer.open()
        for _ in range(REPLAY_LOGS_PER_WINDOW + 15):
            peer.send(framed(hl7_message("SAME")))
            peer.commit(outcome="duplicate", commit_ack=b"MSH|^~\\&|ACK\rMSA|AA|SAME\r", prior_state="processed")
        assert len(peer.of(Send)) == REPLAY_LOGS_PER_WINDOW + 15  # every retransmit still gets its ACK
        assert len(peer.logs("retransmit_answered_from_dedupe")) == REPLAY_LOGS_PER_WINDOW
        assert peer.logs("retransmits_answered_not_logged") == []
        peer.clock.now += AUDIT_WINDOW
        peer.conn.tick()
        peer.pump()
        assert [e.fields["count"] for e in peer.logs("retransmits_answered_not_logged")] == [15]
        peer.send(framed(hl7_message("SAME")))
        peer.commit(outcome="duplicate", commit_ack=b"MSH|^~\\&|ACK\rMSA|AA|SAME\r", prior_state="processed")
        assert len(peer.logs("retransmit_answered_from_dedupe")) == REPLAY_LOGS_PER_WINDOW + 1  # a new window

    def test_junk_past_the_bound_pauses_the_sender(self) -> None:
        """A sender whose frames are only counted waits a moment before its next bytes are looked at."""
        peer = Peer.open()
        for n in range(AUDIT_ROWS_PER_WINDOW + 1):
            peer.send(framed(b"JUNK%d" % n))
            peer.audits_done()
        peer.send(framed(hl7_message("AFTER")))
        assert not peer.commits and not peer.conn.reading
        assert peer.conn.next_deadline() == pytest.approx(peer.clock.now + 0.01)
        peer.clock.now += 0.01
        peer.conn.tick()
        peer.pump()
        assert len(peer.commits) == 1

    def test_a_flood_of_counted_frames_is_handled_a_step_at_a_time_then_paused(self) -> None:
        """16 KiB holds thousands of tiny frames: a step handles STEP_EVENTS of them, then the sender waits.

        Handled all at once, a flood of empty frames kept the event loop (and
        the GIL, from the writer) so busy that other senders' ACKs took 45 ms.
        """
        peer = Peer.open()
        for n in range(AUDIT_ROWS_PER_WINDOW):
            peer.send(framed(b"JUNK%d" % n))
            peer.audits_done()
        assert peer.conn.reading

        def counted() -> int:
            return sum(a.counter is Counter.AUDIT_ROW_NOT_STORED for a in peer.of(Count))

        peer.send(framed(*(b"X%d" % n for n in range(3 * STEP_EVENTS))))
        assert counted() == STEP_EVENTS
        assert not peer.conn.reading and not peer.conn.more_to_do
        assert peer.conn.next_deadline() == pytest.approx(peer.clock.now + JUNK_READ_PAUSE)
        peer.clock.now += JUNK_READ_PAUSE
        peer.conn.tick()
        peer.pump()
        assert counted() == 2 * STEP_EVENTS

    def test_pending_audit_rows_are_bounded(self) -> None:
        peer = Peer.open()
        peer.send(framed(*(b"JUNK%d" % n for n in range(MAX_PENDING_AUDITS + 5))))
        assert len(peer.of(Audit)) == MAX_PENDING_AUDITS
        assert not peer.conn.reading
        peer.audits_done(1)
        assert len(peer.of(Audit)) == MAX_PENDING_AUDITS + 1


class TestFailures:
    def test_storage_failure_is_ar_resend_later(self) -> None:
        peer = Peer.open()
        peer.send(framed(hl7_message("DISK")))
        (ticket,) = peer.commits
        peer.conn.commit_failed(ticket, StorageError("disk I/O error"))
        peer.pump()
        assert [(ack_code(a), msa2(a)) for a in peer.wire] == [("AR", "DISK")]
        assert peer.of(Audit) == [], "nothing is kept: the disk is the problem"

    def test_a_bug_in_the_store_gets_the_last_resort_answer(self) -> None:
        peer = Peer.open()
        peer.send(framed(hl7_message("BUG")))
        (ticket,) = peer.commits
        peer.conn.commit_failed(ticket, ValueError("not a storage error"))
        peer.pump()
        assert [(ack_code(a), msa2(a)) for a in peer.wire] == [("AE", "BUG")]
        assert [a.record.error_code for a in peer.of(Audit)] == ["207"]

    def test_abort_with_a_commit_outstanding_records_it_undelivered(self) -> None:
        peer = Peer.open()
        peer.send(framed(hl7_message("GONE")))
        peer.conn.abort()
        peer.pump()
        assert peer.of(Abort) and not peer.conn.finished, "the commit still runs"
        peer.commit()
        assert peer.wire == []
        assert peer.outcomes() == {"row-GONE": AckOutcome.UNDELIVERED}
        assert peer.conn.finished

    def test_a_failed_write_is_undelivered(self) -> None:
        peer = Peer.open()
        peer.writes_ok = False
        peer.send(framed(hl7_message("LOST")))
        peer.commit()
        assert peer.outcomes() == {"row-LOST": AckOutcome.UNDELIVERED}


class TestTimeouts:
    def test_frame_timeout_closes_a_slowloris(self) -> None:
        """A started frame that does not complete within frame_timeout ends the connection; a restart keeps the clock."""
        peer = Peer.open(ChannelPolicy("adt", frame_timeout=5.0))
        peer.send(b"\x0bMSH|^~")
        peer.clock.now += 3
        peer.send(b"\x0bMSH|")  # restarts the frame: not the clock
        assert peer.conn.next_deadline() == pytest.approx(peer.clock.now + 2)
        peer.clock.now += 2
        peer.conn.tick()
        peer.pump()
        assert [e.fields["frame_timeout"] for e in peer.logs("connection_frame_timeout")] == [5.0]
        assert Count(Counter.CONNECTION_TIMED_OUT, "frame") in peer.actions
        assert peer.conn.phase is Phase.CLOSED and peer.of(Close)

    def test_a_sender_that_reads_no_ack_is_cut_off_after_frame_timeout(self) -> None:
        """Its buffers full, we stop reading, so the frame clock stops: the write stall has a clock of its own."""
        peer = Peer.open(ChannelPolicy("adt", frame_timeout=5.0))
        peer.send(framed(hl7_message("W1")))
        peer.conn.writing_paused(True)  # the kernel buffer is full: the sender reads nothing
        peer.commit()
        assert peer.conn.next_deadline() == pytest.approx(peer.clock.now + 5.0)
        peer.clock.now += 3
        peer.conn.writing_paused(True)  # paused again: the clock runs from the first pause
        peer.conn.tick()
        peer.pump()
        assert not peer.of(Abort)
        peer.clock.now += 2
        peer.conn.tick()
        peer.pump()
        assert [e.fields["frame_timeout"] for e in peer.logs("connection_write_stalled")] == [5.0]
        assert Count(Counter.CONNECTION_TIMED_OUT, "write") in peer.actions
        assert peer.conn.phase is Phase.CLOSED and peer.of(Abort)

    def test_a_sender_that_reads_again_in_time_stays(self) -> None:
        peer = Peer.open(ChannelPolicy("adt", frame_timeout=5.0))
        peer.conn.writing_paused(True)
        peer.clock.now += 4
        peer.conn.writing_paused(False)
        peer.clock.now += 4
        peer.conn.tick()
        peer.pump()
        assert peer.conn.phase is Phase.OPEN and not peer.of(Abort)
        assert peer.conn.next_deadline() is None

    def test_the_frame_clock_stops_while_we_do_not_read(self) -> None:
        """Time the connection spends waiting for its own commits is not the sender's."""
        peer = Peer.open(ChannelPolicy("adt", frame_timeout=5.0))
        peer.send(framed(*(hl7_message(f"F{n}") for n in range(MAX_PIPELINED_FRAMES + 1))) + b"\x0bMSH|")
        assert not peer.conn.reading and peer.conn.mid_frame
        assert peer.conn.next_deadline() is None
        peer.clock.now += 60
        peer.conn.tick()
        peer.pump()
        assert peer.conn.phase is Phase.OPEN

    def test_the_frame_clock_runs_while_received_bytes_wait_to_be_framed(self) -> None:
        """Bytes received but not framed yet are the sender's: a sender faster than we frame must still time out."""
        peer = Peer.open(ChannelPolicy("adt", frame_timeout=5.0))
        peer.send(b"\x0bMSH|" + b"X" * (3 * FEED_CHUNK))
        assert peer.conn.mid_frame and peer.conn.more_to_do and not peer.conn.reading
        assert peer.conn.next_deadline() == pytest.approx(peer.clock.now + 5.0)
        peer.clock.now += 5
        peer.conn.tick()
        peer.pump()
        assert [e.fields["frame_timeout"] for e in peer.logs("connection_frame_timeout")] == [5.0]

    def test_idle_timeout_counts_from_the_last_frame_or_ack(self) -> None:
        peer = Peer.open(ChannelPolicy("adt", idle_timeout=10.0))
        peer.send(framed(hl7_message("I1")))
        assert peer.conn.next_deadline() is None, "an ACK is owed: not idle"
        peer.clock.now += 4
        peer.commit()
        assert peer.conn.next_deadline() == pytest.approx(peer.clock.now + 10)
        peer.clock.now += 5
        peer.send(b"\r\n junk outside frames \r\n")
        assert peer.conn.next_deadline() == pytest.approx(peer.clock.now + 5), "junk is no activity"
        peer.clock.now += 5
        peer.conn.tick()
        peer.pump()
        assert len(peer.logs("connection_idle_timeout")) == 1
        assert peer.conn.phase is Phase.CLOSED

    def test_idle_since_only_when_nothing_is_owed(self) -> None:
        peer = Peer.open()
        start = peer.conn.idle_since()
        assert start == peer.clock.now
        peer.send(b"\x0bMSH|")
        assert peer.conn.idle_since() is None, "mid-frame"
        peer.send(b"^~\\&|A|B|C|D|||ADT^A01|E1|P|2.5\x1c\r")
        assert peer.conn.idle_since() is None, "an ACK owed"
        peer.commit()
        assert peer.conn.idle_since() == peer.clock.now
        peer.conn.evict()
        peer.pump()
        assert peer.conn.phase is Phase.CLOSED and peer.of(Close)


class TestApplicationAcks:
    def test_enhanced_relay_when_idle(self) -> None:
        peer = Peer.open()
        peer.send(framed(hl7_message("E1", msh15="AL", msh16="AL")))
        peer.commit()
        assert [ack_code(a) for a in peer.wire] == ["CA"]
        (wait,) = peer.waits.values()
        assert (wait.message_id, wait.deadline) == ("row-E1", None)
        peer.conn.application_ack(wait.token, app_ack("AA", "E1"))
        peer.pump()
        assert [ack_code(a) for a in peer.wire] == ["CA", "AA"]
        assert peer.outcomes() == {"row-E1": AckOutcome.DELIVERED}
        assert [e.fields["id"] for e in peer.logs("application_ack_relayed")] == ["row-E1"]

    def test_enhanced_relay_never_slips_between_a_message_and_its_ack(self) -> None:
        """A connection with a message awaiting its own ACK gets no relayed one: undelivered, replayed later."""
        peer = Peer.open()
        peer.send(framed(hl7_message("E1", msh15="AL", msh16="AL")))
        peer.commit()
        (wait,) = peer.waits.values()
        peer.send(framed(hl7_message("E2")))
        peer.conn.application_ack(wait.token, app_ack("AA", "E1"))
        peer.pump()
        peer.commit()
        assert [(ack_code(a), msa2(a)) for a in peer.wire] == [("CA", "E1"), ("AA", "E2")]
        assert peer.outcomes()["row-E1"] is AckOutcome.UNDELIVERED
        assert len(peer.logs("application_ack_undelivered")) == 1

    def test_relays_awaited_are_bounded(self) -> None:
        peer = Peer.open()
        for n in range(MAX_PENDING_RELAYS + 2):
            peer.send(framed(hl7_message(f"R{n}", msh15="AL", msh16="AL")))
            peer.commit()
        assert peer.conn.relays_awaited == MAX_PENDING_RELAYS
        assert [peer.outcomes()[f"row-R{n}"] for n in (MAX_PENDING_RELAYS, MAX_PENDING_RELAYS + 1)] == [
            AckOutcome.UNDELIVERED] * 2
        assert len(peer.logs("application_acks_not_awaited")) == 1

    def test_application_channel_holds_the_order(self) -> None:
        """The held answer is this frame's ACK: the next frame's ACK waits behind it."""
        peer = Peer.open(ChannelPolicy("adt", ack="application", application_ack_timeout=30))
        peer.send(framed(hl7_message("H1"), hl7_message("H2")))
        peer.commit_all()
        assert peer.wire == []
        first, second = sorted(peer.waits.values(), key=lambda w: w.token)
        assert first.deadline == pytest.approx(peer.clock.now + 30)
        peer.conn.application_ack(second.token, app_ack("AA", "H2"))
        peer.pump()
        assert peer.wire == []
        peer.conn.application_ack(first.token, None)  # timed out
        peer.pump()
        assert [(ack_code(a), msa2(a)) for a in peer.wire] == [("AR", "H1"), ("AA", "H2")]
        assert peer.outcomes() == {"row-H1": AckOutcome.UNDELIVERED, "row-H2": AckOutcome.DELIVERED}

    def test_release_held_answers_ar_at_once(self) -> None:
        peer = Peer.open(ChannelPolicy("adt", ack="application"))
        peer.send(framed(hl7_message("H1")))
        peer.commit()
        peer.conn.release_held()
        peer.pump()
        assert [ack_code(a) for a in peer.wire] == ["AR"]
        assert peer.waits == {}, "the relay is no longer asked"
        assert len(peer.logs("application_ack_deferred_at_stop")) == 1


class TestHandOver:
    def test_unhandled_bytes_travel_exactly(self) -> None:
        """Frames received but not handled, then the one in progress, go to the successor byte for byte."""
        peer = Peer.open()
        one, two, three = (hl7_message(f"U{n}") for n in range(3))
        peer.send(framed(one))
        peer.conn.writing_paused(True)  # keep the first one's ACK owed...
        peer.commit()
        peer.conn.writing_paused(False)
        peer.pump()
        peer.send(framed(*(hl7_message(f"B{n}") for n in range(MAX_PIPELINED_FRAMES))))
        peer.send(framed(two) + b"\x0b" + three[:20])
        peer.conn.request_close(can_hand_over=True)
        peer.pump()
        assert peer.conn.phase is Phase.DRAINING
        peer.commit_all()
        (offer,) = peer.of(HandOver)
        assert offer.buffered == framed(two) + b"\x0b" + three[:20]
        assert offer.owed == Owed()
        assert peer.conn.phase is Phase.HANDING_OVER and not peer.conn.reading
        peer.conn.handover_done(taken=True, moved=False)
        peer.pump()
        assert peer.conn.phase is Phase.HANDED_OVER and peer.of(Abort)

    def test_held_acks_move_with_the_connection(self) -> None:
        """Shutdown with application ACKs held: offered at once, with the time left; the successor answers them."""
        peer = Peer.open(ChannelPolicy("adt", ack="application", application_ack_timeout=30))
        peer.send(framed(hl7_message("H1")))
        peer.commit()
        peer.clock.now += 10
        peer.conn.request_close(can_hand_over=True)
        peer.pump()
        (offer,) = peer.of(HandOver)
        (reply,) = offer.owed.replies
        assert reply.wait is not None
        assert (reply.wait.message_id, reply.wait.timeout) == ("row-H1", pytest.approx(20))
        assert offer.or_without_owed is False
        peer.conn.handover_done(taken=True, moved=True)
        peer.pump()
        assert peer.conn.phase is Phase.HANDED_OVER
        assert peer.waits == {} and peer.outcomes() == {}, "the successor answers and records it"

    def test_a_refused_offer_keeps_the_connection_and_what_came_meanwhile(self) -> None:
        peer = Peer.open(ChannelPolicy("adt", ack="application"))
        peer.send(framed(hl7_message("H1")))
        peer.commit()
        (wait,) = peer.waits.values()
        peer.conn.request_close(can_hand_over=True)
        peer.pump()
        assert peer.conn.phase is Phase.HANDING_OVER
        peer.conn.application_ack(wait.token, app_ack("AA", "H1"))  # during the exchange: held back
        peer.pump()
        assert peer.wire == []
        peer.conn.handover_done(taken=False, moved=False)
        peer.pump()
        assert [ack_code(a) for a in peer.wire] == ["AA"]
        assert peer.conn.phase is Phase.HANDING_OVER, "the final offer, now that nothing is owed"
        (_, final) = peer.of(HandOver)
        assert final.owed == Owed() and final.or_without_owed
        peer.conn.handover_done(taken=False, moved=False)
        peer.pump()
        assert peer.conn.phase is Phase.LINGERING

    def test_relays_go_with_the_connection(self) -> None:
        peer = Peer.open()
        peer.send(framed(hl7_message("E1", msh15="AL", msh16="AL")))
        peer.commit()
        peer.conn.request_close(can_hand_over=True)
        peer.pump()
        (offer,) = peer.of(HandOver)
        assert [r.message_id for r in offer.owed.relays] == ["row-E1"]
        peer.conn.handover_done(taken=True, moved=False)  # a previous version took it without them
        peer.pump()
        assert peer.outcomes() == {"row-E1": AckOutcome.UNDELIVERED}

    def test_no_offer_once_the_sender_closed(self) -> None:
        peer = Peer.open()
        peer.send(framed(hl7_message("LAST")))
        peer.conn.request_close(can_hand_over=True)
        peer.conn.receive_eof()
        peer.commit_all()
        assert peer.of(HandOver) == [] and peer.conn.phase is Phase.LINGERING

    def test_no_offer_in_the_middle_of_an_oversize_frame(self) -> None:
        """Its bytes were dropped, so the stream cannot be handed on: the connection closes the usual way."""
        peer = Peer.open(ChannelPolicy("adt", max_message_bytes=1024))
        peer.send(b"\x0bMSH|" + b"x" * 2000)
        peer.conn.request_close(can_hand_over=True)
        peer.send(b"\x1c\r\x0bMSH|" + b"y" * 2000)  # the next one, oversize too, not finished
        peer.pump()
        assert [ack_code(a) for a in peer.wire] == ["AE"]
        assert peer.of(HandOver) == [] and peer.conn.phase is Phase.LINGERING

    def test_adopted_owed_acks_are_answered_first(self) -> None:
        """A successor answers what the predecessor owed, in order, before any new frame."""
        peer = Peer.open()
        env_message = hl7_message("OLD-2", msh15="AL", msh16="AL")
        from agent.core.envelope import read_msh

        owed = Owed(replies=(OwedReply(frames=(OwedFrame(b"OLD-ACK-1", "row-OLD-1"),)),
                             OwedReply(frames=(OwedFrame(b"OLD-CA-2"),), relay=OwedRelay("row-OLD-2", read_msh(env_message)))),
                    relays=(OwedRelay("row-OLD-0", read_msh(env_message)),))
        peer.conn.adopt(owed)
        peer.send(framed(hl7_message("NEW")))
        peer.commit()
        assert peer.wire[:2] == [b"OLD-ACK-1", b"OLD-CA-2"]
        assert msa2(peer.wire[2]) == "NEW"
        assert sorted(w.message_id for w in peer.waits.values()) == ["row-OLD-0", "row-OLD-2"]

    def test_adopted_held_ack_keeps_its_time_left(self) -> None:
        from agent.core.envelope import read_msh

        peer = Peer.open()
        owed = Owed(replies=(OwedReply(wait=OwedWait("row-W", read_msh(hl7_message("W")), "utf-8", 7.5)),))
        peer.conn.adopt(owed)
        peer.pump()
        (wait,) = peer.waits.values()
        assert wait.deadline == pytest.approx(peer.clock.now + 7.5)
