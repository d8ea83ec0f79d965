"""The receiving system's reason, read from the ACK it sent (HL7 v2 MSA, ERR; tables 0357, 0008)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.acks import (
    SERVER_REASON_MAX,
    AckCode,
    app_ack_from_status,
    build_ack,
    server_reason,
)
from agent.core.envelope import read_msh

MSH25 = "MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101120000||ACK^A01^ACK|A1|P|2.5.1"
MSH23 = "MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101120000||ACK^A01^ACK|A1|P|2.3"


def ack(*segments: str, msh: str = MSH25, end: str = "\r") -> str:
    return end.join([msh, *segments]) + end


class TestWhatIsRead:
    @pytest.mark.parametrize(
        ("text", "reason"),
        [
            # MSA-3, the text message most servers fill (the example).
            (ack("MSA|AE|MSG1|unknown patient identifier in PID-3",
                 "ERR|||204^Unknown key identifier^HL70357|E"), "unknown patient identifier in PID-3"),
            # v2.5+: ERR-8 (user message) before ERR-7 (diagnostic), with ERR-2's location.
            (ack("MSA|AE|MSG1", "ERR||PID^1^3|204^Unknown key identifier^HL70357|E|||internal: no MPI hit"
                 "|Patient not found"), "Patient not found (at PID-3)"),
            (ack("MSA|AE|MSG1", "ERR||PID^1^3^1^2|102^Data type error^HL70357|E|||bad date"),
             "bad date (at PID-3.2)"),
            # Only coded errors: "code text" of ERR-3 (table 0357).
            (ack("MSA|AR|MSG1|", "ERR|||200^Unsupported message type^HL70357|E"),
             "200 Unsupported message type"),
            # ERR-5, the application's own error code, comes before ERR-3.
            (ack("MSA|AE|MSG1", "ERR|||207^Application internal error^HL70357|E|E042^MPI offline^L"),
             "E042 MPI offline; 207 Application internal error"),
            # v2.1-2.4: ERR-1 is segment^sequence^field^code&text&system, MSA-6 a CE.
            (ack("MSA|AE|MSG1||||102^Data type error", "ERR|PID^1^7^102&Data type error&HL70357",
                 msh=MSH23), "102 Data type error (at PID-7)"),
            # Several ERR segments, MSA-3 with them: each text once, in order.
            (ack("MSA|AE|MSG1|two problems", "ERR||PID^1^3||E||||MRN unknown",
                 "ERR||PV1^1^3||E||||ward closed", "ERR||PV1^1^3||E||||ward closed"),
             "two problems; MRN unknown (at PID-3); ward closed (at PV1-3)"),
        ],
    )
    def test_reason(self, text: str, reason: str) -> None:
        """Texts written for people first (MSA-3, ERR-8, ERR-7); the coded errors only without any."""
        assert server_reason(text) == reason

    @pytest.mark.parametrize("text", [None, "", "not an ack", ack("MSA|AA|MSG1"), ack("MSA|AE|MSG1|"),
                                      "MSA|AE", ack("ERR")])
    def test_none_without_a_reason(self, text: str | None) -> None:
        """No ACK, no MSA/ERR text, or nothing in them: None, never an empty string."""
        assert server_reason(text) is None

    def test_segment_ends_and_framing(self) -> None:
        """\\r, \\n and \\r\\n all end segments; MLLP block bytes around the ACK are ignored."""
        for end in ("\r", "\n", "\r\n"):
            text = ack("MSA|AE|MSG1|no such ward", end=end)
            assert server_reason(text) == "no such ward"
            assert server_reason("\x0b" + text + "\x1c\r") == "no such ward"


class TestText:
    def test_hl7_escapes_undone(self) -> None:
        """\\F\\ \\S\\ \\T\\ \\R\\ \\E\\ \\Xhh\\ and \\.br\\ become what they stand for (HL7 2.5 ch. 2.7)."""
        text = ack("MSA|AE|MSG1|a\\F\\b \\S\\ c\\T\\d \\R\\ e\\E\\f \\X41\\\\.br\\g")
        assert server_reason(text) == "a|b ^ c&d ~ e\\f A g"

    def test_the_senders_delimiters(self) -> None:
        """A server writing with other delimiters (MSH-1/MSH-2) is read with those."""
        text = "MSH#@!$%#EHR#C#LAB#N#2026##ACK#X#P#2.5.1\rMSA#AE#MSG1#a $F$ b\rERR##PID@1@3\r"
        assert server_reason(text) == "a # b"

    def test_control_characters_and_spaces(self) -> None:
        """Escape sequences and other controls never reach a terminal, a log or a table: one line."""
        text = ack("MSA|AE|MSG1|evil\x1b[2J text\x07  with\tspaces")
        assert server_reason(text) == "evil [2J text with spaces"

    def test_bounded(self) -> None:
        """A huge text is cut to SERVER_REASON_MAX characters, ending in an ellipsis."""
        reason = server_reason(ack("MSA|AE|MSG1|" + "x" * 5000))
        assert reason is not None and len(reason) == SERVER_REASON_MAX and reason.endswith("…")

    def test_an_ack_we_build_reads_back(self) -> None:
        """Our own AE (build_ack) reads back as its MSA-3 text."""
        inbound = read_msh(b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|M1|P|2.5.1\r")
        built = build_ack(inbound, AckCode.AE, text="no | such & patient", error_code=204).decode()
        assert server_reason(built) == "no | such & patient"
        relayed = app_ack_from_status(inbound, 500, "ascii", text="not delivered: set aside").decode()
        assert server_reason(relayed) == "not delivered: set aside"

    @given(st.text(max_size=300))
    def test_never_raises(self, text: str) -> None:
        """Whatever the server sent, the answer is None or one bounded line."""
        for candidate in (text, ack("MSA|AE|M|" + text), ack("MSA|AE|M", "ERR|" + text)):
            reason = server_reason(candidate)
            assert reason is None or (0 < len(reason) <= SERVER_REASON_MAX and reason.isprintable())
