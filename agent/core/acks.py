"""Build and read HL7 v2 ACK messages (docs/acks.md#how-an-ack-is-built; HL7 tables 0008 and 0357).

Ours rather than ``hl7.create_ack``: that one omits the ERR segment, hard-codes
parts of the MSH and breaks on a short inbound MSH. A broken MSH must still get
a reject ACK, so ``build_ack`` never raises on odd input.

Reading an ACK is here too (``read_ack_code``, ``server_reason``): it shares
the delimiter and escape rules with building one, which is why the module is
about 550 lines.
"""

from __future__ import annotations

import functools
import itertools
import re
import time
import uuid
from datetime import datetime
from enum import Enum, StrEnum

from agent.core import charsets, mllp
from agent.core.envelope import (
    DEFAULT_ENCODING_CHARS,
    DEFAULT_FIELD_SEP,
    Envelope,
    usable_delimiter,
)

__all__ = [
    "TABLE_0357",
    "AckCode",
    "Outcome",
    "ack_code",
    "app_ack_from_status",
    "application_ack_wanted",
    "build_ack",
    "commit_ack_wanted",
    "new_control_id",
    "read_ack_code",
    "relayed_ack",
    "server_reason",
    "usable_server_ack",
]


class AckCode(StrEnum):
    """HL7 table 0008 acknowledgment codes (original: A*, enhanced commit: C*)."""

    AA = "AA"
    AE = "AE"
    AR = "AR"
    CA = "CA"
    CE = "CE"
    CR = "CR"


class Outcome(Enum):
    """What intake made of a frame; ``ack_code`` maps it to docs/acks.md#which-ack-for-which-situation."""

    COMMITTED = "committed"
    RESEND_LATER = "resend_later"  # storage failure, backpressure
    UNSUPPORTED = "unsupported"  # type/event/processing id/version not accepted
    DUPLICATE_KEY = "duplicate_key"  # control id reused with another body
    MALFORMED = "malformed"  # missing/malformed MSH field, undecodable bytes
    TOO_LARGE = "too_large"  # frame over max_message_bytes


# docs/acks.md#which-ack-for-which-situation: outcome -> (original mode, enhanced mode).
_ACK_CODES: dict[Outcome, tuple[AckCode, AckCode]] = {
    Outcome.COMMITTED: (AckCode.AA, AckCode.CA),
    Outcome.RESEND_LATER: (AckCode.AR, AckCode.CE),
    Outcome.UNSUPPORTED: (AckCode.AR, AckCode.CR),
    Outcome.DUPLICATE_KEY: (AckCode.AE, AckCode.CE),
    Outcome.MALFORMED: (AckCode.AE, AckCode.CE),
    Outcome.TOO_LARGE: (AckCode.AE, AckCode.CE),
}

#: HL7 table 0357, message error condition codes.
TABLE_0357: dict[int, str] = {
    0: "Message accepted",
    100: "Segment sequence error",
    101: "Required field missing",
    102: "Data type error",
    103: "Table value not found",
    200: "Unsupported message type",
    201: "Unsupported event code",
    202: "Unsupported processing id",
    203: "Unsupported version id",
    204: "Unknown key identifier",
    205: "Duplicate key identifier",
    206: "Application record locked",
    207: "Application internal error",
}

_ACCEPT_CODES = frozenset({AckCode.AA, AckCode.CA})
_DEFAULT_VERSION = "2.5"
_VERSION_RE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def ack_code(outcome: Outcome, enhanced: bool) -> AckCode:
    """The MSA-1 code for an intake outcome in original or enhanced mode (HL7 table 0008)."""
    original, enhanced_code = _ACK_CODES[outcome]
    return enhanced_code if enhanced else original


#: This process's ACK ids: 40 random bits once, then a counter (an ACK's MSH-10
#: need only be unique; a random UUID per ACK cost a system call each).
_ID_PREFIX = uuid.uuid4().hex[:10].upper()
_ID_COUNTER = itertools.count(1)


