"""HL7 batches: split a batch frame into its messages, and build the ACK batch that answers it.

HL7 v2.5 section 2.10.3 (batch protocol): a file is ``FHS`` … ``FTS``
around one or more batches, a batch is ``BHS`` … ``BTS`` around messages,
each message starting at its ``MSH``. Either wrapper may stand alone (a
``BHS`` … ``BTS`` frame without a file header is the common case). Pure and
on bytes, like the framer: arbitrary bytes never raise; a batch the splitter
cannot make sense of comes back with a ``problem`` that names what is wrong,
and intake refuses it whole. Each member keeps its bytes exactly as received
(segment ends ``\\r``, ``\\n`` or ``\\r\\n`` included); blank lines between
members belong to none.

The answer (:func:`ack_batch`) mirrors the structure: ``FHS``/``FTS`` when
the inbound had them, a ``BHS`` per inbound batch with sender and receiver
swapped, a new BHS-11 and BHS-12 = the inbound BHS-11, one ACK per message
in order, ``BTS`` with the count. Its new control ids and its time are
derived from the members' ACKs, so a retransmitted batch whose members'
stored ACKs are replayed gets the same ACK batch, byte for byte.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Batch",
    "BatchGroup",
    "Header",
    "ack_batch",
    "is_batch",
    "split_batch",
]

_UTF8_BOM = b"\xef\xbb\xbf"
_LEADING = b"\r\n \t"
#: One segment and its end: ``\r\n``, ``\r`` or ``\n`` (or the end of the frame).
_SEGMENT = re.compile(rb"([^\r\n]*)(\r\n|\r|\n|$)")
_HEADERS = (b"FHS", b"BHS")
_ENVELOPE = frozenset({b"FHS", b"BHS", b"BTS", b"FTS"})
_DEFAULT_SEPS = ("|", "^~\\&")


@dataclass(frozen=True, slots=True)
class Header:
    """One envelope segment (FHS, BHS, BTS or FTS) as latin-1 text ("bytes as text", no segment end)."""

    segment: str

    @property
    def name(self) -> str:
        return self.segment[:3]

    @property
    def field_sep(self) -> str:
        sep = self.segment[3:4]
        return sep if _usable(sep) else _DEFAULT_SEPS[0]

    def field(self, number: int) -> str:
        """FHS-n/BHS-n the way MSH-n counts (field 1 is the separator); BTS-n/FTS-n from 1."""
        parts = self.segment.split(self.field_sep)
        index = number - 1 if self.name in ("FHS", "BHS") else number
        return parts[index] if 0 < index < len(parts) else ""

    @property
    def encoding_chars(self) -> str:
        chars = self.field(2) if self.name in ("FHS", "BHS") else ""
        return chars if chars and all(_usable(c) for c in chars) else _DEFAULT_SEPS[1]


@dataclass(frozen=True, slots=True)
class BatchGroup:
    """One ``BHS`` … ``BTS`` batch (either may be missing) and its messages, as received."""

    bhs: Header | None
    members: tuple[bytes, ...]
    bts: Header | None


@dataclass(frozen=True, slots=True)
class Batch:
    """A split batch frame. ``problem`` set: it is refused whole, with that reason."""

    fhs: Header | None
    groups: tuple[BatchGroup, ...]
    fts: Header | None
    problem: str | None = None

    @property
    def members(self) -> tuple[bytes, ...]:
        return tuple(m for g in self.groups for m in g.members)


def _usable(ch: str) -> bool:
    """A delimiter must be printable ASCII punctuation (HL7 2.5 section 2.5.4)."""
    return len(ch) == 1 and "!" <= ch <= "~" and not ch.isalnum()


def _start(payload: bytes) -> int:
    start = len(_UTF8_BOM) if payload.startswith(_UTF8_BOM) else 0
    while start < len(payload) and payload[start] in _LEADING:
        start += 1
    return start


def is_batch(payload: bytes) -> bool:
    """Whether a frame is an HL7 batch: it starts (after blank lines or a BOM) with FHS or BHS."""
    start = _start(payload)
    return payload[start:start + 3] in _HEADERS and _usable(payload[start + 3:start + 4].decode("latin-1"))


def split_batch(payload: bytes) -> Batch | None:
    """The batch in ``payload``, or None when it is not one (see ``is_batch``). Never raises."""
    if not is_batch(payload):
        return None
    fhs = fts = None
    groups: list[BatchGroup] = []
    bhs: Header | None = None
    bts: Header | None = None
    members: list[bytes] = []
    member_start: int | None = None
    member_end = 0
    in_group = False
    problem: str | None = None
    trailer_seen = False  # FTS: nothing may follow

    def end_member() -> None:
        nonlocal member_start
        if member_start is not None:
            members.append(payload[member_start:member_end])
            member_start = None

    def end_group() -> None:
        nonlocal bhs, bts, members, in_group
        end_member()
        if in_group or members:
            groups.append(BatchGroup(bhs, tuple(members), bts))
        bhs = bts = None
        members = []
        in_group = False

    for match in _SEGMENT.finditer(payload, _start(payload)):
        text, end = match.group(1), match.end()
        if match.start() == len(payload):
            break
        if not text.strip():
            continue  # a blank line: part of no member
        name = text[:3]
        if trailer_seen and problem is None:
            problem = "segments after FTS (the end of the file)"
        if name == b"MSH":
            if bts is not None and problem is None:
                problem = "a message after BTS without a new BHS"
            end_member()
            member_start, member_end = match.start(), end
            in_group = True
        elif name not in _ENVELOPE:
            if member_start is None:
                if problem is None:
                    problem = f"segment {_name(name)} outside any message"
            else:
                member_end = end
        elif name == b"FHS":
            if (fhs is not None or groups or in_group) and problem is None:
                problem = "FHS after the start of the file"
            fhs = Header(text.decode("latin-1"))
        elif name == b"BHS":
            end_group()
            bhs = Header(text.decode("latin-1"))
            in_group = True
        elif name == b"BTS":
            end_member()
            if bts is not None and problem is None:
                problem = "two BTS segments in one batch"
            bts = Header(text.decode("latin-1"))
            in_group = True
        else:  # FTS
            end_group()
            fts = Header(text.decode("latin-1"))
            trailer_seen = True
    end_group()
    batch = Batch(fhs, tuple(groups), fts, problem)
    return batch if problem is not None else Batch(fhs, tuple(groups), fts, _counts_problem(batch))


def _name(raw: bytes) -> str:
    return raw.decode("latin-1").encode("ascii", "backslashreplace").decode("ascii")


def _counts_problem(batch: Batch) -> str | None:
    """BTS-1 (batch message count) and FTS-1 (file batch count), when given, must match."""
    for number, group in enumerate(batch.groups, 1):
        count = group.bts.field(1).strip() if group.bts is not None else ""
        if count and count != str(len(group.members)):
            where = f"batch {number}: " if len(batch.groups) > 1 else ""
            return f"{where}BTS-1 says {_name(count.encode('latin-1'))[:20]} messages, the batch holds {len(group.members)}"
    count = batch.fts.field(1).strip() if batch.fts is not None else ""
    if count and count != str(len(batch.groups)):
        return f"FTS-1 says {_name(count.encode('latin-1'))[:20]} batches, the file holds {len(batch.groups)}"
    return None


# -- the answer ------------------------------------------------------------------


def _msh7(ack: bytes) -> str:
    """MSH-7 of an ACK we built (its first segment), "" if unreadable."""
    first = ack.split(b"\r", 1)[0].decode("latin-1")
    if len(first) < 4 or not first.startswith("MSH"):
        return ""
    fields = first.split(first[3])
    return fields[6] if len(fields) > 6 else ""


def _control_id(kind: str, material: bytes) -> str:
    """A new BHS-11/FHS-11: 20 characters (HL7 ST), derived from what the batch answers."""
    return kind + hashlib.sha256(material).hexdigest()[:19].upper()


def _escape(value: str, header: Header) -> str:
    """``value`` (our own text) with the header's delimiters escaped (HL7 2.5 section 2.7)."""
    enc = header.encoding_chars
    escape = enc[2] if len(enc) > 2 else "\\"
    table = {header.field_sep: "F", enc[0]: "S", escape: "E"}
    if len(enc) > 1:
        table[enc[1]] = "R"
    if len(enc) > 3:
        table[enc[3]] = "T"
    return "".join(f"{escape}{table[c]}{escape}" if c in table else c for c in value)


