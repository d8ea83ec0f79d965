"""Reading the MSH envelope on bytes, resolving charsets, decoding and MSH stamping."""

from __future__ import annotations

import encodings.aliases
import random
from collections.abc import Callable

import hl7
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from intakefuzz import CHARSET_VALUES, CORPUS, mutate

from agent.core import charsets, envelope
from agent.core.charsets import decode_message, resolve_codec
from agent.core.envelope import (
    Envelope,
    MalformedMsh,
    NoMshSegment,
    read_msh,
    scrape_control_id,
    set_msh_field,
)
from agent.errors import EnvelopeError, UnsupportedCharset

Sample = Callable[[str], bytes]


class TestReadMshSamples:
    def test_adt_a01_v23_cr(self, hl7_sample: Sample) -> None:
        """A v2.3 ADT^A01 with \\r endings yields every intake field."""
        env = read_msh(hl7_sample("adt_a01_v23_cr.hl7"))
        assert env.field_sep == "|"
        assert env.encoding_chars == "^~\\&"
        assert (env.sending_app, env.sending_facility) == ("EPIC", "NORTHCAMPUS")
        assert (env.receiving_app, env.receiving_facility) == ("HL7AGENT", "CENTRAL")
        assert env.message_type == "ADT^A01"
        assert (env.message_code, env.trigger_event) == ("ADT", "A01")
        assert env.control_id == "MSG00001"
        assert (env.processing_id, env.version_id, env.version) == ("P", "2.3", "2.3")
        assert env.sequence_number == ""
        assert env.charset == ""
        assert not env.enhanced
        assert not env.is_ack

    def test_oru_r01_v251_lf(self, hl7_sample: Sample) -> None:
        """A \\n-ended v2.5.1 ORU^R01 with MSH-15/16 is read and is in enhanced mode."""
        env = read_msh(hl7_sample("oru_r01_v251_lf.hl7"))
        assert env.message_type == "ORU^R01^ORU_R01"
        assert env.trigger_event == "R01"
        assert env.control_id == "LAB-778899"
        assert env.version_id == "2.5.1"
        assert (env.accept_ack_type, env.application_ack_type) == ("AL", "NE")
        assert env.enhanced

    def test_crlf(self, hl7_sample: Sample) -> None:
        """A \\r\\n-ended message: the MSH ends at \\r, no CR leaks into MSH-12."""
        env = read_msh(hl7_sample("adt_a08_crlf.hl7"))
        assert env.version_id == "2.4"
        assert env.processing_id == "T"
        assert env.control_id == "A08-0001"

    def test_8859_1(self, hl7_sample: Sample) -> None:
        """MSH-18 8859/1 is read from the ASCII-safe MSH."""
        env = read_msh(hl7_sample("adt_a01_8859_1.hl7"))
        assert env.charset == "8859/1"
        assert env.sending_facility == "KLINIKUM"

    def test_unicode_utf8(self, hl7_sample: Sample) -> None:
        """MSH-18 UNICODE UTF-8 is read; a non-ASCII MSH-4 survives as latin-1 bytes-as-text."""
        env = read_msh(hl7_sample("adt_a01_utf8.hl7"))
        assert env.charset == "UNICODE UTF-8"
        assert env.sending_facility.encode("latin-1").decode("utf-8") == "H\u00d4PITAL"

    def test_custom_separators(self, hl7_sample: Sample) -> None:
        """MSH#$*@! separators are used for splitting fields and components."""
        env = read_msh(hl7_sample("custom_seps.hl7"))
        assert env.field_sep == "#"
        assert env.encoding_chars == "$*@!"
        assert (env.component_sep, env.repetition_sep) == ("$", "*")
        assert (env.escape_char, env.subcomponent_sep) == ("@", "!")
        assert env.message_type == "ADT$A03$ADT_A03"
        assert (env.message_code, env.trigger_event) == ("ADT", "A03")
        assert env.control_id == "CS-9"
        assert env.version_id == "2.5.1"

    def test_v22_lab_machine_few_fields(self, hl7_sample: Sample) -> None:
        """A v2.2 lab message with empty MSH-4..6 and two-part MSH-9 is accepted."""
        env = read_msh(hl7_sample("lab_v22_short.hl7"))
        assert env.sending_app == "ANALYZER"
        assert env.sending_facility == env.receiving_app == env.receiving_facility == ""
        assert env.message_type == "ORU^R01"
        assert env.control_id == "1"
        assert env.version_id == "2.2"
        assert env.accept_ack_type == env.application_ack_type == ""


