"""ACK building and reading (docs/acks.md#how-an-ack-is-built; HL7 tables 0008, 0155, 0357)."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import hl7
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from intakefuzz import CHARSET_VALUES, CORPUS, mutate

from agent.core.acks import (
    TABLE_0357,
    AckCode,
    Outcome,
    ack_code,
    app_ack_from_status,
    application_ack_wanted,
    build_ack,
    commit_ack_wanted,
    read_ack_code,
    relayed_ack,
    server_reason,
)
from agent.core.charsets import TEXT_CODECS
from agent.core.envelope import Envelope, MalformedMsh, read_msh, scrape_control_id
from agent.errors import EnvelopeError

Sample = Callable[[str], bytes]
NOW = datetime(2024, 1, 15, 8, 30, 5, 123456, tzinfo=timezone(timedelta(hours=1)))


def env(msh: str) -> Envelope:
    """Read an envelope from an MSH line written as text."""
    return read_msh(msh.encode("latin-1") + b"\r")


def segments(ack: bytes, codec: str = "ascii") -> list[list[str]]:
    """Split an ACK into segments and fields on its own field separator."""
    text = ack.decode(codec)
    assert text.endswith("\r")
    sep = text[3]
    return [seg.split(sep) for seg in text[:-1].split("\r")]


V25 = "MSH|^~\\&|SENDAPP|SENDFAC|RECVAPP|RECVFAC|20240115||ADT^A01^ADT_A01|CTRL1|P|2.5"
V23 = "MSH|^~\\&|SENDAPP|SENDFAC|RECVAPP|RECVFAC|20240115||ADT^A01|CTRL1|T|2.3.1"


class TestAckCodeTable:
    @pytest.mark.parametrize(
        ("outcome", "original", "enhanced"),
        [
            (Outcome.COMMITTED, AckCode.AA, AckCode.CA),
            (Outcome.RESEND_LATER, AckCode.AR, AckCode.CE),
            (Outcome.UNSUPPORTED, AckCode.AR, AckCode.CR),
            (Outcome.DUPLICATE_KEY, AckCode.AE, AckCode.CE),
            (Outcome.MALFORMED, AckCode.AE, AckCode.CE),
            (Outcome.TOO_LARGE, AckCode.AE, AckCode.CE),
        ],
    )
    def test_spec_table(self, outcome: Outcome, original: AckCode, enhanced: AckCode) -> None:
        """Each row of docs/acks.md#which-ack-for-which-situation maps to its original-mode and enhanced-mode code."""
        assert ack_code(outcome, enhanced=False) is original
        assert ack_code(outcome, enhanced=True) is enhanced

    def test_every_outcome_covered(self) -> None:
        """No outcome is missing from the table."""
        for outcome in Outcome:
            ack_code(outcome, enhanced=False)
            ack_code(outcome, enhanced=True)

    def test_ack_code_is_str(self) -> None:
        """AckCode values are the literal MSA-1 strings."""
        assert str(AckCode.CA) == "CA"
        assert AckCode.AE == "AE"


