"""Read what intake needs from the MSH segment, on bytes, without parsing the message.

The hot path reads only the MSH fields; MSH-18 (the character set) is not
known until the MSH is read, so the MSH segment is split as latin-1 - a
byte-transparent decoding: every byte maps to one character and back, the HL7
delimiters are ASCII, and every field intake needs is ASCII in practice. The
envelope's strings are therefore "bytes as text"; ``acks.build_ack`` re-decodes
the ones it copies with the message's real codec.

Also here: setting one MSH field in the decoded text (MSH-13 stamping,
docs/protocol.md#sequence-numbers-and-msh-13). Resolving MSH-18 and decoding
the whole message live in ``agent.core.charsets``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# decode_message: dispatcher.py still imports it from here (its own step moves that import).
from agent.core.charsets import decode_message
from agent.errors import EnvelopeError

__all__ = [
    "DEFAULT_ENCODING_CHARS",
    "DEFAULT_FIELD_SEP",
    "Envelope",
    "MalformedMsh",
    "NoMshSegment",
    "decode_message",
    "read_msh",
    "read_wide_msh",
    "scrape_control_id",
    "set_msh_field",
    "usable_delimiter",
]

DEFAULT_FIELD_SEP = "|"
DEFAULT_ENCODING_CHARS = "^~\\&"

# Leading bytes tolerated before "MSH": blank lines / spaces some senders emit,
# and a UTF-8 byte order mark (dropping such a message silently would be worse).
_LEADING_JUNK = b"\r\n \t"
_UTF8_BOM = b"\xef\xbb\xbf"


_object_setattr = object.__setattr__


class NoMshSegment(EnvelopeError):
    """The frame does not start with an MSH segment: no ACK is owed, audit only (docs/acks.md#frames-that-get-no-answer)."""


class MalformedMsh(EnvelopeError):
    """An MSH is present but unusable: the sender gets a reject ACK (AE/CE, 101/102).

    ``partial`` holds what could be read (separators, MSH-3..6, MSH-10, ...) when
    the separators themselves were usable, so the reject ACK can still swap
    the applications and echo MSH-10; ``None`` when even the separators were bad
    (the ACK then uses the default ``|^~\\&``: docs/acks.md#how-an-ack-is-built).
    """

    def __init__(
        self, text: str, *, error_code: int | None = None, partial: Envelope | None = None
    ) -> None:
        super().__init__(text, error_code=error_code)
        self.partial = partial


@dataclass(frozen=True, init=False)
class Envelope:
    """The MSH fields intake and ACK building need (latin-1 "bytes as text").

    Frozen; built once per message, so ``__init__`` fills the instance's
    dictionary in one step (a frozen dataclass's own sets each of the sixteen
    fields through ``object.__setattr__``: a fifth of reading the MSH).
    """

    field_sep: str  # MSH-1
    encoding_chars: str  # MSH-2 as sent: component, repetition, escape, subcomponent[, truncation]
    sending_app: str  # MSH-3 (whole field, components kept)
    sending_facility: str  # MSH-4
    receiving_app: str  # MSH-5
    receiving_facility: str  # MSH-6
    message_type: str  # MSH-9 whole, e.g. "ADT^A01^ADT_A01"
    message_code: str  # MSH-9.1
    trigger_event: str  # MSH-9.2 ("" when absent)
    control_id: str  # MSH-10
    processing_id: str  # MSH-11 whole (copied into ACKs)
    version_id: str  # MSH-12 whole (copied into ACKs)
    sequence_number: str  # MSH-13
    accept_ack_type: str  # MSH-15 ("" when absent)
    application_ack_type: str  # MSH-16 ("" when absent)
    charset: str  # MSH-18 first repetition ("" when absent)

    def __init__(
        self, field_sep: str, encoding_chars: str, sending_app: str, sending_facility: str, receiving_app: str,
        receiving_facility: str, message_type: str, message_code: str, trigger_event: str, control_id: str,
        processing_id: str, version_id: str, sequence_number: str, accept_ack_type: str,
        application_ack_type: str, charset: str,
    ) -> None:
        _object_setattr(self, "__dict__", {
            "field_sep": field_sep, "encoding_chars": encoding_chars, "sending_app": sending_app,
            "sending_facility": sending_facility, "receiving_app": receiving_app,
            "receiving_facility": receiving_facility, "message_type": message_type, "message_code": message_code,
            "trigger_event": trigger_event, "control_id": control_id, "processing_id": processing_id,
            "version_id": version_id, "sequence_number": sequence_number, "accept_ack_type": accept_ack_type,
            "application_ack_type": application_ack_type, "charset": charset,
        })

    def _enc(self, index: int) -> str:
        chars = self.encoding_chars
        return chars[index] if len(chars) > index else DEFAULT_ENCODING_CHARS[index]

    @property
    def component_sep(self) -> str:
        """MSH-2.1 (``^`` by default)."""
        return self._enc(0)

    @property
    def repetition_sep(self) -> str:
        """MSH-2.2 (``~`` by default)."""
        return self._enc(1)

    @property
    def escape_char(self) -> str:
        """MSH-2.3 (``\\`` by default)."""
        return self._enc(2)

    @property
    def subcomponent_sep(self) -> str:
        """MSH-2.4 (``&`` by default)."""
        return self._enc(3)

    @property
    def truncation_char(self) -> str:
        """MSH-2.5 (v2.7+), ``""`` when the sender declares none."""
        return self.encoding_chars[4] if len(self.encoding_chars) > 4 else ""

    @property
    def enhanced(self) -> bool:
        """MSH-15 or MSH-16 set: enhanced acknowledgment mode (HL7 v2.5 section 2.9.3)."""
        return bool(self.accept_ack_type.strip() or self.application_ack_type.strip())

    @property
    def is_ack(self) -> bool:
        """The message is itself an ACK (MSH-9.1 ``ACK``): never queued nor answered."""
        return self.message_code.strip().upper() == "ACK"

    @property
    def version(self) -> str:
        """MSH-12.1, the bare version id (``2.5.1``), stripped."""
        return self.version_id.split(self.component_sep, 1)[0].strip()


def _split_msh(data: bytes) -> tuple[str, int]:
    """Return the MSH segment as latin-1 text and its start offset, or raise NoMshSegment."""
    start = 0
    if data.startswith(_UTF8_BOM):
        start = len(_UTF8_BOM)
    n = len(data)
    while start < n and data[start] in _LEADING_JUNK:
        start += 1
    if data[start : start + 3] != b"MSH":
        raise NoMshSegment("no MSH segment at the start of the message", error_code=101)
    # The MSH ends at its first \r, \n or \r\n; bound the \n search by
    # the \r found so a \r-ended message is never scanned past its first segment.
    end = data.find(b"\r", start)
    lf = data.find(b"\n", start, end if end >= 0 else n)
    if lf >= 0:
        end = lf
    if end < 0:
        end = n
    return data[start:end].decode("latin-1"), start


def usable_delimiter(ch: str) -> bool:
    """Printable ASCII punctuation (HL7 2.5 ch. 2.5.4 recommends ``|^~\\&``).

    A byte above 0x7E would be written back as two bytes in a UTF-8 ACK (or be
    part of a multi-byte character), a control byte is no visible delimiter;
    either makes an ACK the sender cannot split.
    """
    return "!" <= ch <= "~" and not ch.isalnum()


@functools.lru_cache(maxsize=64)
def _separators_problem(field_sep: str, encoding_chars: str) -> tuple[str, int] | None:
    """Why MSH-1/MSH-2 cannot serve as delimiters (HL7 2.5 ch. 2.5.4): (text, error code), or None."""
    if not field_sep or not usable_delimiter(field_sep):
        return f"MSH-1 field separator {field_sep!r} is unusable", 102
    if not encoding_chars:
        return "MSH-2 encoding characters missing", 101
    if len(encoding_chars) > 5:
        return "MSH-2 has more than 5 encoding characters", 102
    # Missing trailing ones default (sloppy senders send "^~\"); the effective
    # set must still be distinct, non-alphanumeric and not the field separator.
    effective = encoding_chars + DEFAULT_ENCODING_CHARS[len(encoding_chars) :]
    for ch in effective:
        if not usable_delimiter(ch) or ch == field_sep:
            return f"MSH-2 encoding character {ch!r} is unusable", 102
    if len(set(effective)) != len(effective):
        return "MSH-2 encoding characters are not distinct", 102
    return None


def read_msh(data: bytes) -> Envelope:
    """Read the MSH at the start of ``data`` (a frame payload or its oversize prefix).

    Raises NoMshSegment when there is no MSH at all, MalformedMsh (an
    EnvelopeError, error_code 101/102) when the MSH is present but unusable.
    Only the first segment is looked at: this is on the hot path.
    """
    segment, _ = _split_msh(data)
    if len(segment) < 4:
        raise MalformedMsh("MSH-1 field separator missing", error_code=101)
    field_sep = segment[3]
    fields = segment.split(field_sep)
    encoding_chars = fields[1] if len(fields) > 1 else ""
    # MSH-1 is the separator itself, so MSH-n is fields[n - 1]; absent fields are "".
    if len(fields) < 18:
        fields.extend([""] * (18 - len(fields)))
    # A sender's pair is checked once (a long MSH-2 is wrong anyway: not cached).
    check = _separators_problem if len(encoding_chars) <= 5 else _separators_problem.__wrapped__
    problem = check(field_sep, encoding_chars)
    if problem is not None:
        raise MalformedMsh(problem[0], error_code=problem[1], partial=_scraped(field_sep, fields))
    effective = encoding_chars + DEFAULT_ENCODING_CHARS[len(encoding_chars) :]
    comp = effective[0]
    message_type = fields[8]
    type_parts = message_type.split(comp, 2)
    envelope = Envelope(
        field_sep,
        encoding_chars,
        fields[2],  # MSH-3
        fields[3],  # MSH-4
        fields[4],  # MSH-5
        fields[5],  # MSH-6
        message_type,  # MSH-9
        type_parts[0].strip(),
        type_parts[1].strip() if len(type_parts) > 1 else "",
        fields[9],  # MSH-10
        fields[10],  # MSH-11
        fields[11],  # MSH-12
        fields[12],  # MSH-13
        fields[14].strip(),  # MSH-15
        fields[15].strip(),  # MSH-16
        fields[17].split(effective[1], 1)[0].strip(),  # MSH-18, first repetition
    )
    # Required fields intake relies on (HL7 table 0357: 101 required field missing).
    if not envelope.message_code:
        raise MalformedMsh("MSH-9 message type missing", error_code=101, partial=envelope)
    if not envelope.control_id.strip():
        raise MalformedMsh("MSH-10 message control id missing", error_code=101, partial=envelope)
    if not envelope.version:
        raise MalformedMsh("MSH-12 version id missing", error_code=101, partial=envelope)
    return envelope


#: What a field read past unusable encoding characters may not keep: the
#: default field separator and escape character would change the reject's
#: structure (HL7 2.5 ch. 2.7: they must be escaped in data).
_UNSAFE_IN_SCRAPED = str.maketrans("", "", DEFAULT_FIELD_SEP + DEFAULT_ENCODING_CHARS[2])


def _scraped(field_sep: str, fields: list[str]) -> Envelope | None:
    """An MSH whose encoding characters are unusable, read with its field separator alone (``fields``: 18 at least).

    Expressed in the default delimiters (the reject is written in them): the
    reject ACK copies MSH-3..6 and MSH-11/12 like any other, and an inbound
    ACK is still recognised by MSH-9 and never answered. MSH-15/16 are left
    empty: a broken MSH is always answered. None when even MSH-1 is unusable.
    """
    if not usable_delimiter(field_sep):
        return None
    clean = [f.translate(_UNSAFE_IN_SCRAPED) for f in fields]
    comp = DEFAULT_ENCODING_CHARS[0]
    type_parts = clean[8].split(comp, 2)
    return Envelope(
        DEFAULT_FIELD_SEP, DEFAULT_ENCODING_CHARS, clean[2], clean[3], clean[4], clean[5],
        clean[8], type_parts[0].strip(), type_parts[1].strip() if len(type_parts) > 1 else "",
        clean[9], clean[10], clean[11], clean[12], "", "",
        clean[17].split(DEFAULT_ENCODING_CHARS[1], 1)[0].strip(),
    )


def scrape_control_id(data: bytes) -> str:
    """Best-effort MSH-10 of a frame whose MSH ``read_msh`` rejected ("" if unreadable).

    For MSA-2 of the minimal reject ACK (MSA-2 stays empty when MSH-10 cannot
    be read: docs/acks.md#how-an-ack-is-built).
    """
    try:
        segment, _ = _split_msh(data)
    except NoMshSegment:
        return ""
    if len(segment) < 4 or segment[3].isalnum() or segment[3].isspace():
        return ""
    fields = segment.split(segment[3])
    return fields[9].strip() if len(fields) > 9 else ""


def set_msh_field(text: str, field_number: int, value: str) -> str:
    """Return ``text`` (decoded, normalised) with MSH-``field_number`` set to ``value``.

    Used to stamp MSH-13 = seq (``assign_sequence_numbers``,
    docs/protocol.md#sequence-numbers-and-msh-13). Missing
    fields are padded; ``value`` is inserted as is (the caller escapes if needed).
    """
    if field_number < 2:
        raise ValueError("MSH-1 is the field separator itself and cannot be set")
    if not text.startswith("MSH") or len(text) < 4:
        raise ValueError("text does not start with an MSH segment")
    end = text.find("\r")
    msh, rest = (text, "") if end < 0 else (text[:end], text[end:])
    sep = msh[3]
    fields = msh.split(sep)
    if len(fields) < field_number:
        fields.extend([""] * (field_number - len(fields)))
    fields[field_number - 1] = value
    return sep.join(fields) + rest


def read_wide_msh(data: bytes, codec: str) -> Envelope | None:
    """Best-effort MSH of a UTF-16/32 frame, for the reject ACK's MSA-2 and application swap."""
    text = data.decode(codec, errors="replace").lstrip("\ufeff\r\n ")
    try:
        return read_msh(text.encode("latin-1", errors="replace"))
    except MalformedMsh as exc:
        return exc.partial
    except EnvelopeError:
        return None
