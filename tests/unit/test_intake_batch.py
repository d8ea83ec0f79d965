"""HL7 batch frames through the intake core (agent.core.intake + intake_batch), without a loop or a database.

Driven as the shell drives it: a batch frame in, one ``Commit`` for all its
members, the store's results back, one ACK batch out. Commit results are
the store's own ``IntakeResult`` values.
"""

from __future__ import annotations

import random
from pathlib import Path

from agenttest import ack_code, batch_of, hl7_message, members_of, msa2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from intakefuzz import mutate
from test_intake_connection import FakeClock, Peer, framed

from agent.core.batch import split_batch
from agent.core.intake import IntakeConnection
from agent.core.intake_actions import AwaitApplicationAck, Commit, Send
from agent.core.intake_types import Audit, ChannelPolicy, Count, Counter, RecordOutcome
from agent.core.states import AckOutcome
from agent.errors import StorageError
from agent.storage.store import IntakeResult

BATCH_SAMPLES = sorted((Path(__file__).resolve().parent.parent / "data").glob("batch_*.hl7"))


def open_peer(policy: ChannelPolicy | None = None) -> Peer:
    clock = FakeClock()
    return Peer(IntakeConnection(policy or ChannelPolicy("adt"), clock), clock)


def commit_batch(peer: Peer, outcome: str = "accepted", **extra: object) -> list[IntakeResult]:
    ticket = min(peer.commits)
    action = peer.commits.pop(ticket)
    results = []
    for message in action.items:
        peer.seq += 1
        fields: dict[str, object] = {"ack_mode": message.ack_mode, **extra}
        results.append(IntakeResult(outcome=outcome, message_id=f"row-{message.envelope.control_id}",  # type: ignore[arg-type]
                                    seq=peer.seq, **fields))  # type: ignore[arg-type]
    peer.conn.commit_done(ticket, results)
    peer.pump()
    return results


