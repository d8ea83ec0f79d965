"""How the operator commands show things: tables, JSON shapes, human text, progress.

Pure functions of the store's rows (agent/storage/rows.py); the JSON shapes
are documented in docs/queue-stats.schema.json, queue-list.schema.json and
queue-show.schema.json and only ever gain keys.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any

from agent.core.states import ALL, DEPTH, PURGEABLE, State
from agent.core.timefmt import compact_duration, human_bytes, rfc3339
from agent.storage.rows import ChannelFlags, LeaseRow, ListedRow, StateCount, StoredRow

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
    "error code",
)
_LIST_KEYS = (
    "id",
    "channel",
    "seq",
    "state",
    "control_id",
    "message_type",
    "attempts",
    "received_at",
    "error_code",
)
_TIME_FIELDS = (
    "received_at",
    "claimed_at",
    "sent_at",
    "settled_at",
    "updated_at",
    "next_attempt_at",
)


class Progress:
    """``label done/total`` rewritten in place on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.total = total
        self.done = 0
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self._shown = False

    def advance(self, n: int) -> None:
        self.done += n
        if self.enabled:
            self.stream.write(f"\r{self.label} {self.done}/{self.total}")
            self.stream.flush()
            self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()


# -- values ----------------------------------------------------------------------


def ts(value: float | None) -> str | None:
    """RFC 3339 UTC, or None for an unset timestamp."""
    return rfc3339(float(value)) if value else None


def decode(data: bytes | str | None, encoding: str | None) -> str | None:
    """Text of a stored body or ACK for display, never raising on odd bytes."""
    if data is None:
        return None
    if isinstance(data, str):
        return data
    try:
        return data.decode(encoding or "utf-8", errors="replace")
    except LookupError:
        return data.decode("utf-8", errors="replace")


def segments(text: str) -> list[str]:
    """HL7 segments of a message or ACK: ``\\r`` (and sloppy ``\\n``) end each one."""
    return [s for s in text.replace("\r\n", "\r").replace("\n", "\r").split("\r") if s]