def _swapped(name: str, inbound: Header | None, fallback: Header | None, when: str, new_id: str,
             comment: str = "") -> str:
    """A response FHS/BHS: sender and receiver swapped, a new id (11) and the inbound's (12)."""
    source = inbound if inbound is not None else fallback
    sep = source.field_sep if source is not None else _DEFAULT_SEPS[0]
    enc = source.encoding_chars if source is not None else _DEFAULT_SEPS[1]
    f = source.field if source is not None else (lambda _n: "")
    fields = [name, enc, f(5), f(6), f(3), f(4), when, "", "",
              _escape(comment, source) if comment and source is not None else "",
              new_id, inbound.field(11) if inbound is not None else ""]
    while fields[-1] == "" and len(fields) > 2:
        fields.pop()
    return sep.join(fields)


def ack_batch(batch: Batch, acks: Sequence[bytes], *, now: str, comment: str = "") -> bytes:
    """The response batch for ``batch``: ``acks`` (one per member, in order) wrapped as it was.

    ``now`` is the HL7 time used when no member ACK gives one (an empty
    batch); ``comment`` goes into BHS-10 (e.g. why the batch was refused).
    """
    assert len(acks) == len(batch.members)
    segments: list[str] = []
    when = _msh7(acks[0]) if acks and _msh7(acks[0]) else now
    material = b"\x00".join(acks) + comment.encode("utf-8", "replace")
    first_bhs = next((g.bhs for g in batch.groups if g.bhs is not None), None)
    if batch.fhs is not None:
        segments.append(_swapped("FHS", batch.fhs, first_bhs, when, _control_id("F", material)))
    out = []
    index = 0
    groups = batch.groups or (BatchGroup(None, (), None),)
    for number, group in enumerate(groups):
        sep = (group.bhs or batch.fhs or Header("BHS|")).field_sep
        own = b"\x00".join(acks[index:index + len(group.members)])
        bhs = _swapped("BHS", group.bhs, batch.fhs, when,
                       _control_id("B", material + b"\x01" + str(number).encode() + own
                                   + (group.bhs.segment.encode("latin-1") if group.bhs else b"")), comment)
        segments.append(bhs)
        header = "".join(s + "\r" for s in segments)
        segments = []
        out.append(header.encode("latin-1", "replace"))
        for ack in acks[index:index + len(group.members)]:
            out.append(ack if ack.endswith(b"\r") else ack + b"\r")
        index += len(group.members)
        out.append(f"BTS{sep}{len(group.members)}\r".encode("latin-1"))
    if batch.fhs is not None:
        out.append(f"FTS{batch.fhs.field_sep}{len(groups)}\r".encode("latin-1"))
    return b"".join(out)