class TestBuildAckMsh:
    def test_accept_ack_fields(self) -> None:
        """An AA swaps MSH-3/4 with 5/6, copies 11/12, echoes MSH-10 in MSA-2, has no ERR."""
        ack = build_ack(env(V25), AckCode.AA, now=NOW, control_id="ACK1")
        msh, msa = segments(ack)
        assert msh[:6] == ["MSH", "^~\\&", "RECVAPP", "RECVFAC", "SENDAPP", "SENDFAC"]
        assert msh[6] == "20240115083005.1234+0100"
        assert msh[8] == "ACK^A01^ACK"
        assert msh[9] == "ACK1"
        assert msh[10:12] == ["P", "2.5"]
        assert msa == ["MSA", "AA", "CTRL1", ""]

    def test_processing_and_version_copied(self) -> None:
        """MSH-11 T and MSH-12 2.3.1 are copied verbatim, never a hard-coded P."""
        msh = segments(build_ack(env(V23), AckCode.AA, now=NOW))[0]
        assert msh[10:12] == ["T", "2.3.1"]

    def test_components_copied_verbatim(self) -> None:
        """MSH-11/12 with components and MSH-3 with components are copied whole."""
        inbound = env("MSH|^~\\&|APP^1.2.3^ISO|FAC|R|RF|T||ORU^R01|9|P^T|2.5^DEU")
        msh = segments(build_ack(inbound, AckCode.AA, now=NOW))[0]
        assert msh[4] == "APP^1.2.3^ISO"
        assert msh[10:12] == ["P^T", "2.5^DEU"]

    def test_new_control_id_unique_and_short(self) -> None:
        """Each ACK gets a new MSH-10 of at most 20 characters."""
        ids = {segments(build_ack(env(V25), AckCode.AA))[0][9] for _ in range(200)}
        assert len(ids) == 200
        assert all(0 < len(i) <= 20 for i in ids)
        assert "CTRL1" not in ids
        assert len({i[:10] for i in ids}) == 1  # one random prefix per process, then a counter

    def test_timestamp_has_zone(self) -> None:
        """MSH-7 defaults to now with a +/-ZZZZ time zone."""
        ts = segments(build_ack(env(V25), AckCode.AA))[0][6]
        assert len(ts) == len("20240115083005.1234+0100")
        assert ts[-5] in "+-"
        assert ts[14] == "."

    def test_timestamp_of_now_is_the_clock_in_local_time(self) -> None:
        """MSH-7 of "now" (formatted once per second, cached) is the wall clock, in its zone."""
        for _ in range(50):
            before = datetime.now().astimezone()
            ts = segments(build_ack(env(V25), AckCode.AA))[0][6]
            after = datetime.now().astimezone()
            assert f"{before:%Y%m%d%H%M%S}" <= ts[:14] <= f"{after:%Y%m%d%H%M%S}"
            assert ts[14] == "." and ts[15:19].isdigit()
            assert ts[19:] == f"{after:%z}"
            if ts[:14] == f"{before:%Y%m%d%H%M%S}":
                assert int(ts[15:19]) >= before.microsecond // 100 - 1

    def test_naive_now_is_local(self) -> None:
        """A naive datetime is taken as local time and still gets a zone."""
        ts = segments(build_ack(env(V25), AckCode.AA, now=datetime(2024, 1, 15, 8, 30)))[0][6]
        assert ts.startswith("20240115083000.0000")
        assert ts[-5] in "+-"

    def test_no_trigger(self) -> None:
        """MSH-9 is plain ACK when the inbound has no trigger event."""
        inbound = env("MSH|^~\\&|A|B|C|D|||QRY|5|P|2.5")
        assert segments(build_ack(inbound, AckCode.AA))[0][8] == "ACK"

    def test_pre_231_msh9_follows_the_spec_too(self) -> None:
        """MSH-9 is ACK^<trigger>^ACK for every version, v2.3 included."""
        inbound = env("MSH|^~\\&|A|B|C|D|||ADT^A01|5|P|2.3")
        assert segments(build_ack(inbound, AckCode.AA))[0][8] == "ACK^A01^ACK"

    def test_custom_separators(self, hl7_sample: Sample) -> None:
        """The sender's MSH#$*@! delimiters are used throughout the ACK, also in ERR."""
        inbound = read_msh(hl7_sample("custom_seps.hl7"))
        ack = build_ack(inbound, AckCode.AE, text="bad#field", error_code=102, now=NOW)
        text = ack.decode("ascii")
        assert text.startswith("MSH#$*@!#HL7AGENT#CENTRAL#ACME#EAST#")
        msh, msa, err = segments(ack)
        assert msh[8] == "ACK$A03$ACK"
        assert msa == ["MSA", "AE", "CS-9", "bad@F@field"]
        assert err == ["ERR", "", "", "102$Data type error$HL70357", "E"]

    def test_msh18_copied(self, hl7_sample: Sample) -> None:
        """MSH-18 of the inbound is copied into the ACK's MSH-18."""
        inbound = read_msh(hl7_sample("adt_a01_8859_1.hl7"))
        msh = segments(build_ack(inbound, AckCode.AA, codec="iso8859-1"), "iso8859-1")[0]
        assert len(msh) == 18
        assert msh[17] == "8859/1"

    def test_no_msh18_when_unset(self) -> None:
        """An inbound without MSH-18 gets an ACK MSH ending at MSH-12."""
        assert len(segments(build_ack(env(V25), AckCode.AA))[0]) == 12

    def test_missing_version_defaults_and_empty_processing_id_stays_empty(self) -> None:
        """A partial envelope without MSH-11/12: MSH-12 2.5 (a reader needs one), MSH-11 never a made-up P."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|42\r")
        partial = info.value.partial
        assert partial is not None
        ack = build_ack(partial, AckCode.AE, text=info.value.text, error_code=101)
        msh, msa, err = segments(ack)
        assert msh[10:12] == ["", "2.5"]
        assert msa[:3] == ["MSA", "AE", "42"]
        assert err[3] == "101^Required field missing^HL70357"

    def test_utf8_fields_round_trip(self, hl7_sample: Sample) -> None:
        """A non-ASCII MSH-4 read as bytes comes back byte for byte in the UTF-8 ACK's MSH-6."""
        inbound = read_msh(hl7_sample("adt_a01_utf8.hl7"))
        ack = build_ack(inbound, AckCode.CA, codec="utf-8", text="Reçu")
        msh, msa = segments(ack, "utf-8")
        assert msh[5] == "H\u00d4PITAL"
        assert msa[3] == "Reçu"

    def test_unencodable_text_replaced(self) -> None:
        """Text the codec cannot encode is replaced, never raising."""
        ack = build_ack(env(V25), AckCode.AE, text="\u5f20 failed", codec="ascii")
        assert segments(ack)[1][3] == "? failed"

    def test_bad_codec_falls_back_to_ascii(self) -> None:
        """An unusable codec name still yields an ACK (ASCII)."""
        for codec in ("no-such-codec", "utf-16"):
            ack = build_ack(env(V25), AckCode.AA, codec=codec)
            assert ack.startswith(b"MSH|^~\\&|")