class TestBatchIntake:
    def test_three_members_one_commit_one_ack_batch_in_order(self) -> None:
        peer = open_peer()
        peer.send(framed(batch_of(hl7_message("A"), hl7_message("B"), hl7_message("C"), fhs=True)))
        (commit,) = peer.of(Commit)
        assert [m.envelope.control_id for m in commit.items] == ["A", "B", "C"]
        assert peer.wire == [], "nothing before the commit"
        commit_batch(peer)
        (response,) = peer.wire
        assert response.startswith(b"FHS|") and response.endswith(b"BTS|3\rFTS|1\r")
        assert [(ack_code(a), msa2(a)) for a in members_of(response)] == [("AA", "A"), ("AA", "B"), ("AA", "C")]
        # The one write settles every member's ack_outcome.
        assert peer.outcomes() == {f"row-{c}": AckOutcome.DELIVERED for c in "ABC"}
        (send,) = peer.of(Send)
        assert (send.message_id, send.also) == ("row-A", ("row-B", "row-C"))
        # A member's commit is logged as a single message's is: at debug, not a line per message at info.
        assert [(log.level, log.fields["control_id"]) for log in peer.logs("message_committed")] == [
            ("debug", "A"), ("debug", "B"), ("debug", "C")]

    def test_every_member_acked_whatever_its_msh15(self) -> None:
        peer = open_peer()
        peer.send(framed(batch_of(hl7_message("A", msh15="NE", msh16="NE"), hl7_message("B", msh15="ER"))))
        commit_batch(peer)
        (response,) = peer.wire
        assert [(ack_code(a), msa2(a)) for a in members_of(response)] == [("CA", "A"), ("CA", "B")]

    def test_a_malformed_member_refuses_the_whole_batch(self) -> None:
        broken = hl7_message("B").replace(b"ADT^A01^ADT_A01", b"")  # MSH-9 missing
        peer = open_peer()
        peer.send(framed(batch_of(hl7_message("A"), broken, hl7_message("C"))))
        assert peer.of(Commit) == [], "nothing committed"
        (response,) = peer.wire
        acks = members_of(response)
        assert [(ack_code(a), msa2(a)) for a in acks] == [("AR", "A"), ("AE", "B"), ("AR", "C")]
        assert b"MSH-9 message type missing" in acks[1]
        assert b"batch refused" in acks[0] and b"member 2 (MSH-10 B)" in acks[0]
        (audit,) = peer.of(Audit)  # the frame kept whole as one audit row
        assert audit.record.body == batch_of(hl7_message("A"), broken, hl7_message("C"))
        assert audit.record.error_code == "101"

    def test_a_refused_batch_counts_each_member_once(self) -> None:
        """hl7_agent_messages_received/rejected: one per member, the refused member not twice."""
        broken = hl7_message("B").replace(b"ADT^A01^ADT_A01", b"")
        peer = open_peer()
        peer.send(framed(batch_of(hl7_message("A"), broken, hl7_message("C"))))
        counted = [(c.counter, c.label) for c in peer.of(Count)]
        assert sorted(counted, key=str) == sorted([(Counter.MESSAGE_RECEIVED, "")] * 2 + [
            (Counter.MESSAGE_REJECTED, "AR"), (Counter.MESSAGE_REJECTED, "AE"), (Counter.MESSAGE_REJECTED, "AR")],
            key=str)

    def test_a_count_that_does_not_match_refuses_every_member(self) -> None:
        peer = open_peer()
        peer.send(framed(batch_of(hl7_message("A"), hl7_message("B"), count=3)))
        assert peer.of(Commit) == []
        acks = members_of(peer.wire[0])
        assert [ack_code(a) for a in acks] == ["AE", "AE"]
        assert b"BTS-1 says 3 messages" in acks[0]

    def test_retransmit_replays_the_stored_acks_byte_for_byte(self) -> None:
        payload = framed(batch_of(hl7_message("A"), hl7_message("B")))
        first = open_peer()
        first.send(payload)
        stored = [m.commit_ack for m in first.commits[min(first.commits)].items]
        commit_batch(first)
        again = open_peer()
        again.send(payload)
        action = again.commits.pop(min(again.commits))
        again.conn.commit_done(action.ticket, [
            IntakeResult(outcome="duplicate", message_id=f"row-{m.envelope.control_id}", ack_mode="commit",
                         commit_ack=ack, prior_state=None)
            for m, ack in zip(action.items, stored, strict=True)])
        again.pump()
        assert again.wire == first.wire
        assert again.logs("retransmit_answered_from_dedupe") and not again.logs("message_committed")

    def test_enhanced_mode_commit_acks_then_application_acks_one_by_one(self) -> None:
        peer = open_peer()
        peer.send(framed(batch_of(hl7_message("A", msh15="AL", msh16="AL"), hl7_message("B", msh15="AL", msh16="AL"))))
        commit_batch(peer)
        assert [ack_code(a) for a in members_of(peer.wire[0])] == ["CA", "CA"]
        waits = peer.of(AwaitApplicationAck)
        assert [w.message_id for w in waits] == ["row-A", "row-B"]
        app = b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK^A01^ACK|S-1|P|2.5.1\rMSA|AA|%s\r"
        for w, cid in zip(waits, (b"A", b"B"), strict=True):
            peer.conn.application_ack(w.token, app % cid)
            peer.pump()
        assert [msa2(a) for a in peer.wire[1:]] == ["A", "B"], "relayed after the ACK batch, each its own frame"
        assert peer.outcomes() == {"row-A": AckOutcome.DELIVERED, "row-B": AckOutcome.DELIVERED}

    def test_application_channel_relays_after_the_batch(self) -> None:
        peer = open_peer(ChannelPolicy("adt", ack="application"))
        peer.send(framed(batch_of(hl7_message("A"), hl7_message("B"))))
        commit_batch(peer)
        assert [ack_code(a) for a in members_of(peer.wire[0])] == ["AA", "AA"], "not held: one response per batch"
        assert [w.deadline for w in peer.of(AwaitApplicationAck)] == [None, None]

    def test_storage_failure_answers_every_member_resend_later(self) -> None:
        peer = open_peer()
        peer.send(framed(batch_of(hl7_message("A"), hl7_message("B"))))
        ticket = min(peer.commits)
        peer.commits.pop(ticket)
        peer.conn.commit_failed(ticket, StorageError("disk I/O error"))
        peer.pump()
        assert [ack_code(a) for a in members_of(peer.wire[0])] == ["AR", "AR"]
        assert not [a for a in peer.actions if isinstance(a, RecordOutcome)]

    def test_an_empty_batch_is_answered_without_a_commit(self) -> None:
        peer = open_peer()
        peer.send(framed(batch_of()))
        assert peer.of(Commit) == []
        assert peer.wire[0].startswith(b"BHS|") and peer.wire[0].endswith(b"BTS|0\r")

    def test_a_batch_of_acks_is_recorded_not_answered(self) -> None:
        ack = b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK^A01^ACK|S-1|P|2.5.1\rMSA|AA|X\r"
        peer = open_peer()
        peer.send(framed(batch_of(ack, ack.replace(b"S-1", b"S-2"))))
        assert peer.wire == [] and peer.of(Commit) == []
        assert len(peer.of(Audit)) == 1

    def test_batches_and_single_messages_keep_arrival_order(self) -> None:
        peer = open_peer()
        peer.send(framed(hl7_message("S1"), batch_of(hl7_message("A"), hl7_message("B")), hl7_message("S2")))
        commits = sorted(peer.commits)
        assert [len(peer.commits[t].items) for t in commits] == [1, 2, 1]
        peer.commit(commits[2])  # S2's commit returns first: its ACK still waits its turn
        assert peer.wire == []
        peer.commit(commits[0])
        commit_batch(peer)
        assert [msa2(peer.wire[0]), peer.wire[1][:3], msa2(peer.wire[2])] == ["S1", b"BHS", "S2"]