class TestReadMshLenient:
    def test_leading_blank_lines(self) -> None:
        """Leading CR/LF/space before MSH are tolerated."""
        env = read_msh(b"\r\n \nMSH|^~\\&|A|B|C|D|||X^Y|1|P|2.5\r")
        assert env.control_id == "1"

    def test_utf8_bom(self) -> None:
        """A UTF-8 byte order mark before MSH is tolerated, not treated as 'no MSH'."""
        env = read_msh(b"\xef\xbb\xbfMSH|^~\\&|A|B|C|D|||X^Y|1|P|2.5\r")
        assert env.message_code == "X"

    def test_only_msh_without_terminator(self) -> None:
        """A message that is only an unterminated MSH is read."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|7|P|2.5")
        assert env.version_id == "2.5"

    def test_trailing_field_seps_and_one_component_type(self) -> None:
        """Trailing separators are harmless; MSH-9 with one component has an empty trigger."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ACK|9|P|2.3||||||\r")
        assert env.trigger_event == ""
        assert env.is_ack

    def test_version_with_components(self) -> None:
        """MSH-12 with VID components keeps the whole field; version is the first component."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P^T|2.5^DEU\r")
        assert env.version_id == "2.5^DEU"
        assert env.version == "2.5"
        assert env.processing_id == "P^T"

    def test_msh18_first_repetition(self) -> None:
        """MSH-18 with repetitions yields the first one."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5||||||UNICODE UTF-8~8859/1\r")
        assert env.charset == "UNICODE UTF-8"

    def test_short_encoding_chars_default(self) -> None:
        """MSH-2 with three characters gets the default subcomponent separator."""
        env = read_msh(b"MSH|^~\\|A|B|C|D|||ADT^A01|1|P|2.3\r")
        assert env.subcomponent_sep == "&"

    def test_truncation_char(self) -> None:
        """A v2.7 MSH-2 of five characters exposes the truncation character."""
        env = read_msh(b"MSH|^~\\&#|A|B|C|D|||ADT^A01^ADT_A01|1|P|2.7\r")
        assert env.truncation_char == "#"
        assert env.component_sep == "^"

    def test_reads_only_the_first_segment(self) -> None:
        """Garbage after the MSH does not matter (the hot path never parses the rest)."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\r\xff\xfe\x00garbage")
        assert env.control_id == "1"


class TestReadMshErrors:
    @pytest.mark.parametrize(
        "data",
        [b"", b"PID|1", b"  \r\n", b"xMSH|^~\\&|", b"\x00MSH|", b"msh|^~\\&|A"],
    )
    def test_no_msh(self, data: bytes) -> None:
        """Input not starting with MSH raises NoMshSegment (dropped with audit, no ACK)."""
        with pytest.raises(NoMshSegment) as info:
            read_msh(data)
        assert isinstance(info.value, EnvelopeError)

    @pytest.mark.parametrize(
        ("data", "code"),
        [
            (b"MSH", 101),
            (b"MSHA^~\\&|A", 102),
            (b"MSH ^~\\&|A", 102),
            (b"MSH||A|B", 101),
            (b"MSH|^^\\&|A|B|C|D|||ADT^A01|1|P|2.5", 102),
            (b"MSH|^~|&|A|B|C|D|||ADT^A01|1|P|2.5", 101),  # MSH-12 then misaligned/missing
            (b"MSH|a~\\&|A|B|C|D|||ADT^A01|1|P|2.5", 102),
            (b"MSH|^~\\&xx|A|B|C|D|||ADT^A01|1|P|2.5", 102),
            # Found by the property tests: a non-ASCII or control byte as a
            # delimiter made a reject ACK whose separator was two bytes in UTF-8.
            (b"MSH\x80\x00", 102),
            (b"MSH\x80^~\\&\x80A\x80B\x80C\x80D\x80\x80\x80ADT^A01\x801\x80P\x802.5", 102),
            (b"MSH|^~\\\xe9|A|B|C|D|||ADT^A01|1|P|2.5", 102),
            (b"MSH|^\x00\\&|A|B|C|D|||ADT^A01|1|P|2.5", 102),
            (b"MSH\x7f^~\\&\x7fA", 102),
        ],
    )
    def test_unusable_separators(self, data: bytes, code: int) -> None:
        """Unusable MSH-1/MSH-2 raise MalformedMsh with 101/102."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(data)
        assert info.value.error_code == code
        assert not isinstance(info.value, NoMshSegment)

    def test_missing_msh9(self) -> None:
        """Missing MSH-9 is 101, with the readable fields kept for the reject ACK."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(b"MSH|^~\\&|A|B|C|D|||||P|2.5\r")
        assert info.value.error_code == 101
        assert "MSH-9" in info.value.text
        assert info.value.partial is not None
        assert info.value.partial.sending_app == "A"

    def test_missing_msh10(self) -> None:
        """Missing MSH-10 is 101."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01||P|2.5\r")
        assert info.value.error_code == 101
        assert "MSH-10" in info.value.text

    def test_missing_msh12(self) -> None:
        """Missing MSH-12 (short MSH) is 101, MSH-10 still readable from partial."""
        with pytest.raises(MalformedMsh) as info:
            read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|42|P\r")
        assert info.value.error_code == 101
        assert "MSH-12" in info.value.text
        assert info.value.partial is not None
        assert info.value.partial.control_id == "42"

    def test_scrape_control_id(self) -> None:
        """scrape_control_id gets MSH-10 from a broken MSH, '' when unreadable."""
        assert scrape_control_id(b"MSH|^~\\&|A|B|C|D|||ADT^A01|42|P\r") == "42"
        assert scrape_control_id(b"MSH|^^\\&|A|B|C|D|||ADT^A01|43|P|2.5\r") == "43"
        assert scrape_control_id(b"MSHA") == ""
        assert scrape_control_id(b"PID|1") == ""
        assert scrape_control_id(b"MSH|^~\\&|A") == ""