class TestBuildAckErr:
    def test_accepts_have_no_err(self) -> None:
        """AA and CA carry no ERR segment."""
        for code in (AckCode.AA, AckCode.CA):
            assert [s[0] for s in segments(build_ack(env(V25), code))] == ["MSH", "MSA"]

    @pytest.mark.parametrize("code", [AckCode.AE, AckCode.AR, AckCode.CE, AckCode.CR])
    def test_every_non_accept_has_err(self, code: AckCode) -> None:
        """Every non-accept carries an ERR segment (207 when no code is given)."""
        segs = segments(build_ack(env(V25), code, text="no"))
        assert [s[0] for s in segs] == ["MSH", "MSA", "ERR"]
        assert segs[2][3] == "207^Application internal error^HL70357"

    @pytest.mark.parametrize("version", ["2.5", "2.5.1", "2.6", "2.8"])
    def test_v25_plus_err3_err4(self, version: str) -> None:
        """From v2.5 the code goes in ERR-3 with table 0357 text and ERR-4 is the severity."""
        inbound = env(V25.replace("|2.5", f"|{version}"))
        msh, msa, err = segments(build_ack(inbound, AckCode.AE, text="dup", error_code=205))
        assert msh[11] == version
        assert msa == ["MSA", "AE", "CTRL1", "dup"]
        assert err == ["ERR", "", "", "205^Duplicate key identifier^HL70357", "E"]

    @pytest.mark.parametrize("version", ["2.1", "2.2", "2.3", "2.3.1", "2.4"])
    def test_pre_v25_err1_and_msa6(self, version: str) -> None:
        """Before v2.5 the code goes in ERR-1 (as subcomponents) and MSA-6."""
        inbound = env(V25.replace("|2.5", f"|{version}"))
        _msh, msa, err = segments(build_ack(inbound, AckCode.AR, text="later", error_code=207))
        assert msa == [
            "MSA",
            "AR",
            "CTRL1",
            "later",
            "",
            "",
            "207^Application internal error^HL70357",
        ]
        assert err == ["ERR", "^^^207&Application internal error&HL70357"]

    def test_severity(self) -> None:
        """ERR-4 takes the given severity."""
        err = segments(build_ack(env(V25), AckCode.CE, error_code=207, severity="W"))[2]
        assert err[4] == "W"

    def test_text_escaped(self) -> None:
        """Delimiters in MSA-3 are escaped with the sender's escape sequences; CR/LF removed."""
        ack = build_ack(env(V25), AckCode.AE, text="a|b^c~d\\e&f\rg", error_code=102)
        assert segments(ack)[1][3] == "a\\F\\b\\S\\c\\R\\d\\E\\e\\T\\f g"

    def test_all_0357_codes_have_text(self) -> None:
        """Table 0357 covers the codes docs/acks.md#error-codes uses."""
        for code in (0, 100, 101, 102, 103, 200, 201, 202, 203, 204, 205, 206, 207):
            assert TABLE_0357[code]


