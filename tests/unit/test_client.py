"""`hl7-agent send`'s file reading and ACK printing (SPEC 2)."""

from __future__ import annotations

import pytest

from agent.app.client import ack_accepted, answered_control_id, decode_ack, split_messages
from agent.core import mllp


class TestSplitMessages:
    def test_plain_file_split_at_msh_with_line_endings_normalised(self) -> None:
        """Two messages with \\n and \\r\\n endings become two \\r-ended messages."""
        data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\nPID|1\r\nMSH|^~\\&|A|B|C|D|||ADT^A01|2|P|2.5\nPID|2\n"
        assert split_messages(data) == [
            b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\rPID|1\r",
            b"MSH|^~\\&|A|B|C|D|||ADT^A01|2|P|2.5\rPID|2\r",
        ]

    def test_utf8_bom_is_not_in_the_way(self) -> None:
        """A file saved with a UTF-8 byte order mark still yields its message."""
        assert split_messages(b"\xef\xbb\xbfMSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\r") == [
            b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\r"
        ]

    def test_a_file_starting_with_fhs_or_bhs_is_one_batch_frame(self) -> None:
        """An HL7 batch file goes out whole, as one frame, line endings normalised."""
        data = b"\nBHS|^~\\&|A\nMSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\r\nPID|1\nMSH|^~\\&|A|B|C|D|||ADT^A01|2|P|2.5\nBTS|2\n"
        assert split_messages(data) == [
            b"BHS|^~\\&|A\rMSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\rPID|1\rMSH|^~\\&|A|B|C|D|||ADT^A01|2|P|2.5\rBTS|2\r"]

    def test_an_ack_batch_is_accepted_only_when_every_ack_in_it_is(self) -> None:
        aa = b"MSH|^~\\&|A|B|C|D|||ACK|1|P|2.5\rMSA|AA|1\r"
        ae = aa.replace(b"MSA|AA", b"MSA|AE")
        assert ack_accepted(b"BHS|^~\\&\r" + aa + aa + b"BTS|2\r")
        assert not ack_accepted(b"BHS|^~\\&\r" + aa + ae + b"BTS|2\r")
        assert ack_accepted(aa) and not ack_accepted(ae)

    def test_framed_file_with_a_broken_frame_says_so(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An MLLP-framed file whose frame ends 0x1C 0x0A is reported, not silently skipped."""
        data = mllp.encode_frame(b"MSH|A") + b"\x0bMSH|B\x1c\n"
        assert split_messages(data) == [b"MSH|A"]
        assert "not sent" in capsys.readouterr().err


    def test_line_breaks_between_frames_are_no_junk(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Many tools export MLLP with a newline after each frame: both frames go, no warning."""
        data = b"\n" + mllp.encode_frame(b"MSH|A") + b"\r\n" + mllp.encode_frame(b"MSH|B") + b"\n\n"
        assert split_messages(data) == [b"MSH|A", b"MSH|B"]
        assert capsys.readouterr().err == ""


class TestAnsweredControlId:
    MSG = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C42|P|2.5\rPID|1\r"

    def test_an_ack_for_another_message_is_named(self) -> None:
        assert answered_control_id(self.MSG, b"MSH|^~\\&|C|D|A|B|||ACK|9|P|2.5\rMSA|AA|WRONG\r") == ("C42", "WRONG")

    @pytest.mark.parametrize("ack", [b"MSH|^~\\&|C|D|A|B|||ACK|9|P|2.5\rMSA|AA|C42\r",
                                     b"MSH|^~\\&|C|D|A|B|||ACK|9|P|2.5\rMSA|AE|\r", b"garbage"])
    def test_a_matching_empty_or_unreadable_msa2_says_nothing(self, ack: bytes) -> None:
        assert answered_control_id(self.MSG, ack) is None

    def test_a_batch_is_not_checked(self) -> None:
        batch = b"BHS|^~\\&\r" + self.MSG + b"BTS|1\r"
        assert answered_control_id(batch, b"MSH|^~\\&|C|D|A|B|||ACK|9|P|2.5\rMSA|AA|OTHER\r") is None


class TestDecodeAck:
    def test_latin1_ack_printed_by_its_msh18(self) -> None:
        """An ACK declaring 8859/1 is printed in that character set, not as replacement characters."""
        ack = "MSH|^~\\&|LÄB|F|A|B|20260101||ACK^A01^ACK|9|P|2.5|||||8859/1\rMSA|AA|1\r".encode("latin-1")
        assert "LÄB" in decode_ack(ack)