class TestHandOverCarriesTheAckBatch:
    def test_owed_ack_batch_survives_the_hand_over_encoding(self) -> None:
        """An ACK batch still owed at an upgrade keeps the ids its write settles and the relays after it."""
        import json

        from agent.core.envelope import read_msh
        from agent.core.intake_types import Owed, OwedFrame, OwedRelay, OwedReply
        from agent.runtime.adoption import owed_from, owed_json

        env = read_msh(hl7_message("A", msh15="AL", msh16="AL"))
        owed = Owed((OwedReply((OwedFrame(b"BHS|^~\\&\rBTS|0\r", "row-A", ("row-B", "row-C")),),
                               relays=(OwedRelay("row-A", env), OwedRelay("row-B", env))),))
        assert owed_from(json.loads(json.dumps(owed_json(owed)))) == owed


class TestBatchProperties:
    """Damaged batch samples through the core: never the last resort, one ACK batch, accepts only when committed."""

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(st.integers(0, 2**32 - 1), st.integers(0, 2), st.integers(0, 5))
    def test_mutated_batches(self, seed: int, index: int, steps: int) -> None:
        payload = mutate(random.Random(seed), BATCH_SAMPLES[index].read_bytes(), steps)
        batch = split_batch(payload)
        if batch is None or b"\x0b" in payload or b"\x1c" in payload:
            return
        peer = open_peer()
        peer.send(framed(payload))
        committed = bool(peer.commits)
        while peer.commits:
            commit_batch(peer)
        assert not peer.logs("frame_handling_failed")
        if batch.members and all(m[:3] == b"MSH" and b"|ACK" in m.split(b"\r")[0] for m in batch.members):
            return  # may be an ACK batch: recorded, not answered
        (answer,) = peer.wire
        acks = members_of(answer)
        assert len(acks) == len(batch.members)
        codes = {ack_code(a) for a in acks}
        if not committed:
            assert not codes & {"AA", "CA"}, "an accept for a batch that was not committed"
        else:
            assert codes <= {"AA", "CA"}