class TestResolveCodec:
    @pytest.mark.parametrize(
        ("name", "codec"),
        [
            ("ASCII", "ascii"),
            ("8859/1", "iso8859-1"),
            ("8859/2", "iso8859-2"),
            ("8859/9", "iso8859-9"),
            ("8859/15", "iso8859-15"),
            ("UNICODE UTF-8", "utf-8"),
            ("unicode  utf-8", "utf-8"),
            ("UTF-8", "utf-8"),
            ("ISO IR6", "ascii"),
            ("ISO IR100", "iso8859-1"),
            ("ISO_IR 100", "iso8859-1"),
            ("ISO IR192", "utf-8"),
            ("SJIS", "cp932"),
            ("GB 18030-2000", "gb18030"),
            ("BIG-5", "big5"),
            ("KS X 1001", "euc_kr"),
            ("latin-1", "iso8859-1"),
            ("ISO-8859-1", "iso8859-1"),
            ("l1", "iso8859-1"),
            ("latin9", "iso8859-15"),
            ("utf8", "utf-8"),
            ("US-ASCII", "ascii"),
            ("shift_jis", "shift_jis"),
            ("ms932", "cp932"),
            ("euc-kr", "euc_kr"),
            ("iso-2022-jp", "iso2022_jp"),
        ],
    )
    def test_msh18_names(self, name: str, codec: str) -> None:
        """Table 0211 names and Python names of those same encodings map to a Python codec."""
        assert resolve_codec(name, "utf-8") == codec

    def test_empty_msh18_uses_channel(self) -> None:
        """Without MSH-18 the channel encoding decides, itself a 0211 or Python name."""
        assert resolve_codec("", "8859/1") == "iso8859-1"
        assert resolve_codec("  ", "latin-1") == "iso8859-1"
        assert resolve_codec("", "") == "utf-8"
        assert resolve_codec("", "utf-8") == "utf-8"

    def test_msh18_wins_over_channel(self) -> None:
        """MSH-18, when set, overrides the channel encoding."""
        assert resolve_codec("8859/1", "utf-8") == "iso8859-1"

    @pytest.mark.parametrize(
        "name", ["UNICODE", "UNICODE UTF-16", "UNICODE UTF-32", "utf-16", "UTF-16LE", "utf_32", "u16"]
    )
    def test_wide_encodings_forbidden(self, name: str) -> None:
        """UTF-16/32, by table 0211 or Python name, raise UnsupportedCharset 102: HL7 forbids them with MLLP."""
        with pytest.raises(UnsupportedCharset) as info:
            resolve_codec(name, "utf-8")
        assert info.value.error_code == 102
        with pytest.raises(UnsupportedCharset):
            resolve_codec("", name)

    @pytest.mark.parametrize(
        "name",
        [
            # Python codecs that are transforms, not character sets: each one
            # broke ACK building or decoding when MSH-18 named it.
            "idna", "punycode", "rot13", "rot_13", "base64", "zlib", "uu", "hex", "bz2", "quopri",
            "raw_unicode_escape", "unicode_escape", "undefined", "mbcs", "oem",
            # Not ASCII-compatible, or no table 0211 encoding.
            "utf-7", "cp500", "cp1252", "koi8-r", "mac-roman",
            # Not names at all.
            "NO-SUCH-CHARSET", "KLINGON", "utf-8\x00", "\x00", "a\x00b", "UTF\x1c8", "8859/\x0b1",
            "x" * 100, "../../etc", "ut\u00f6f-8",
        ],
    )
    def test_unknown_names_are_table_value_not_found(self, name: str) -> None:
        """Anything else (transforms, other codecs, NULs, junk) raises UnsupportedCharset 103, never another error."""
        with pytest.raises(UnsupportedCharset) as info:
            resolve_codec(name, "utf-8")
        assert info.value.error_code == 103
        with pytest.raises(UnsupportedCharset):
            resolve_codec("", name)

    def test_error_text_is_bounded_and_escaped(self) -> None:
        """The name in the reject text (MSA-3, logs) is cut short and has no raw control characters."""
        with pytest.raises(UnsupportedCharset) as info:
            resolve_codec("\x1c\x0b\r" + "z" * 10_000, "utf-8")
        assert len(info.value.text) < 100
        assert not set(info.value.text) & {"\x1c", "\x0b", "\r"}

    def test_text_codecs_are_all_ascii_compatible(self) -> None:
        """Every codec intake can ever decode with encodes the MLLP framing and the delimiters as ASCII."""
        structure = "MSH|^~\\&\r\n\x0b\x1c 09AZaz"
        for codec in charsets.TEXT_CODECS:
            assert structure.encode(codec) == structure.encode("ascii"), codec
            assert charsets.text_codec(codec) == codec