class TestMinimalReject:
    def test_no_envelope(self) -> None:
        """A broken MSH gets a minimal reject with default separators and the scraped MSA-2."""
        ack = build_ack(
            None, AckCode.AE, text="MSH-2 unusable", error_code=102, inbound_control_id="X9"
        )
        msh, msa, err = segments(ack)
        assert msh[:6] == ["MSH", "^~\\&", "", "", "", ""]
        assert msh[8] == "ACK"
        assert msh[10:12] == ["", "2.5"]  # nothing could be read: no made-up P
        assert msa == ["MSA", "AE", "X9", "MSH-2 unusable"]
        assert err == ["ERR", "", "", "102^Data type error^HL70357", "E"]

    def test_unusable_encoding_characters_still_copy_what_the_field_separator_reads(self) -> None:
        """MSH-2 unusable, MSH-1 fine: the reject (default delimiters) swaps MSH-3..6, copies MSH-11/12."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(b"MSH|A~\\&|LAB|NORTH|EHR|CENTRAL|20260301||ADT^A01|BAD2|T|2.3\r")
        partial = info.value.partial
        assert partial is not None and info.value.error_code == 102
        ack = build_ack(partial, AckCode.AE, text=info.value.text, error_code=102)
        msh, msa, err = segments(ack)
        assert msh[:6] == ["MSH", "^~\\&", "EHR", "CENTRAL", "LAB", "NORTH"]
        assert msh[8] == "ACK^A01^ACK"
        assert msh[10:12] == ["T", "2.3"]
        assert msa[:3] == ["MSA", "AE", "BAD2"]
        # Before v2.5 the code goes in ERR-1 (docs/acks.md).
        assert err[1] == "^^^102&Data type error&HL70357"

    def test_scraped_fields_cannot_break_the_reject(self) -> None:
        """Another field separator: a "|" or "\\" in a field read with it is dropped, not copied."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(b"MSH#A~\\&#L|A\\B#F#R#RF#20260301##ADT^A01#C|1#P#2.5\r")
        partial = info.value.partial
        assert partial is not None
        msh = segments(build_ack(partial, AckCode.AE, text=info.value.text, error_code=102))[0]
        assert msh[:6] == ["MSH", "^~\\&", "R", "RF", "LAB", "F"]
        assert msh[10:12] == ["P", "2.5"]

    def test_msa2_empty_without_control_id(self) -> None:
        """MSA-2 is empty when the control id could not be read."""
        msa = segments(build_ack(None, AckCode.AE, error_code=101))[1]
        assert msa[2] == ""

    def test_minimal_reject_parses(self) -> None:
        """The minimal reject re-parses with hl7.parse."""
        ack = build_ack(None, AckCode.AE, error_code=101)
        message = hl7.parse(ack.decode("ascii"))
        assert str(message.segment("MSA")[1]) == "AE"


class TestReparse:
    def test_ack_reparses_with_hl7(self) -> None:
        """The ACK decodes and re-parses with hl7.parse; MSA and ERR fields are where expected."""
        ack = build_ack(env(V25), AckCode.CE, text="later", error_code=207, codec="utf-8")
        message = hl7.parse(ack.decode("utf-8"))
        assert str(message.segment("MSH")[9]) == "ACK^A01^ACK"
        assert message["MSA.F1"] == "CE"
        assert message["MSA.F2"] == "CTRL1"
        assert message["ERR.F3.R1.C1"] == "207"
        assert message["ERR.F4"] == "E"

    def test_lf_inbound(self, hl7_sample: Sample) -> None:
        """An inbound with \\n endings gets a \\r-ended ACK with MSA-2 from its MSH-10."""
        inbound = read_msh(hl7_sample("oru_r01_v251_lf.hl7"))
        ack = build_ack(inbound, AckCode.CA, codec="utf-8")
        assert b"\n" not in ack
        message = hl7.parse(ack.decode("utf-8"))
        assert message["MSA.F2"] == "LAB-778899"
        assert read_ack_code(ack) == "CA"

    def test_v23_ack_reparses(self, hl7_sample: Sample) -> None:
        """A v2.3 reject re-parses with its MSA-6."""
        inbound = read_msh(hl7_sample("adt_a01_v23_cr.hl7"))
        ack = build_ack(inbound, AckCode.AE, error_code=101, text="x")
        message = hl7.parse(ack.decode("ascii"))
        assert message["MSA.F6.R1.C1"] == "101"
        assert str(message.segment("MSH")[9]) == "ACK^A01^ACK"


