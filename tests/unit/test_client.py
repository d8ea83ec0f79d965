"""`hl7-agent send`'s file reading and ACK printing (SPEC 2)."""

from __future__ import annotations

import pytest

from agent.app.client import ack_accepted, decode_ack, split_messages
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


class TestDecodeAck:
    def test_latin1_ack_printed_by_its_msh18(self) -> None:
        """An ACK declaring 8859/1 is printed in that character set, not as replacement characters."""
        ack = "MSH|^~\\&|LÄB|F|A|B|20260101||ACK^A01^ACK|9|P|2.5|||||8859/1\rMSA|AA|1\r".encode("latin-1")
        assert "LÄB" in decode_ack(ack)