class TestDecodeMessage:
    def test_lf_and_crlf_normalised(self) -> None:
        """\\n and \\r\\n segment ends become \\r, with a trailing \\r ensured."""
        assert decode_message(b"MSH|a\nPID|1\r\nPV1|2", "ascii") == "MSH|a\rPID|1\rPV1|2\r"

    def test_blank_lines_dropped(self) -> None:
        """Blank lines and leading blanks produce no empty segments."""
        assert decode_message(b"\r\nMSH|a\r\r\n\nPID|1\r\n\r\n", "ascii") == "MSH|a\rPID|1\r"

    def test_latin1_sample(self, hl7_sample: Sample) -> None:
        """The 8859/1 sample decodes its umlauts with the codec MSH-18 names."""
        data = hl7_sample("adt_a01_8859_1.hl7")
        codec = resolve_codec(read_msh(data).charset, "utf-8")
        text = decode_message(data, codec)
        assert "M\u00fcller^J\u00fcrgen" in text
        assert hl7.parse(text)["PID.F5.R1.C1"] == "M\u00fcller"

    def test_utf8_sample(self, hl7_sample: Sample) -> None:
        """The UNICODE UTF-8 sample decodes to the original characters."""
        data = hl7_sample("adt_a01_utf8.hl7")
        text = decode_message(data, resolve_codec(read_msh(data).charset, "8859/1"))
        assert "\u5f20\u4e09" in text
        assert "H\u00d4PITAL" in text

    def test_lf_sample_parses_with_hl7(self, hl7_sample: Sample) -> None:
        """A \\n-ended sample, once decoded, parses with hl7.parse into all its segments."""
        text = decode_message(hl7_sample("oru_r01_v251_lf.hl7"), "utf-8")
        message = hl7.parse(text)
        assert [str(seg[0]) for seg in message] == ["MSH", "PID", "OBR", "OBX"]

    def test_undecodable_bytes(self) -> None:
        """Invalid bytes raise EnvelopeError 102 naming the codec and offset."""
        with pytest.raises(EnvelopeError) as info:
            decode_message(b"MSH|^~\\&|\xff\r", "utf-8")
        assert info.value.error_code == 102
        assert "utf-8" in info.value.text
        assert "offset 9" in info.value.text

    def test_bom_dropped(self) -> None:
        """A UTF-8 BOM does not end up in the forwarded text."""
        assert decode_message(b"\xef\xbb\xbfMSH|a\r", "utf-8") == "MSH|a\r"