class TestAckWanted:
    @pytest.mark.parametrize(
        ("value", "on_success", "on_error"),
        [
            ("AL", True, True),
            ("NE", False, False),
            ("ER", False, True),
            ("SU", True, False),
            ("", True, True),
            ("XX", True, True),
            ("al", True, True),
        ],
    )
    def test_table_0155(self, value: str, on_success: bool, on_error: bool) -> None:
        """MSH-15 and MSH-16 follow table 0155: AL, NE, ER, SU; empty/unknown always."""
        inbound = env(V25 + f"|||{value}|{value}")
        assert commit_ack_wanted(inbound, success=True) is on_success
        assert commit_ack_wanted(inbound, success=False) is on_error
        assert application_ack_wanted(inbound, success=True) is on_success
        assert application_ack_wanted(inbound, success=False) is on_error

    def test_fields_are_independent(self) -> None:
        """MSH-15 decides the commit ACK, MSH-16 the application ACK."""
        inbound = env(V25 + "|||NE|AL")
        assert not commit_ack_wanted(inbound, success=True)
        assert application_ack_wanted(inbound, success=True)


class TestAppAckFromStatus:
    @pytest.mark.parametrize("status", [200, 201, 299])
    def test_2xx_is_aa(self, status: int) -> None:
        """A 2xx answer without ack becomes AA, no ERR."""
        ack = app_ack_from_status(env(V25), status, "ascii", now=NOW)
        assert [s[0] for s in segments(ack)] == ["MSH", "MSA"]
        assert read_ack_code(ack) == "AA"

    @pytest.mark.parametrize("status", [400, 422, 500])
    def test_failure_is_ae_207(self, status: int) -> None:
        """A rejected/failed answer becomes AE with ERR-3 207."""
        segs = segments(app_ack_from_status(env(V25), status, "ascii"))
        assert segs[1][1] == "AE"
        assert segs[2][3] == "207^Application internal error^HL70357"

    def test_enhanced_sender_gets_application_codes(self) -> None:
        """Enhanced-mode senders get AA/AE for application ACKs, not CA/CE."""
        inbound = env(V25 + "|||AL|AL")
        assert read_ack_code(app_ack_from_status(inbound, 200, "ascii")) == "AA"
        assert read_ack_code(app_ack_from_status(inbound, 400, "ascii")) == "AE"


class TestReadAckCode:
    def test_plain(self) -> None:
        """MSA-1 of a \\r-ended ACK."""
        assert read_ack_code(b"MSH|^~\\&|A|B|C|D|||ACK|1|P|2.5\rMSA|AA|X\r") == "AA"

    def test_framed_and_lf(self) -> None:
        """MLLP framing and \\n endings are tolerated."""
        assert read_ack_code(b"\x0bMSH|^~\\&|A\nMSA|ce|X\n\x1c\r") == "CE"

    def test_custom_separator(self) -> None:
        """The MSA's own field separator is used."""
        assert read_ack_code(b"MSH#$*@!#A\rMSA#AR#X\r") == "AR"

    def test_no_msa(self) -> None:
        """No MSA segment gives None."""
        assert read_ack_code(b"MSH|^~\\&|A\rERR|x\r") is None
        assert read_ack_code(b"") is None

    def test_empty_msa1(self) -> None:
        """An MSA with no MSA-1 gives an empty string."""
        assert read_ack_code(b"MSH|^~\\&|A\rMSA\r") == ""
        assert read_ack_code(b"MSH|^~\\&|A\rMSA||X\r") == ""


class TestCopiedNeverInvented:
    def test_empty_msh11_stays_empty(self) -> None:
        """An empty inbound MSH-11 is copied as empty, never replaced by a hard-coded P."""
        inbound = read_msh(b"MSH|^~\\&|A|B|C|D|20260101||ADT^A01|X1||2.5.1\r")
        msh = segments(build_ack(inbound, AckCode.AA))[0]
        assert msh[10] == ""
        assert msh[11] == "2.5.1"