def table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Iterable[int] = ()
) -> str:
    """A plain aligned text table; ``right`` lists the numeric columns."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    right_set = set(right)

    def line(row: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right_set else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)]) + "\n"


def lines_form(body: bytes) -> bytes:
    """``export --format lines``: one segment per line (``\\r``/``\\r\\n`` segment ends become ``\\n``)."""
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return text if text.endswith(b"\n") else text + b"\n"


# -- queue stats -------------------------------------------------------------------


def stats_document(
    data: dict[str, Any],
    *,
    configured: list[str],
    settled: Iterable[StateCount],
    flags: Iterable[ChannelFlags],
    meta: dict[str, str],
    now: float,
) -> dict[str, Any]:
    """The ``queue stats --json`` object: the store's stats with keys added (never removed).

    Added: ``generated_at``; per channel the terminal counts, ``configured``,
    ``paused_at``/``paused_reason``; ``db.agent_id``/``db.schema_version``.
    """
    channels: dict[str, dict[str, Any]] = data["channels"]
    blank: dict[str, Any] = {**dict.fromkeys(DEPTH, 0), "oldest_queued_age_s": None, "paused": False}
    for entry in channels.values():
        entry.update(dict.fromkeys(PURGEABLE, 0))
    for count in settled:
        entry = channels.setdefault(count.channel, {**blank, **dict.fromkeys(PURGEABLE, 0)})
        entry[count.state] = int(count.n)
    by_name = {f.channel: f for f in flags}
    for name, entry in channels.items():
        flag = by_name.get(name)
        entry["configured"] = name in configured
        entry["paused_at"] = ts(flag.paused_at) if flag and flag.paused else None
        entry["paused_reason"] = flag.paused_reason if flag and flag.paused else None
    data["channels"] = dict(sorted(channels.items()))
    data["db"]["agent_id"] = meta.get("agent_id")
    data["db"]["schema_version"] = int(meta["schema_version"]) if "schema_version" in meta else None
    data["generated_at"] = rfc3339(now)
    return data


def render_stats(data: dict[str, Any], lease_row: LeaseRow | None, now: float) -> str:
    out: list[str] = []
    d = data["db"]
    # SQLite: the file and its WAL; PostgreSQL: the masked dsn (the server keeps its own WAL).
    wal = f", WAL {human_bytes(d['wal_bytes'])}" if d.get("wal_bytes") is not None else ""
    out.append(
        f"database  {d.get('path') or d.get('dsn')}  ({human_bytes(d['size_bytes'])}{wal})"
        f"  agent.id {d.get('agent_id')}  schema {d.get('schema_version')}"
    )
    lease = data["lease"]
    if lease is not None:
        expires = lease_row.expires_at if lease_row else None
        left = f" (in {compact_duration(float(expires) - now)})" if expires else ""
        out.append(
            f"lease     {lease['holder']}  epoch {lease['epoch']}  expires {lease['expires_at']}{left}"
        )
    elif lease_row is not None and lease_row.holder is not None:
        out.append(
            f"lease     none held (last holder {lease_row.holder}, epoch {lease_row.epoch}, "
            f"expired {ts(lease_row.expires_at)})"
        )
    else:
        out.append("lease     none held" + (f" (epoch {lease_row.epoch})" if lease_row else ""))
    out.append("")
    st = data["states"]
    out.append(table(list(ALL), [[st.get(s, 0) for s in ALL]], right=range(len(ALL))))
    headers = ["channel", *DEPTH, State.FAILED, State.REJECTED, "oldest queued", "paused"]
    rows = []
    for name, c in data["channels"].items():
        paused = "yes" if c["paused"] else "no"
        if c["paused"] and c.get("paused_reason"):
            paused += f" ({c['paused_reason']}, {c.get('paused_at')})"
        label = name if c.get("configured", True) else f"{name} (not configured)"
        queued, claimed, inflight = (c[s] for s in DEPTH)
        failed, rejected = c.get(State.FAILED, 0), c.get(State.REJECTED, 0)
        rows.append(
            [
                label,
                queued,
                claimed,
                inflight,
                failed,
                rejected,
                compact_duration(c["oldest_queued_age_s"]),
                paused,
            ]
        )
    if rows:
        out.append(table(headers, rows, right=range(1, 7)))
    else:
        out.append("no channels\n")
    return "\n".join(out)


# -- queue list --------------------------------------------------------------------


def list_item(row: ListedRow, *, show_body: bool) -> dict[str, Any]:
    """One ``queue list --json`` entry (docs/queue-list.schema.json)."""
    item: dict[str, Any] = {
        "id": row.id, "channel": row.channel, "seq": row.seq, "state": row.state,
        "control_id": row.control_id, "message_type": row.message_type, "attempts": row.attempts,
        "received_at": ts(row.received_at), "error_code": row.error_code, "remote": row.remote,
        "updated_at": ts(row.updated_at),
    }  # fmt: skip
    if show_body:
        item["encoding"] = row.encoding
        item["body"] = decode(row.body, row.encoding)
    return item


def render_list(items: list[dict[str, Any]], *, show_body: bool) -> str:
    """``queue list`` as a table; with bodies, one small table per row and its segments."""
    if not show_body:
        return table(LIST_HEADERS, [[i[k] for k in _LIST_KEYS] for i in items], right=(2, 6))
    out: list[str] = []
    for item in items:
        out.append(table(LIST_HEADERS, [[item[k] for k in _LIST_KEYS]], right=(2, 6)))
        out.extend(f"    {seg}\n" for seg in segments(item["body"] or ""))
        out.append("\n")
    return "".join(out)


def state_table(rows: Iterable[ListedRow]) -> str:
    """``queue retry --state … --dry-run``: the rows that would move, in delivery order."""
    return table(
        LIST_HEADERS,
        [[r.id, r.channel, r.seq, r.state, r.control_id, r.message_type, r.attempts,
          ts(r.received_at), r.error_code] for r in rows],
        right=(2, 6),
    )  # fmt: skip


# -- queue show --------------------------------------------------------------------


def show_fields(row: StoredRow) -> dict[str, Any]:
    """Every column but the body, in display form (RFC 3339 times, ACKs as text)."""
    encoding = row.encoding
    out: dict[str, Any] = {}
    for f in dataclasses.fields(row):
        key, value = f.name, getattr(row, f.name)
        if key == "body":
            out["body_bytes"] = len(value)
        elif key in _TIME_FIELDS:
            out[key] = ts(value)
        elif key in ("ack_sent", "app_ack"):
            out[key] = decode(value, encoding)
        else:
            out[key] = value
    out["attempts_since_redrive"] = int(row.attempts) - int(row.redrive_base)
    return out


def render_show(fields: dict[str, Any]) -> str:
    out: list[str] = []
    blocks = ("ack_sent", "app_ack", "server_ack")
    width = max(len(k) for k in fields)
    for key, value in fields.items():
        if key in blocks:
            continue
        out.append(f"{key.ljust(width)}  {'-' if value is None else value}")
    titles = {"ack_sent": "ACK sent to the source (intake)",
              "app_ack": "application ACK owed/relayed to the source",
              "server_ack": "server's ACK (transmit_response)"}  # fmt: skip
    for key in blocks:
        value = fields.get(key)
        out.append("")
        out.append(f"{titles[key]}:" if value else f"{titles[key]}: -")
        for seg in segments(value or ""):
            out.append(f"    {seg}")
    return "\n".join(out) + "\n"