class TestSetMshField:
    def test_set_existing_field(self) -> None:
        """MSH-13 is replaced in place, the rest untouched."""
        text = "MSH|^~\\&|A|B|C|D|T||ADT^A01|1|P|2.5|old|\rPID|1\r"
        out = set_msh_field(text, 13, "17")
        assert out == "MSH|^~\\&|A|B|C|D|T||ADT^A01|1|P|2.5|17|\rPID|1\r"

    def test_pads_missing_fields(self) -> None:
        """A short MSH is padded with field separators up to the field set."""
        out = set_msh_field("MSH|^~\\&|A|B|C|D|T||ADT^A01|1|P|2.5\rPID|1\r", 13, "5")
        assert out.split("\r")[0] == "MSH|^~\\&|A|B|C|D|T||ADT^A01|1|P|2.5|5"
        assert read_msh(out.encode()).sequence_number == "5"

    def test_custom_separator(self) -> None:
        """The sender's own field separator is used for MSH-n."""
        out = set_msh_field("MSH#$*@!#ACME#E#H#C#T##ADT$A03#9#P#2.5\r", 13, "3")
        assert out == "MSH#$*@!#ACME#E#H#C#T##ADT$A03#9#P#2.5#3\r"

    def test_single_segment_without_terminator(self) -> None:
        """Text without any \\r is treated as one MSH segment."""
        assert set_msh_field("MSH|^~\\&|A", 4, "X") == "MSH|^~\\&|A|X"

    def test_rejects_msh1_and_non_msh(self) -> None:
        """MSH-1 cannot be set and text must start with MSH."""
        with pytest.raises(ValueError):
            set_msh_field("MSH|^~\\&|A\r", 1, "#")
        with pytest.raises(ValueError):
            set_msh_field("PID|1\r", 13, "1")