class TestFramingBytesNeverInAnAck:
    """A 0x1C (or 0x0B, CR, LF) copied from the inbound MSH would end or restart the ACK's frame at the sender."""

    @staticmethod
    def assert_clean(ack: bytes) -> None:
        assert b"\x0b" not in ack and b"\x1c" not in ack
        assert ack.endswith(b"\r") and b"\n" not in ack

    def test_fs_at_the_end_of_msh12_is_hex_escaped(self) -> None:
        """MSH-12 ``2.5.1<FS>`` (payload: LF, not CR, after it) comes back as ``2.5.1\\X1C\\``; the ACK keeps its MSA."""
        inbound = read_msh(b"MSH|^~\\&|A|B|C|D|20260101||ADT^A01|X1|P|2.5.1\x1c\nPID|1\n")
        ack = build_ack(inbound, AckCode.AA, now=NOW)
        self.assert_clean(ack)
        msh, msa = segments(ack)
        assert msh[11] == "2.5.1\\X1C\\"
        assert msa[:3] == ["MSA", "AA", "X1"]

    def test_every_copied_field_is_escaped_in_the_senders_escape_character(self) -> None:
        """MSH-3..6, MSH-9.2, MSH-10 (MSA-2), MSH-11, MSH-12 and MSH-18 use the sender's own escape (here ``@``)."""
        inbound = read_msh(
            b"MSH#$*@!#A\x1cPP#F\x0bAC#R\x1cA#R\x1cF#20260101##ADT$A\x1c01#C\x1cID#P\x1c#2.5.1######"
            b"8859\x1c/1\r"
        )
        ack = build_ack(inbound, AckCode.AE, text="bad\x1ctext\x0b", error_code=102, codec="iso8859-1")
        self.assert_clean(ack)
        msh, msa, _err = segments(ack, "iso8859-1")
        assert msh[2:6] == ["R@X1C@A", "R@X1C@F", "A@X1C@PP", "F@X0B@AC"]
        assert msh[8] == "ACK$A@X1C@01$ACK"
        assert msh[10] == "P@X1C@"
        assert msh[17] == "8859@X1C@/1"
        assert msa[1:4] == ["AE", "C@X1C@ID", "bad@X1C@text@X0B@"]

    def test_reject_acks_too(self) -> None:
        """A malformed MSH's partial envelope and a scraped MSA-2 are escaped the same way."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(b"MSH|^~\\&|A\x1c|B|C|D|20260101||ADT^A01|X\x1c1|P|\r")
        ack = build_ack(info.value.partial, AckCode.AE, error_code=101)
        self.assert_clean(ack)
        assert segments(ack)[0][4] == "A\\X1C\\"
        minimal = build_ack(None, AckCode.AE, error_code=102, inbound_control_id="X\x1c\x0b\r\n9")
        self.assert_clean(minimal)
        assert segments(minimal)[1][2] == "X\\X1C\\\\X0B\\\\X0D\\\\X0A\\9"

    def test_hand_built_envelope_with_framing_separators_falls_back_to_the_defaults(self) -> None:
        """Separators read_msh would refuse (an Envelope built by hand) never put a 0x1C into the ACK."""
        inbound = Envelope(
            field_sep="\x1c", encoding_chars="^~\\&", sending_app="A", sending_facility="B",
            receiving_app="C", receiving_facility="D", message_type="ADT^A01", message_code="ADT",
            trigger_event="A01", control_id="X1", processing_id="P", version_id="2.5", sequence_number="",
            accept_ack_type="", application_ack_type="", charset="",
        )
        ack = build_ack(inbound, AckCode.AA)
        self.assert_clean(ack)
        assert ack.startswith(b"MSH|^~\\&|")

    @pytest.mark.parametrize("codec", ["idna", "rot13", "utf-16", "utf-7", "cp500", "a\x00b", "no-such"])
    def test_a_codec_that_is_no_character_set_gives_an_ascii_ack(self, codec: str) -> None:
        """A row stored by an older version may name any Python codec: the ACK goes out in ASCII instead of raising."""
        inbound = read_msh(b"MSH|^~\\&|A|B|C|D|20260101||ADT^A01|X1|P|2.5.1\r")
        ack = build_ack(inbound, AckCode.AE, text="t\u00e9xt", error_code=207, codec=codec)
        self.assert_clean(ack)
        assert segments(ack)[1][:4] == ["MSA", "AE", "X1", "t?xt"]


class TestRelayedAck:
    def test_block_bytes_dropped_and_line_ends_normalised(self) -> None:
        """The server's ACK text with LF endings, a VT and an FS CR inside becomes one clean CR-ended ACK."""
        text = "MSH|^~\\&|S|F|R|F|20260101||ACK|1|P|2.5\nMSA|AA|X1|o\x1c\rk\x0b\r\n"
        assert relayed_ack(text, "utf-8") == b"MSH|^~\\&|S|F|R|F|20260101||ACK|1|P|2.5\rMSA|AA|X1|o\rk\r"

    @pytest.mark.parametrize("codec", ["idna", "punycode", "utf-16", "rot13", "a\x00b", "8859/1", "latin-1"])
    def test_never_raises_whatever_the_stored_codec(self, codec: str) -> None:
        """``idna`` used to raise UnicodeError here and end the dispatcher; now any codec name gives bytes."""
        text = "MSH|^~\\&|S|F|R|F|20260101||ACK|1|P|2.5.1\rMSA|AA|" + "X" * 80 + "|\u00e9\ud800\r"
        ack = relayed_ack(text, codec)
        assert ack.startswith(b"MSH|^~\\&|S|F|R|F|20260101||ACK|1|P|2.5.1\rMSA|AA|XXXX")
        assert ack.endswith(b"\xe9?\r" if codec in ("8859/1", "latin-1") else b"??\r")


