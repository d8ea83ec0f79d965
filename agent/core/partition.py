"""Partition keys: which rows of a partitioned channel must keep their order among themselves.

A channel's ``partition_key`` names one or more HL7 field paths (comma
separated, e.g. ``"PID-3.1"`` or ``"MSH-4,PID-3.1"``). The key of a message
is the value at each path, unescaped, joined by U+001F (the ASCII unit
separator); an absent field gives an empty part, and a message where every
path is absent has the key ``""`` (docs/queue.md#partitioned-channels).

The path syntax (docs/configuration.md#partitioned-channels)::

    SEG-F[R].C.S     SEG  a segment id: three upper-case letters or digits (Z-segments too);
                          the first segment of that id in the message
                     F    field number (MSH-1 is the field separator, MSH-2 the
                          encoding characters, as HL7 counts them)
                     [R]  repetition, from 1 (optional; the first by default)
                     .C   component, from 1 (optional)
                     .S   subcomponent, from 1 (optional; needs .C)

Without ``.C`` the value is the whole repetition, its component separators
included (escape sequences in it are still unescaped). Unescaping follows
HL7 v2 section 2.7.4 (the escape sequences for the delimiters): ``\\F\\``
``\\S\\`` ``\\T\\`` ``\\R\\`` ``\\E\\`` (and ``\\P\\``, the v2.7 truncation
character) become the delimiter the message declares in MSH-1/MSH-2; every
other escape sequence (formatting, ``\\X..\\`` hex, character-set changes)
is kept as written. Two spellings that differ only in such a sequence give
two keys; a collision (two values giving one key) only puts two patients in
one partition — more order, never less.

Pure: no I/O, no hl7 library (it does not unescape sub-components, and this
needs nothing beyond splitting on the declared delimiters).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["KEY_SEPARATOR", "FieldPath", "PartitionKey", "key_hash", "parse_partition_key", "shown_key"]

#: Joins the parts of a key of several paths (U+001F, the ASCII unit separator).
KEY_SEPARATOR = "\x1f"

_PATH = re.compile(
    r"(?P<seg>[A-Z][A-Z0-9]{2})-(?P<field>[1-9][0-9]{0,2})"
    r"(?:\[(?P<rep>[1-9][0-9]{0,2})\])?"
    r"(?:\.(?P<comp>[1-9][0-9]{0,2})(?:\.(?P<sub>[1-9][0-9]{0,2}))?)?"
)
_DEFAULT_ENCODING = "^~\\&"


@dataclass(frozen=True, slots=True)
class FieldPath:
    """One HL7 field path, numbers as HL7 counts them (from 1); None: not addressed."""

    segment: str
    field: int
    repetition: int = 1
    component: int | None = None
    subcomponent: int | None = None

    def __str__(self) -> str:
        text = f"{self.segment}-{self.field}"
        if self.repetition != 1:
            text += f"[{self.repetition}]"
        if self.component is not None:
            text += f".{self.component}"
        if self.subcomponent is not None:
            text += f".{self.subcomponent}"
        return text


@dataclass(frozen=True, slots=True)
class PartitionKey:
    """A channel's parsed ``partition_key``: the paths whose values make a message's key."""

    paths: tuple[FieldPath, ...]

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.paths)

    def of(self, text: str) -> str:
        """The key of ``text`` (a decoded message, segments ended by CR or LF)."""
        return key_of(text, self.paths)


@lru_cache(maxsize=64)
def parse_partition_key(spec: str) -> PartitionKey:
    """Parse ``"PID-3.1"`` / ``"MSH-4,PID-3[2].1"``; ValueError saying what is wrong."""
    paths: list[FieldPath] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item and spec.strip():
            raise ValueError(f"{spec!r} has an empty path between commas (or a comma at an end): "
                             "separate paths by single commas, e.g. MSH-4,PID-3.1")
        match = _PATH.fullmatch(item)
        if match is None:
            raise ValueError(
                f"{item!r} is not an HL7 field path: write SEGMENT-FIELD[REPETITION].COMPONENT.SUBCOMPONENT,"
                " e.g. PID-3.1 or PID-3[2].1 (repetition, component and subcomponent optional)"
            )
        path = FieldPath(
            match["seg"], int(match["field"]), int(match["rep"] or 1),
            int(match["comp"]) if match["comp"] else None, int(match["sub"]) if match["sub"] else None,
        )
        if path.segment == "MSH" and path.field <= 2 and (path.component or path.repetition != 1):
            raise ValueError(f"{item!r}: MSH-1 and MSH-2 are the delimiters; they have no components")
        if path in paths:
            raise ValueError(f"{item!r} is named twice")
        paths.append(path)
    return PartitionKey(tuple(paths))


def shown_key(key: str) -> str:
    """The key as the server and operators see it: ``""`` when every part is absent.

    The queue keeps the stored form (the parts' separators alone, ``"\\x1f"``
    for two paths), which rows queued by earlier versions carry too: changing
    it would split one key's rows into two partitions and could reorder them.
    """
    return "" if key and not key.strip(KEY_SEPARATOR) else key


def key_hash(key: str, secret: str) -> str:
    """A short, stable name for a key where the value must not show (logs, stats, the page).

    Keyed with the queue's own ``secret`` (HMAC-SHA-256, RFC 2104; the
    database keeps it: agent/storage/schema.py): a key is often a medical
    record number, and a plain hash of a few digits is undone by hashing
    every number until one matches.
    """
    value = shown_key(key).encode("utf-8", "surrogatepass")
    return hmac.new(secret.encode("ascii"), value, hashlib.sha256).hexdigest()[:12]


# -- extraction ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Delims:
    field: str
    component: str
    repetition: str
    escape: str  # "" when the message declares none
    subcomponent: str
    truncation: str  # "" when the message declares none (before v2.7)


def _delimiters(msh: str) -> _Delims | None:
    if len(msh) < 4:
        return None
    field = msh[3]
    encoding = msh[4:].split(field, 1)[0]

    def char(index: int) -> str:
        if len(encoding) > index:
            return encoding[index]
        return _DEFAULT_ENCODING[index] if index < len(_DEFAULT_ENCODING) and not encoding else ""

    return _Delims(field, char(0), char(1), char(2), char(3), char(4))


def key_of(text: str, paths: tuple[FieldPath, ...]) -> str:
    """The key of ``text`` for ``paths``: unescaped values joined by U+001F."""
    segments = text.replace("\r\n", "\r").replace("\n", "\r").split("\r")
    if not segments or not segments[0].startswith("MSH"):
        return KEY_SEPARATOR.join("" for _ in paths)
    delims = _delimiters(segments[0])
    if delims is None:
        return KEY_SEPARATOR.join("" for _ in paths)
    found: dict[str, list[str]] = {}
    for segment in segments:
        name = segment.split(delims.field, 1)[0]
        if name not in found and any(p.segment == name for p in paths):
            found[name] = segment.split(delims.field)
    return KEY_SEPARATOR.join(_value(found.get(p.segment), p, delims) for p in paths)


def _value(fields: list[str] | None, path: FieldPath, d: _Delims) -> str:
    if fields is None:
        return ""
    if fields[0] == "MSH":
        if path.field == 1:
            return d.field
        # MSH-1 is the separator itself, so MSH-n sits at index n - 1.
        index = path.field - 1
        if path.field == 2:
            return fields[1] if len(fields) > 1 else ""
    else:
        index = path.field
    if index >= len(fields):
        return ""
    reps = fields[index].split(d.repetition) if d.repetition else [fields[index]]
    if path.repetition > len(reps):
        return ""
    value = reps[path.repetition - 1]
    if path.component is not None:
        comps = value.split(d.component) if d.component else [value]
        if path.component > len(comps):
            return ""
        value = comps[path.component - 1]
        if path.subcomponent is not None:
            subs = value.split(d.subcomponent) if d.subcomponent else [value]
            if path.subcomponent > len(subs):
                return ""
            value = subs[path.subcomponent - 1]
    return unescape(value, d)


def unescape(value: str, d: _Delims) -> str:
    """HL7 v2 section 2.7.4: the delimiter escapes become their characters; others stay as written."""
    esc = d.escape
    if not esc or esc not in value:
        return value
    table = {"F": d.field, "S": d.component, "T": d.subcomponent, "R": d.repetition, "E": esc}
    if d.truncation:
        table["P"] = d.truncation
    out: list[str] = []
    i = 0
    while i < len(value):
        ch = value[i]
        if ch == esc:
            end = value.find(esc, i + 1)
            if end == -1:
                out.append(value[i:])
                break
            name = value[i + 1:end]
            out.append(table.get(name, value[i:end + 1]))
            i = end + 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)