class TestEnvelopeProperties:
    def test_enhanced_from_msh16_only(self) -> None:
        """MSH-16 alone switches to enhanced mode."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5||||AL\r")
        assert env.application_ack_type == "AL"
        assert env.enhanced

    def test_is_ack_case_insensitive(self) -> None:
        """An inbound ACK is recognised from MSH-9.1."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ack^A01^ACK|1|P|2.5\r")
        assert env.is_ack

    def test_frozen(self) -> None:
        """Envelopes are immutable values."""
        env = read_msh(b"MSH|^~\\&|A|B|C|D|||ADT^A01|1|P|2.5\r")
        assert isinstance(env, Envelope)
        with pytest.raises(AttributeError):
            env.control_id = "2"  # type: ignore[misc]


# -- properties (hypothesis) ---------------------------------------------------

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
MUTATED = st.builds(
    lambda seed, index, steps: mutate(random.Random(seed), CORPUS[index % len(CORPUS)], steps),
    st.integers(0, 2**32 - 1), st.integers(0, len(CORPUS) - 1), st.integers(0, 8),
)
ANY_FRAME = st.one_of(MUTATED, st.binary(max_size=400), st.binary(max_size=200).map(lambda b: b"MSH" + b))


class TestMshReaderProperties:
    @PROPERTY
    @given(ANY_FRAME)
    def test_read_msh_raises_only_envelope_errors(self, payload: bytes) -> None:
        """Any bytes: an Envelope with usable delimiters, or NoMshSegment / MalformedMsh (101/102), nothing else."""
        malformed: MalformedMsh | None = None
        try:
            env: Envelope | None = read_msh(payload)
        except NoMshSegment:
            # The BOM is stripped whole (a lone 0xEF is no BOM), then leading line ends and blanks.
            assert not payload.removeprefix(b"\xef\xbb\xbf").lstrip(b"\r\n \t").startswith(b"MSH")
            return
        except MalformedMsh as exc:
            malformed, env = exc, exc.partial
        if malformed is not None:
            assert malformed.error_code in (101, 102)
        if env is None:
            return
        for ch in env.field_sep + env.encoding_chars:
            assert "!" <= ch <= "~" and not ch.isalnum()
        assert "\r" not in env.control_id and "\n" not in env.control_id

    @PROPERTY
    @given(ANY_FRAME)
    def test_helpers_never_raise(self, payload: bytes) -> None:
        """The best-effort readers a reject ACK relies on never raise."""
        scrape_control_id(payload)
        wide = charsets.sniff_wide_encoding(payload)
        if wide is not None:
            envelope.read_wide_msh(payload, wide)


class TestResolverProperties:
    @PROPERTY
    @given(st.one_of(st.text(max_size=40), st.sampled_from(CHARSET_VALUES), st.sampled_from(sorted(encodings.aliases.aliases))))
    def test_resolver_returns_a_real_character_set_or_raises_unsupported(self, name: str) -> None:
        """Any name: a codec of the accepted set (ASCII-compatible), else UnsupportedCharset 102/103 — never another error."""
        try:
            codec = resolve_codec(name, "utf-8")
        except UnsupportedCharset as exc:
            codes = {exc.error_code}
        else:
            codes = set()
        if codes:
            assert codes <= {102, 103}
            return
        assert codec in charsets.TEXT_CODECS
        assert resolve_codec("", name) == codec  # the channel key takes the same names

    @PROPERTY
    @given(st.binary(max_size=300), st.sampled_from(sorted(charsets.TEXT_CODECS)))
    def test_decode_raises_only_envelope_errors(self, payload: bytes, codec: str) -> None:
        """Decoding any bytes with an accepted codec gives CR-ended text or EnvelopeError 102."""
        try:
            text = decode_message(payload, codec)
        except EnvelopeError as exc:
            text, code = None, exc.error_code
        if text is None:
            assert code == 102
            return
        assert "\n" not in text and (text == "" or text.endswith("\r"))