# -- properties (hypothesis) ---------------------------------------------------

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
MUTATED = st.builds(
    lambda seed, index, steps: mutate(random.Random(seed), CORPUS[index % len(CORPUS)], steps),
    st.integers(0, 2**32 - 1), st.integers(0, len(CORPUS) - 1), st.integers(0, 8),
)


def inbound_of(payload: bytes) -> Envelope | None:
    try:
        return read_msh(payload)
    except MalformedMsh as exc:
        return exc.partial
    except EnvelopeError:
        return None


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (b"MSH|^~\\&|A|B|C|D|x||ADT^A01|1|P|2.5", "20260501083000.1234+0200"),
        (b"MSH.^~\\&.A.B.C.D.x..ADT^A01.1.P.2.5", "20260501083000+0200"),  # no fraction
        (b"MSH+^~\\&+A+B+C+D+x++ADT^A01+1+P+2.5", "20260501083000.1234"),  # no zone
    ],
)
def test_msh7_never_contains_a_delimiter(header: bytes, expected: str) -> None:
    """DTM's fraction and zone are optional: left out when their punctuation is a delimiter."""
    now = datetime(2026, 5, 1, 8, 30, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    ack = build_ack(read_msh(header + b"\r"), AckCode.AA, now=now)
    sep = chr(header[3])
    assert ack.split(b"\r")[0].decode().split(sep)[6] == expected
    assert read_msh(ack).message_code == "ACK"


class TestAckProperties:
    @PROPERTY
    @given(
        st.one_of(MUTATED, st.binary(max_size=300).map(lambda b: b"MSH" + b)),
        st.sampled_from(list(AckCode)),
        st.text(max_size=60),
        st.one_of(st.sampled_from(CHARSET_VALUES), st.sampled_from(sorted(TEXT_CODECS))),
        st.integers(0, 999),
    )
    # Found by this test in CI: "." as the field separator met MSH-7's decimal point.
    @example(payload=b"MSH.!", code=AckCode.AA, text="", codec="", error_code=0)
    @example(payload=b"MSH+^~\\&", code=AckCode.AA, text="", codec="", error_code=0)
    # Found by this test: MSH-12 "^^^" (components, but no version) was copied, and the ACK did not read back.
    @example(payload=b"MSH|^~\\&|SAP|KLINIKUM|HL7AGENT|CENTRAL|20240115110000||ADT^A01^ADT_A01|DE-4711|P|^^^\r",
             code=AckCode.AA, text="", codec="", error_code=0)
    def test_any_inbound_gives_one_clean_readable_ack(
        self, payload: bytes, code: AckCode, text: str, codec: str, error_code: int
    ) -> None:
        """Whatever the inbound MSH, text, codec name or error code: an ACK with the code, no block byte, CR-ended segments."""
        inbound = inbound_of(payload)
        ack = build_ack(inbound, code, text=text, error_code=error_code, codec=codec,
                        inbound_control_id=scrape_control_id(payload))
        assert b"\x0b" not in ack and b"\x1c" not in ack and b"\n" not in ack
        assert ack.startswith(b"MSH") and ack.endswith(b"\r")
        assert read_ack_code(ack) == str(code)
        # The ACK's own MSH reads back: the sender can parse what it gets.
        reread = read_msh(ack)
        assert reread.is_ack
        assert reread.field_sep == (inbound.field_sep if inbound is not None else "|")

    @PROPERTY
    @given(st.text(max_size=200), st.one_of(st.sampled_from(CHARSET_VALUES), st.text(max_size=12)))
    def test_relayed_ack_never_raises_and_is_frame_safe(self, text: str, codec: str) -> None:
        """Any server ACK text in any stored codec name: bytes without block bytes, never an exception."""
        ack = relayed_ack(text, codec)
        assert b"\x0b" not in ack and b"\x1c" not in ack and b"\n" not in ack


class TestServerReason:
    """The server's reason in words, read from its ACK text (HL7 2.5 ch. 2.14.5 ERR, 2.14.8 MSA)."""

    def test_msa3_and_err3_of_a_v25_reject(self) -> None:
        """MSA-3, written for people, stands alone: the coded errors only stand in for missing text."""
        ack = build_ack(env(V25), AckCode.AE, text="unknown patient identifier in PID-3",
                        error_code=204).decode()
        assert server_reason(ack) == "unknown patient identifier in PID-3"
        coded_only = build_ack(env(V25), AckCode.AE, error_code=204).decode()
        assert server_reason(coded_only) == "204 Unknown key identifier"

    def test_before_v25_the_code_is_in_err1(self) -> None:
        """v2.1-2.4 put the code in ERR-1's fourth component, as subcomponents; MSA-3 is unescaped."""
        v23 = V25.replace("|2.5", "|2.3")
        ack = build_ack(env(v23), AckCode.AE, text="bad|field", error_code=207).decode()
        assert server_reason(ack) == "bad|field"
        coded_only = build_ack(env(v23), AckCode.AE, error_code=207).decode()
        assert server_reason(coded_only) == "207 Application internal error"

    def test_user_message_and_diagnostics_in_the_senders_delimiters(self) -> None:
        """ERR-8's first text with ERR-2's location, in the sender's delimiters (MSH-1/2)."""
        ack = ("MSH#$*@!#EHR#C##L#N#20240101##ACK$A01$ACK#1#P#2.5.1\r"
               "MSA#AE#C1\r"
               "ERR##PID$1$3#204$Unknown key identifier$HL70357#E#E42$Patient not found#"
               "##Patient 123@F@4 is unknown*second line#\r")
        assert server_reason(ack) == "Patient 123#4 is unknown (at PID-3)"

    def test_escapes_and_formatting(self) -> None:
        """Hex escapes become their bytes, .br a space, highlighting and charset escapes go."""
        ack = "MSH|^~\\&|||||||ACK|1|P|2.5\rMSA|AE|C1|\\X41\\bc\\.br\\d\\H\\e\\N\\ \\C2842\\f\rERR||||E\r"
        assert server_reason(ack) == "Abc de f"

    def test_an_accept_without_text_has_no_reason(self) -> None:
        """AA with an empty MSA-3 and no ERR: None, not an empty string."""
        assert server_reason(build_ack(env(V25), AckCode.AA).decode()) is None
        assert server_reason(None) is None and server_reason("") is None

    def test_long_text_is_cut_and_repeats_dropped(self) -> None:
        """A repeated text appears once; the whole stays within the limit, marked as cut."""
        ack = f"MSH|^~\\&|||||||ACK|1|P|2.5\rMSA|AE|C1|{'x' * 500}\rERR|||||||||\rERR|||||||||\n"
        reason = server_reason(ack, limit=40)
        assert reason is not None and len(reason) == 40 and reason.endswith("…")
        again = "MSH|^~\\&|||||||ACK|1|P|2.5\rMSA|AE|C1|same\rERR|||||||same|same\r"
        assert server_reason(again) == "same"

    @given(st.text(max_size=300))
    @settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
    def test_never_raises(self, text: str) -> None:
        """Any text at all gives a string or None (a server's ACK is untrusted input)."""
        reason = server_reason("MSH|^~\\&|||||||ACK|1|P|2.5\rMSA|AE|C1|" + text)
        assert reason is None or (isinstance(reason, str) and "\r" not in reason)