def new_control_id() -> str:
    """A fresh MSH-10 for an ACK: unique and 20 characters (HL7 ST limit in v2.3-2.5)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER) % 16**10:010X}"


#: (epoch second, its local YYYYMMDDHHMMSS, its zone +ZZZZ): formatting a
#: datetime per ACK was a tenth of the ACK's cost; the second changes seldom.
_second: tuple[int, str, str] = (-1, "", "")


def _now_parts() -> tuple[str, int, str]:
    """Now as local YYYYMMDDHHMMSS, ten-thousandths of the second, and zone."""
    global _second  # noqa: PLW0603 - a one-entry cache, swapped whole (atomic)
    t = time.time()
    sec = int(t)
    cached = _second
    if cached[0] != sec:
        moment = datetime.fromtimestamp(sec).astimezone()
        cached = _second = (sec, f"{moment:%Y%m%d%H%M%S}", f"{moment:%z}")
    return cached[1], min(9999, int((t - sec) * 10000)), cached[2]


def _version_tuple(version_id: str, component_sep: str) -> tuple[int, int, int]:
    """MSH-12.1 as numbers; unreadable versions count as 2.5 (what we then write)."""
    match = _VERSION_RE.search(version_id.split(component_sep, 1)[0])
    if match is None:
        return (2, 5, 0)
    return (int(match[1]), int(match[2]), int(match[3] or 0))


def _timestamp(now: datetime | None, delimiters: str = "") -> str:
    """MSH-7 as HL7 DTM with time zone: YYYYMMDDHHMMSS.ffff+ZZZZ (ten-thousandths of a second).

    The fraction and the zone are optional in DTM (HL7 2.5 ch. 2.A.22); a part
    whose punctuation is one of the sender's delimiters (``.`` or ``+``/``-``
    as a separator) is left out, so MSH-7 never splits the ACK's fields.
    """
    if now is None:
        seconds, fraction, zone = _now_parts()
        text = seconds
        if "." not in delimiters:
            text += f".{fraction:04d}"
        return text + zone if zone[:1] not in delimiters else text
    if now.tzinfo is None:
        moment = now.astimezone()  # naive: taken as local time
    else:
        moment = now
    text = f"{moment:%Y%m%d%H%M%S}"
    if "." not in delimiters:
        text += f".{moment.microsecond // 100:04d}"
    zone = f"{moment:%z}"
    if zone[:1] not in delimiters:
        text += zone
    return text


def _usable_codec(codec: str) -> str:
    """``codec`` if it is a real character set intake accepts, else ascii: an ACK must always go out.

    A row an older version stored may name a Python codec that is a transform
    (``idna``, ``rot13``) or not ASCII-compatible; encoding with it can raise
    or produce bytes that break the MLLP framing.
    """
    return charsets.text_codec(codec) or "ascii"


def _recode(raw: str, codec: str) -> str:
    """Turn an envelope field (latin-1 "bytes as text") into real text in ``codec``."""
    if raw.isascii():
        return raw  # every usable codec reads ASCII as ASCII (the common case)
    try:
        return raw.encode("latin-1").decode(codec, errors="replace")
    except UnicodeEncodeError:
        return raw  # already real text (an Envelope built by hand)


#: Characters no ACK may carry inside a field: the MLLP start and end block
#: bytes (a 0x1C there ends the frame early at the sender) and segment ends.
_FRAMING_CHARS = "\x0b\x1c\r\n"


class _Delims:
    """The delimiters an ACK is written with, and HL7 escaping (HL7 2.5 ch. 2.7)."""

    def __init__(self, field_sep: str, encoding_chars: str) -> None:
        delimiters = field_sep + encoding_chars
        if len(field_sep) != 1 or not delimiters.isascii() or any(ch in _FRAMING_CHARS for ch in delimiters):
            # read_msh never lets these through; an Envelope built by hand might.
            field_sep, encoding_chars = DEFAULT_FIELD_SEP, DEFAULT_ENCODING_CHARS
        effective = encoding_chars + DEFAULT_ENCODING_CHARS[len(encoding_chars) :]
        self.field = field_sep
        self.encoding_chars = encoding_chars
        self.component = effective[0]
        self.repetition = effective[1]
        self.escape = effective[2]
        self.subcomponent = effective[3]
        self.all_delimiters = field_sep + effective
        esc = self.escape
        table = {
            esc: f"{esc}E{esc}",
            field_sep: f"{esc}F{esc}",
            self.component: f"{esc}S{esc}",
            self.repetition: f"{esc}R{esc}",
            self.subcomponent: f"{esc}T{esc}",
            "\r": " ",
            "\n": " ",
            # HL7 2.5 ch. 2.7.3: \Xhh\ hexadecimal data, for the MLLP block bytes.
            "\x0b": f"{esc}X0B{esc}",
            "\x1c": f"{esc}X1C{esc}",
        }
        if len(effective) > 4:
            table[effective[4]] = f"{esc}P{esc}"  # truncation character, v2.7+
        self._table = str.maketrans(table)
        # A copied field is already HL7-encoded text in the sender's delimiters:
        # only the characters that would break the frame or the segment get
        # the hexadecimal escape (HL7 2.5 ch. 2.7.3), nothing else changes.
        self._framing = str.maketrans({ch: f"{esc}X{ord(ch):02X}{esc}" for ch in _FRAMING_CHARS})

    def escape_text(self, text: str) -> str:
        """Free text (MSA-3, ERR texts) with every delimiter escaped."""
        return text.translate(self._table)

    def escape_framing(self, field: str) -> str:
        """A field copied from the inbound MSH, with 0x0B, 0x1C, CR and LF as ``\\Xhh\\``."""
        return field.translate(self._framing)


@functools.lru_cache(maxsize=64)
def _delims(field_sep: str, encoding_chars: str) -> _Delims:
    """Delimiters (and their escape table) per sender style, built once."""
    return _Delims(field_sep, encoding_chars)


def build_ack(
    inbound: Envelope | None,
    code: AckCode,
    *,
    text: str = "",
    error_code: int | None = None,
    severity: str = "E",
    now: datetime | None = None,
    control_id: str | None = None,
    codec: str = "ascii",
    inbound_control_id: str = "",
) -> bytes:
    """The ACK for ``inbound`` as bytes (no MLLP framing), segments ended by ``\\r``.

    The sender's delimiters; MSH-3/4 <- inbound MSH-5/6 and MSH-5/6 <- MSH-3/4;
    MSH-7 now with zone; MSH-9 ``ACK^<trigger>^ACK``; new MSH-10; MSH-11/12 and
    MSH-18 copied; MSA-1 ``code``, MSA-2 inbound MSH-10, MSA-3 ``text``. Every
    non-accept carries ERR: ERR-3/ERR-4 from v2.5, ERR-1 and MSA-6 before.
    ``inbound=None`` (MSH unreadable) gives a minimal reject with ``|^~\\&``.
    """
    codec = _usable_codec(codec)
    header = None if inbound is None else (
        inbound.field_sep, inbound.encoding_chars, inbound.receiving_app, inbound.receiving_facility,
        inbound.sending_app, inbound.sending_facility, inbound.trigger_event, inbound.processing_id,
        inbound.version_id, inbound.charset)
    # A sender's header is the same in every message: what the ACK takes from
    # it is built once (bounded: the fields are the sender's, of any size).
    if header is None or sum(map(len, header)) + len(text) <= _TEMPLATE_MAX_CHARS:
        template = _ack_template(header, code, text, error_code, severity, codec)
    else:
        template = _ack_template.__wrapped__(header, code, text, error_code, severity, codec)
    delims, head, mid, before_msa2, tail = template
    if inbound is not None:
        msa2 = delims.escape_framing(_recode(inbound.control_id, codec)) or delims.escape_framing(
            _recode(inbound_control_id, codec))
    else:
        msa2 = delims.escape_framing(_recode(inbound_control_id, codec))
    msh10 = new_control_id() if control_id is None else delims.escape_framing(control_id)
    text_out = head + _timestamp(now, delims.all_delimiters) + mid + msh10 + before_msa2 + msa2 + tail
    return text_out.encode(codec, errors="replace")


#: The longest header (its copied fields and MSA-3) whose ACK template is cached.
_TEMPLATE_MAX_CHARS = 1024


@functools.lru_cache(maxsize=256)
def _ack_template(
    header: tuple[str, ...] | None, code: AckCode, text: str, error_code: int | None, severity: str, codec: str
) -> tuple[_Delims, str, str, str, str]:
    """The ACK's text around MSH-7, MSH-10 and MSA-2 (the parts that change per message).

    ``head`` + MSH-7 + ``mid`` + MSH-10 + ``before_msa2`` + MSA-2 + ``tail``
    is the ACK (see ``build_ack``); ``header`` is the inbound MSH's
    delimiters and the fields the ACK copies, None for a minimal reject.
    """
    if header is not None:
        (field_sep, encoding_chars, receiving_app, receiving_facility, sending_app, sending_facility,
         trigger_event, processing_id_raw, version_id_raw, charset_raw) = header
        delims = _delims(field_sep, encoding_chars)
    else:
        delims = _delims(DEFAULT_FIELD_SEP, DEFAULT_ENCODING_CHARS)

    def copied(raw: str) -> str:
        return delims.escape_framing(_recode(raw, codec))

    if header is not None:
        trigger = copied(trigger_event)
        # MSH-11/12 copied, never a made-up value — an empty MSH-11
        # stays empty. Only a missing MSH-12 gets a default: the ERR layout
        # depends on the version, and a reader requires one.
        processing_id = copied(processing_id_raw)
        version_id = copied(version_id_raw)
        # MSH-12.1 (the version itself) is what a reader requires: "^^^" is missing too.
        if not version_id.split(delims.component, 1)[0]:
            version_id = _DEFAULT_VERSION
        version = _version_tuple(version_id, delims.component)
        swapped = [copied(receiving_app), copied(receiving_facility), copied(sending_app), copied(sending_facility)]
        charset = copied(charset_raw)
    else:
        trigger = ""
        processing_id = ""  # not readable: never a made-up P
        version_id = _DEFAULT_VERSION
        version = (2, 5, 0)
        swapped = ["", "", "", ""]
        charset = ""

    # MSH-9 is ACK^<trigger>^ACK for every version. Before v2.3.1 the
    # third component (message structure) was not defined; receivers of
    # those versions ignore a component they do not know.
    msh9 = delims.component.join(("ACK", trigger, "ACK")) if trigger else "ACK"
    after_msh10 = [processing_id, version_id]  # MSH-11, MSH-12, copied verbatim (never a hard-coded P)
    if charset:
        after_msh10.extend(["", "", "", "", "", charset])  # MSH-13..17 empty, MSH-18

    accept = code in _ACCEPT_CODES
    msa_rest = [delims.escape_text(text)]  # MSA-3, then (before v2.5, on errors) MSA-4..6
    err: list[list[str]] = []
    if not accept:
        err_code = error_code if error_code is not None else 207
        err_text = delims.escape_text(TABLE_0357.get(err_code, "Application internal error"))
        if version >= (2, 5, 0):
            # ERR-3 (CWE, table 0357) and ERR-4 severity exist from v2.5.
            err3 = delims.component.join((str(err_code), err_text, "HL70357"))
            err.append(["ERR", "", "", err3, severity])
        else:
            # v2.1-2.4: ERR-1 ELD = segment^sequence^field^code(CE, as subcomponents),
            # and MSA-6 CE error condition.
            ce_sub = delims.subcomponent.join((str(err_code), err_text, "HL70357"))
            err.append(["ERR", delims.component * 3 + ce_sub])
            msa_rest.extend(["", "", delims.component.join((str(err_code), err_text, "HL70357"))])

    f = delims.field
    # MSH|MSH-2|MSH-3..6| <MSH-7> |MSH-8|MSH-9| <MSH-10> |MSH-11...\rMSA|MSA-1| <MSA-2> |MSA-3...\r[ERR...\r]
    head = f.join(["MSH", delims.encoding_chars, *swapped]) + f
    mid = f + "" + f + msh9 + f
    before_msa2 = f + f.join(after_msh10) + "\r" + "MSA" + f + str(code) + f
    tail = f + f.join(msa_rest) + "\r" + "".join(f.join(seg) + "\r" for seg in err)
    return delims, head, mid, before_msa2, tail


def _wanted(ack_type: str, success: bool) -> bool:
    """HL7 table 0155: AL always, NE never, ER only on error, SU only on success."""
    value = ack_type.strip().upper()
    if value == "NE":
        return False
    if value == "ER":
        return not success
    if value == "SU":
        return success
    return True  # AL, empty (original mode) or unknown: always acknowledge


def commit_ack_wanted(inbound: Envelope, success: bool) -> bool:
    """Whether the sender wants a commit ACK, per MSH-15 (HL7 table 0155)."""
    return _wanted(inbound.accept_ack_type, success)


def application_ack_wanted(inbound: Envelope, success: bool) -> bool:
    """Whether the sender wants an application ACK, per MSH-16 (HL7 table 0155)."""
    return _wanted(inbound.application_ack_type, success)


def app_ack_from_status(
    inbound: Envelope, status: int, codec: str, *, now: datetime | None = None,
    text: str | None = None,
) -> bytes:
    """The application ACK for a server answer without ``ack`` (docs/acks.md#relayed-application-acks).

    AA for 2xx, else AE with ERR-3 207 (MSA-3 ``text``, else the status).
    Enhanced-mode senders get the same codes: application ACKs use AA/AE/AR,
    not the commit codes CA/CE/CR.
    """
    if 200 <= status < 300:
        return build_ack(inbound, AckCode.AA, codec=codec, now=now)
    return build_ack(
        inbound,
        AckCode.AE,
        text=text if text is not None else f"rejected by the receiving system (status {status})",
        error_code=207,
        codec=codec,
        now=now,
    )


def usable_server_ack(ack_text: str) -> bool:
    """Whether the server's ``ack`` can stand as the sender's ACK: an MSH first, an MSA with a code, no control bytes.

    Anything else (``"MSA|"``, blank segments, a NUL, an MSA before the
    MSH) would reach the sender as an ACK it cannot read, and be replayed on
    every retransmit: the agent builds one from the status instead
    (docs/acks.md#relayed-application-acks). Deliberately no stricter: the
    text is the server's, relayed as it wrote it.
    """
    text = ack_text.strip("\x0b\x1c\r\n ")
    if _CONTROL_BYTES.search(text):
        return False
    segments = [seg for seg in _TEXT_SEGMENT_SPLIT.split(text) if seg]
    if not segments or not segments[0].startswith("MSH") or len(segments[0]) < 4:
        return False
    field_sep = segments[0][3]
    if not usable_delimiter(field_sep):
        return False
    for segment in segments[1:]:
        if segment.startswith("MSA" + field_sep):
            fields = segment.split(field_sep)
            return len(fields) > 1 and bool(fields[1].strip())
    return False


_TEXT_SEGMENT_SPLIT = re.compile(r"\r\n|\r|\n")
_CONTROL_BYTES = re.compile(r"[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f]")


def relayed_ack(ack_text: str, codec: str) -> bytes:
    """The server's ACK text as the bytes the sender gets; never raises.

    Segment ends normalised to ``\\r``; encoded in the sender's character set
    when that is one intake accepts (else ASCII: a row an older version stored
    may name a transform such as ``idna``, which raises on encoding); the
    MLLP block bytes dropped, so it stays one frame on the sender's side.
    """
    normalised = ack_text.replace("\r\n", "\r").replace("\n", "\r")
    return mllp.frame_safe(normalised.encode(_usable_codec(codec), errors="replace"))


_SEGMENT_SPLIT = re.compile(rb"\r\n|\r|\n")


def read_ack_code(ack: bytes) -> str | None:
    """MSA-1 of an ACK (upper-cased), tolerant of framing and line endings; None without MSA."""
    for raw in _SEGMENT_SPLIT.split(ack.strip(b"\x0b\x1c\r\n ")):
        segment = raw.strip(b"\x0b\x1c ").decode("latin-1")
        if segment.startswith("MSA") and len(segment) > 3 and not segment[3].isalnum():
            fields = segment.split(segment[3])
            return fields[1].strip().upper() if len(fields) > 1 else ""
        if segment == "MSA":
            return ""
    return None


# -- the receiving system's reason, for an operator --------------------------------

#: The longest reason kept: enough for any real MSA-3/ERR text, short enough for a table cell.
SERVER_REASON_MAX = 500
_HEX_ESCAPE = re.compile(r"X((?:[0-9A-Fa-f]{2})+)")


def _unescape(text: str, field: str, component: str, repetition: str, escape: str,
              subcomponent: str) -> str:
    """HL7 escape sequences back to text (HL7 2.5 ch. 2.7): \\F\\ \\S\\ \\T\\ \\R\\ \\E\\ \\Xhh\\ \\.br\\."""
    if not escape or escape not in text:
        return text
    named = {"F": field, "S": component, "T": subcomponent, "R": repetition, "E": escape,
             ".br": " ", "H": "", "N": ""}
    parts = text.split(escape)
    out = [parts[0]]
    # Odd pieces sit between two escape characters; a lone one stays as it is.
    index = 1
    while index < len(parts):
        if index + 1 < len(parts):
            code = parts[index]
            hexed = _HEX_ESCAPE.fullmatch(code)
            if code in named:
                out.append(named[code])
            elif hexed:
                out.append(bytes.fromhex(hexed.group(1)).decode("latin-1"))
            elif code[:1] in ("C", "M", "Z"):
                pass  # character set switches and local escapes: nothing to read
            else:
                out.append(escape + code + escape)
            out.append(parts[index + 1])
            index += 2
        else:
            out.append(escape + parts[index])
            index += 1
    return "".join(out)


def server_reason(ack: str | None, *, limit: int = SERVER_REASON_MAX) -> str | None:
    """The receiving system's own words for its answer, from the ACK it sent; None without any.

    What an operator needs when a message is rejected: the texts written for
    people come first — MSA-3 (text message), then per ERR segment ERR-8 (user
    message) or else ERR-7 (diagnostic information), with ERR-2's location
    (``PID-3``) when given. Only when there is no such text, the coded errors
    stand in: ERR-5 (application error code), ERR-3 (HL7 table 0357 code), in
    v2.1-2.4 ERR-1's code, and MSA-6. HL7 escapes are undone, control
    (non-printable) characters become spaces, repeats are dropped, and the result is at most
    ``limit`` (:data:`SERVER_REASON_MAX`) characters. Never raises: the ACK is the
    server's, anything may be in it.
    """
    if not ack:
        return None
    field, enc = DEFAULT_FIELD_SEP, DEFAULT_ENCODING_CHARS
    segments: list[list[str]] = []
    for raw in re.split(r"\r\n|\r|\n", ack.strip("\x0b\x1c\r\n ")):
        line = raw.strip("\x0b\x1c ")
        if line.startswith("MSH") and len(line) > 3:
            field = line[3]
            enc = line[4:].split(field, 1)[0] or DEFAULT_ENCODING_CHARS
        elif line[:3] in ("MSA", "ERR"):
            segments.append(line.split(field))
    chars = enc + DEFAULT_ENCODING_CHARS[len(enc):]
    component, repetition, escape, subcomponent = chars[0], chars[1], chars[2], chars[3]

    def text(value: str) -> str:
        plain = _unescape(value, field, component, repetition, escape, subcomponent)
        return " ".join("".join(ch if ch.isprintable() else " " for ch in plain).split())

    def get(seg: list[str], n: int) -> str:
        return seg[n] if len(seg) > n else ""

    def coded(value: str, sep: str) -> str:
        """``code^text^system`` as "code text" (either part alone when the other is empty)."""
        parts = value.split(sep)
        return text(" ".join(p for p in parts[:2] if p.strip()))

    def location(seg: list[str]) -> str:
        """ERR-2 (v2.5+) or ERR-1's first components (before): ``PID-3``, ``PID-3.1``."""
        for raw in (get(seg, 2), get(seg, 1)):
            parts = raw.split(repetition, 1)[0].split(component)
            if len(parts) >= 3 and parts[0].strip() and parts[2].strip().isdigit():
                where = f"{text(parts[0])}-{parts[2].strip()}"
                if len(parts) >= 5 and parts[4].strip().isdigit():
                    where += f".{parts[4].strip()}"
                return where
        return ""

    said: list[str] = []
    codes: list[str] = []
    for seg in segments:
        if seg[0] == "MSA":
            said.append(text(get(seg, 3)))
            codes.append(coded(get(seg, 6), component))
            continue
        where = location(seg)
        suffix = f" (at {where})" if where else ""
        words = [text(v) for v in get(seg, 8).split(repetition) + get(seg, 7).split(repetition)]
        first = next((w for w in words if w), "")
        if first:
            said.append(first + suffix)
        for value in (get(seg, 5), get(seg, 3)):
            for rep in value.split(repetition):
                if coded(rep, component):
                    codes.append(coded(rep, component) + suffix)
        ce = get(seg, 1).split(repetition, 1)[0].split(component)
        if len(ce) >= 4:  # v2.1-2.4 ERR-1: segment^sequence^field^code&text&system
            codes.append(coded(ce[3], subcomponent) + suffix)
    pieces = list(dict.fromkeys(p for p in (said if any(said) else codes) if p))
    # "102 Data type error" from MSA-6 says less than the same from ERR "(at PID-7)".
    unique = [p for p in pieces if not any(o.startswith(p + " (at ") for o in pieces)]
    if not unique:
        return None
    reason = "; ".join(unique)
    if len(reason) > limit:
        reason = reason[: limit - 1].rstrip() + "…"
    return reason
