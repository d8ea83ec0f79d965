"""Text tables for the operator commands: aligned columns, ``-`` for unset, fitted to a width.

``queue list`` fits the terminal (:func:`fit_list`): whole values when they
fit, else ids as their shortest unique prefix, times without milliseconds,
message types without their structure, and only then the free-text columns
cut with ``…``. Pure functions; agent/app/commands/render.py uses them.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "DEFAULT_WIDTH",
    "LIST_HEADERS",
    "SHORT_ID",
    "cell",
    "error_cell",
    "fit_list",
    "output_width",
    "table",
    "table_lines",
]

#: The columns of ``queue list`` and of ``queue retry --state … --dry-run``.
LIST_HEADERS = (
    "id",
    "channel",
    "seq",
    "state",
    "control id",
    "type",
    "attempts",
    "received",
    "error",
)
#: Width of a table when stdout is no terminal (and $COLUMNS is not set).
DEFAULT_WIDTH = 100
#: The shortest an id is shown in a narrow table: what every command accepts as a prefix.
SHORT_ID = 8

def cell(value: Any) -> str:  # noqa: ANN401 - any column value
    """A value as table text: ``-`` when it has none (NULL or empty), one line, no control characters."""
    if value is None or value == "":
        return "-"
    text = str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else " " for ch in text)


def table_lines(headers: Sequence[str], cells: Sequence[Sequence[str]], widths: Sequence[int], *,
                right: Iterable[int] = ()) -> list[str]:
    """The header and each row, padded to ``widths`` (cells longer than their width end in ``…``)."""
    right_set = set(right)

    def line(row: Sequence[str]) -> str:
        parts = []
        for i, (c, w) in enumerate(zip(row, widths, strict=True)):
            text = c if len(c) <= w else c[: max(0, w - 1)] + "…"
            parts.append(text.rjust(w) if i in right_set else text.ljust(w))
        return "  ".join(parts).rstrip()

    return [line(list(headers)), *(line(r) for r in cells)]


def table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Iterable[int] = ()
) -> str:
    """A plain aligned text table; ``right`` lists the numeric columns."""
    cells = [[cell(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    return "\n".join(table_lines(headers, cells, widths, right=right)) + "\n"


def output_width() -> int:
    """How wide a table may be: $COLUMNS when set, the terminal's width, else DEFAULT_WIDTH."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    except (AttributeError, ValueError, OSError):
        pass
    return DEFAULT_WIDTH


def error_cell(code: str | None, server_reason: str | None) -> str | None:
    """The ``error`` column: the error code, then the server's own words when it gave some."""
    if code and server_reason:
        return f"{code}: {server_reason}"
    return code or server_reason


def _unique_prefix(ids: Sequence[str]) -> int:
    """The shortest length (at least SHORT_ID) at which these ids all differ."""
    length = SHORT_ID
    longest = max((len(i) for i in ids), default=SHORT_ID)
    while length < longest and len({i[:length] for i in ids}) < len(set(ids)):
        length += 1
    return length


#: Columns that give up width, in this order, when the table is too wide
#: (index, narrowest): the error text first, then type, control id, channel.
_SHRINK = ((8, 16), (5, 9), (4, 10), (1, 8), (8, 5))


def fit_list(items: Sequence[dict[str, Any]], width: int) -> list[str]:
    """``queue list`` rows as table lines at most ``width`` columns wide, where that can be done.

    Everything whole when it fits. Else ids shrink to their shortest unique
    prefix (8 characters or more: every command takes it), then times lose
    their milliseconds (still RFC 3339), message types their structure
    (``ADT^A01^ADT_A01`` → ``ADT^A01``), then the error text, the message
    type, the control id and the channel are cut (ending in ``…``). The
    other columns are never cut; a terminal narrower than them gets longer lines.
    """
    ids = [str(i["id"]) for i in items]
    short = _unique_prefix(ids)

    def rows(id_len: int | None, millis: bool, full_type: bool) -> list[list[str]]:
        out = []
        for i in items:
            received = i["received_at"]
            if received and not millis and len(received) == 24:
                received = received[:19] + "Z"  # 2026-05-01T06:12:44.031Z -> …:44Z
            kind = str(i["message_type"] or "")
            if not full_type:
                kind = "^".join(kind.split("^")[:2])  # MSH-9.1 and 9.2: what people read
            out.append([
                cell(str(i["id"])[:id_len] if id_len else i["id"]), cell(i["channel"]), cell(i["seq"]),
                cell(i["state"]), cell(i["control_id"]), cell(kind), cell(i["attempts"]),
                cell(received), cell(error_cell(i["error_code"], i.get("server_reason"))),
            ])  # fmt: skip
        return out

    def natural(cells: list[list[str]]) -> list[int]:
        widths = [len(h) for h in LIST_HEADERS]
        for row in cells:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        return widths

    def total(widths: Sequence[int]) -> int:
        return sum(widths) + 2 * (len(widths) - 1)

    cells: list[list[str]] = []
    widths: list[int] = []
    for id_len, millis, full_type in ((None, True, True), (short, True, True), (short, False, True),
                                      (short, False, False)):
        cells = rows(id_len, millis, full_type)
        widths = natural(cells)
        if total(widths) <= width:
            return table_lines(LIST_HEADERS, cells, widths, right=(2, 6))
    for index, narrowest in _SHRINK:
        excess = total(widths) - width
        if excess <= 0:
            break
        floor = min(widths[index], max(narrowest, len(LIST_HEADERS[index])))
        widths[index] = max(floor, widths[index] - excess)
    return table_lines(LIST_HEADERS, cells, widths, right=(2, 6))
