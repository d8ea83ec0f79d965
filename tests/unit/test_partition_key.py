"""Partition keys from HL7 field paths: the syntax, the values, escapes, and a property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.partition import KEY_SEPARATOR, FieldPath, key_hash, parse_partition_key, shown_key

MSG = (
    "MSH|^~\\&|LAB|FAC-A|HIS|HOSP|20240101120000||ADT^A01|C1|P|2.5\r"
    "EVN|A01|20240101120000\r"
    "PID|1||12345^^^HOSP^MR~67890^^^OTHER^PI&sub1&sub2||DOE^JOHN\r"
    "PV1|1|I\r"
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("PID-3.1", "12345"),
        ("PID-3", "12345^^^HOSP^MR"),
        ("PID-3[1].1", "12345"),
        ("PID-3[2].1", "67890"),
        ("PID-3[2].5", "PI&sub1&sub2"),
        ("PID-3[2].5.2", "sub1"),
        ("PID-3[2].5.3", "sub2"),
        ("PID-3[2].5.4", ""),  # absent subcomponent
        ("PID-3[3].1", ""),  # absent repetition
        ("PID-3.9", ""),  # absent component
        ("PID-30", ""),  # absent field
        ("OBX-3.1", ""),  # absent segment
        ("MSH-4", "FAC-A"),  # MSH counts MSH-1 as the field separator
        ("MSH-3", "LAB"),
        ("MSH-1", "|"),
        ("MSH-2", "^~\\&"),
        ("MSH-9.2", "A01"),
        ("MSH-4,PID-3.1", "FAC-A\x1f12345"),
        ("PID-3.1, PV1-2", "12345\x1fI"),
        ("OBX-3,ZZZ-1", "\x1f"),  # all absent: empty parts, joined
    ],
)
def test_values_at_paths(spec: str, expected: str) -> None:
    assert parse_partition_key(spec).of(MSG) == expected


def test_one_path_all_absent_is_the_empty_key() -> None:
    assert parse_partition_key("PID-3.1").of("MSH|^~\\&|A|B\rEVN|A01\r") == ""


def test_several_paths_all_absent_are_shown_as_the_empty_key() -> None:
    """SPEC: all parts absent is the key "" — as sent and hashed; stored as before (no row changes partition)."""
    stored = parse_partition_key("MSH-4,PID-3.1").of("MSH|^~\\&|A|\rEVN|A01\r")
    assert stored == "\x1f"
    assert shown_key(stored) == "" and key_hash(stored, "00") == key_hash("", "00")
    assert shown_key("\x1f12345") == "\x1f12345" and shown_key("A\x1f") == "A\x1f" and shown_key("") == ""


@pytest.mark.parametrize("ending", ["\r", "\n", "\r\n"])
def test_segment_endings(ending: str) -> None:
    """Segments may end in CR, LF or CRLF (a sender's choice): the key is the same."""
    assert parse_partition_key("PID-3.1").of(MSG.replace("\r", ending)) == "12345"


@pytest.mark.parametrize(
    ("pid3", "expected"),
    [
        ("A\\S\\B", "A^B"),  # \S\ component separator
        ("A\\T\\B", "A&B"),
        ("A\\R\\B", "A~B"),
        ("A\\F\\B", "A|B"),
        ("A\\E\\B", "A\\B"),
        ("A\\H\\B\\N\\", "A\\H\\B\\N\\"),  # formatting escapes kept as written
        ("A\\X41\\", "A\\X41\\"),  # hex kept as written
        ("A\\S", "A\\S"),  # unterminated: literal
    ],
)
def test_escapes(pid3: str, expected: str) -> None:
    msg = f"MSH|^~\\&|A|B\rPID|1||{pid3}^^^HOSP\r"
    assert parse_partition_key("PID-3.1").of(msg) == expected


def test_declared_delimiters_are_used() -> None:
    """A sender's own MSH-1/MSH-2 delimiters split and unescape the fields (HL7 v2 2.5.4)."""
    msg = "MSH#*@!$#A#B\rPID#1##X!S!Y*Z@second*2#\r"
    assert parse_partition_key("PID-3.1").of(msg) == "X*Y"
    assert parse_partition_key("PID-3[2].2").of(msg) == "2"
    assert parse_partition_key("MSH-4").of(msg) == "B"


def test_truncation_escape_v27() -> None:
    msg = "MSH|^~\\&#|A|B\rPID|1||A\\P\\B\r"
    assert parse_partition_key("PID-3").of(msg) == "A#B"


def test_segment_id_must_match_whole() -> None:
    """``PIDX`` is not ``PID``: the first segment whose id is exactly the path's segment."""
    msg = "MSH|^~\\&|A|B\rPIDX|1||WRONG\rPID|1||RIGHT\rPID|2||SECOND\r"
    assert parse_partition_key("PID-3").of(msg) == "RIGHT"


@pytest.mark.parametrize("spec", ["PID-3.1,", ",PID-3", "MSH-4,,PID-3.1", "PID-3, ,MSH-4"])
def test_an_empty_path_between_commas_is_refused_with_what_was_written(spec: str) -> None:
    with pytest.raises(ValueError, match="empty path") as caught:
        parse_partition_key(spec)
    assert repr(spec) in str(caught.value)


@pytest.mark.parametrize(
    "spec",
    ["", "PID", "PID-0", "pid-3", "PID-3.", "PID-3..1", "PID-3[0]", "PID-3.0", "PID3.1", "MSH-2.1",
     "PID-3,PID-3", "PID-3;PV1-2"],
)
def test_bad_paths_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="HL7 field path|delimiters|named twice"):
        parse_partition_key(spec)


