"""The HL7 batch splitter and the ACK batch builder (agent.core.batch), without a loop or a socket.

Property-tested like the framer: arbitrary bytes never raise; a well-formed
batch, whatever its segment ends, splits back into exactly the messages it
was built from; the corpus's batch samples split as batches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from agenttest import hl7_message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core.batch import Batch, ack_batch, is_batch, split_batch

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
EOLS = (b"\r", b"\n", b"\r\n")
SAMPLES = {  # tests/data file -> (groups, members, FHS present)
    "batch_oru_r01_fhs.hl7": (1, 3, True),
    "batch_adt_a04_bhs_crlf.hl7": (1, 2, False),
    "batch_dft_p03_enhanced_lf.hl7": (1, 2, True),
}


def with_eol(message: bytes, eol: bytes) -> bytes:
    return b"".join(seg + eol for seg in message.rstrip(b"\r").split(b"\r"))


def build(messages: list[bytes], eol: bytes, *, fhs: bool, bts_count: bool = True) -> bytes:
    out = [b"FHS|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||||F1" + eol] if fhs else []
    out.append(b"BHS|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||||B1" + eol)
    out += [with_eol(m, eol) for m in messages]
    out.append(b"BTS|" + (str(len(messages)).encode() if bts_count else b"") + eol)
    if fhs:
        out.append(b"FTS|1" + eol)
    return b"".join(out)


def ok(batch: Batch | None) -> Batch:
    assert batch is not None
    assert batch.problem is None, batch.problem
    return batch


class TestSplit:
    def test_a_single_message_is_no_batch(self) -> None:
        assert split_batch(hl7_message("1")) is None
        assert not is_batch(b"BHSX")  # "BHS" must be followed by a usable field separator

    @pytest.mark.parametrize("eol", EOLS)
    def test_members_keep_their_bytes(self, eol: bytes) -> None:
        messages = [hl7_message(f"C{i}") for i in range(3)]
        batch = ok(split_batch(build(messages, eol, fhs=True)))
        assert batch.members == tuple(with_eol(m, eol) for m in messages)
        assert batch.fhs is not None and batch.fhs.field(11) == "F1"
        assert batch.groups[0].bhs is not None and batch.groups[0].bhs.field(11) == "B1"
        assert batch.groups[0].bts is not None and batch.groups[0].bts.field(1) == "3"

    def test_blank_lines_between_members_belong_to_none(self) -> None:
        payload = b"\r\nBHS|^~\\&\r\n\r\n" + with_eol(hl7_message("A"), b"\r\n") + b"\r\n" + \
            with_eol(hl7_message("B"), b"\r\n") + b"BTS|2\r\n\r\n"
        batch = ok(split_batch(payload))
        assert [m.endswith(b"PV1|1|I|WARD^1^1\r\n") for m in batch.members] == [True, True]

    def test_several_batches_in_one_file(self) -> None:
        one = b"BHS|^~\\&||||||||||B1\r" + hl7_message("A") + b"BTS|1\r"
        two = b"BHS|^~\\&||||||||||B2\r" + hl7_message("B") + hl7_message("C") + b"BTS|2\r"
        batch = ok(split_batch(b"FHS|^~\\&\r" + one + two + b"FTS|2\r"))
        assert [len(g.members) for g in batch.groups] == [1, 2]

    @pytest.mark.parametrize(("payload", "problem"), [
        (b"BHS|^~\\&\r" + hl7_message("A") + b"BTS|2\r", "BTS-1 says 2 messages, the batch holds 1"),
        (b"FHS|^~\\&\rBHS|^~\\&\r" + hl7_message("A") + b"BTS|1\rFTS|3\r", "FTS-1 says 3 batches, the file holds 1"),
        (b"BHS|^~\\&\rPID|1\r" + hl7_message("A") + b"BTS|1\r", "segment PID outside any message"),
        (b"BHS|^~\\&\r" + hl7_message("A") + b"BTS|1\r" + hl7_message("B"), "a message after BTS without a new BHS"),
        (b"FHS|^~\\&\rBHS|^~\\&\r" + hl7_message("A") + b"BTS|1\rFTS|1\rMSH|^~\\&\r",
         "segments after FTS (the end of the file)"),
    ])
    def test_a_batch_that_does_not_add_up_says_why(self, payload: bytes, problem: str) -> None:
        batch = split_batch(payload)
        assert batch is not None and batch.problem == problem

    @pytest.mark.parametrize(("name", "shape"), SAMPLES.items())
    def test_corpus_samples_split_as_batches(self, hl7_sample: Callable[[str], bytes], name: str,
                                             shape: tuple[int, int, bool]) -> None:
        batch = ok(split_batch(hl7_sample(name)))
        assert (len(batch.groups), len(batch.members), batch.fhs is not None) == shape
        assert all(m.startswith(b"MSH") for m in batch.members)

    @PROPERTY
    @given(st.binary(max_size=400))
    def test_arbitrary_bytes_never_raise(self, data: bytes) -> None:
        split_batch(data)
        split_batch(b"BHS|" + data)
        split_batch(b"FHS|^~\\&\r" + data.replace(b"\x00", b"\r"))

    @PROPERTY
    @given(st.lists(st.text(alphabet="ABCDEFGHIJ0123456789", min_size=1, max_size=12), max_size=8),
           st.sampled_from(EOLS), st.booleans(), st.booleans())
    def test_a_well_formed_batch_round_trips(self, cids: list[str], eol: bytes, fhs: bool, count: bool) -> None:
        messages = [hl7_message(c) for c in cids]
        batch = ok(split_batch(build(messages, eol, fhs=fhs, bts_count=count)))
        assert batch.members == tuple(with_eol(m, eol) for m in messages)

    @PROPERTY
    @given(st.lists(st.text(alphabet="ABC123", min_size=1, max_size=6), min_size=1, max_size=5),
           st.sampled_from(EOLS), st.integers(0, 10_000))
    def test_a_cut_batch_never_raises_and_never_invents_a_member(self, cids: list[str], eol: bytes,
                                                                 cut: int) -> None:
        messages = [hl7_message(c) for c in cids]
        payload = build(messages, eol, fhs=True)[: cut % 2000]
        batch = split_batch(payload)
        if batch is not None:
            assert all(m.startswith(b"MSH") and m in payload for m in batch.members)


class TestAckBatch:
    ACK = b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101120000.0000+0100||ACK^A01^ACK|K1|P|2.5.1\rMSA|AA|C0\r"

    def test_mirrors_the_envelope_and_counts(self) -> None:
        batch = ok(split_batch(build([hl7_message("C0"), hl7_message("C1")], b"\r", fhs=True)))
        out = ack_batch(batch, [self.ACK, self.ACK.replace(b"C0", b"C1")], now="X").split(b"\r")
        assert [s[:3] for s in out if s] == [b"FHS", b"BHS", b"MSH", b"MSA", b"MSH", b"MSA", b"BTS", b"FTS"]
        fhs, bhs = out[0].split(b"|"), out[1].split(b"|")
        # Sender and receiver swapped; the time of the first ACK; a new id; the inbound's id in -12.
        assert fhs[2:7] == bhs[2:7] == [b"EHR", b"CENTRAL", b"LAB", b"NORTH", b"20260101120000.0000+0100"]
        assert bhs[11] == b"B1" and fhs[11] == b"F1"
        assert len(bhs[10]) == 20 and bhs[10] != b"B1"
        assert out[6] == b"BTS|2" and out[7] == b"FTS|1"

    def test_same_acks_same_bytes(self) -> None:
        """A retransmit whose member ACKs are replayed gets the same ACK batch, byte for byte."""
        batch = ok(split_batch(build([hl7_message("C0")], b"\n", fhs=False)))
        assert ack_batch(batch, [self.ACK], now="A") == ack_batch(batch, [self.ACK], now="B")
        assert ack_batch(batch, [self.ACK], now="A") != ack_batch(batch, [self.ACK.replace(b"K1", b"K2")], now="A")

    def test_no_fhs_in_no_fhs_out(self) -> None:
        batch = ok(split_batch(build([hl7_message("C0")], b"\r", fhs=False)))
        assert not ack_batch(batch, [self.ACK], now="X").startswith(b"FHS")
        assert b"FTS" not in ack_batch(batch, [self.ACK], now="X")