def test_round_trip_of_the_spec() -> None:
    spec = parse_partition_key("MSH-4, PID-3[2].1.2")
    assert spec.paths == (FieldPath("MSH", 4), FieldPath("PID", 3, 2, 1, 2))
    assert str(spec) == "MSH-4,PID-3[2].1.2"


def test_key_hash_is_short_stable_and_hides_the_value() -> None:
    secret = "0f" * 16
    h = key_hash("12345", secret)
    assert h == key_hash("12345", secret) and h != key_hash("12346", secret)
    assert len(h) == 12 and "12345" not in h


def test_key_hash_cannot_be_undone_by_hashing_every_record_number() -> None:
    """Keyed with the queue's secret: a log reader who hashes every 6-digit number finds no match
    (an unkeyed SHA-256 was undone that way in about a second), and another queue names the key apart."""
    import hashlib

    secret = "5a" * 16
    shown = {key_hash(mrn, secret) for mrn in ("483920", "071155", "999001")}
    guesses = {hashlib.sha256(f"{n:06d}".encode()).hexdigest()[:12] for n in range(1_000_000)}
    assert not shown & guesses
    assert key_hash("483920", "a5" * 16) not in shown


# -- property: whatever the values, escaping them and extracting gives them back ------

_value = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\x1f"),
                 max_size=12)


def _escape(value: str) -> str:
    """HL7 v2 section 2.7.4 escaping of the default delimiters (the escape character first)."""
    for ch, seq in (("\\", "\\E\\"), ("|", "\\F\\"), ("^", "\\S\\"), ("&", "\\T\\"), ("~", "\\R\\")):
        value = value.replace(ch, seq)
    return value


@settings(max_examples=300, deadline=None)
@given(
    reps=st.lists(st.lists(st.lists(_value, min_size=1, max_size=3), min_size=1, max_size=3),
                  min_size=1, max_size=3),
    facility=_value,
    rep=st.integers(1, 4), comp=st.integers(1, 4), sub=st.integers(1, 4),
)
def test_property_escaped_values_come_back(
    reps: list[list[list[str]]], facility: str, rep: int, comp: int, sub: int
) -> None:
    """Any value, escaped as HL7 says, is found again at its path; anything absent is ""."""
    pid3 = "~".join("^".join("&".join(_escape(s) for s in c) for c in r) for r in reps)
    msg = f"MSH|^~\\&|APP|{_escape(facility)}|X|Y\rPID|1||{pid3}\r"
    try:
        expected = reps[rep - 1][comp - 1][sub - 1]
    except IndexError:
        expected = ""
    key = parse_partition_key(f"MSH-4,PID-3[{rep}].{comp}.{sub}").of(msg)
    assert key == f"{facility}{KEY_SEPARATOR}{expected}"
