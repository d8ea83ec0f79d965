"""How the operator commands show things: tables, JSON shapes, human text, progress.

Pure functions of the store's rows (agent/storage/rows.py); the JSON shapes
are documented in docs/queue-stats.schema.json, queue-list.schema.json and
queue-show.schema.json and only ever gain keys. Tables and their fitting
to the terminal are agent/app/commands/tables.py; in text, a field without a
value (NULL or empty) is always shown as ``-``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import unicodedata
from collections.abc import Iterable
from typing import IO, Any

from agent.app.commands.tables import (
    DEFAULT_WIDTH,
    LIST_HEADERS,
    SHORT_ID,
    cell,
    error_cell,
    fit_list,
    output_width,
    table,
    table_lines,
)
from agent.core.partition import key_hash
from agent.core.states import ALL, DEPTH, PURGEABLE, State
from agent.core.timefmt import compact_duration, human_bytes, rfc3339
from agent.storage.rows import ChannelFlags, LeaseRow, ListedRow, StateCount, StoredRow
from agent.storage.store_operator import OUTBOUND_META_PREFIX

__all__ = [
    "DEFAULT_WIDTH",
    "LIST_HEADERS",
    "SHORT_ID",
    "Progress",
    "cell",
    "decode",
    "error_cell",
    "fit_list",
    "list_item",
    "output_width",
    "raw_for_terminal",
    "render_list",
    "render_show",
    "render_stats",
    "segments",
    "show_fields",
    "state_table",
    "stats_document",
    "table",
    "table_lines",
    "ts",
]

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
    ``paused_at``/``paused_reason``, for an outbound channel ``outbound``;
    ``db.agent_id``/``db.schema_version``.
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
    for name, entry in channels.items():
        # An outbound channel's connection, as the daemon last recorded it.
        raw = meta.get(f"{OUTBOUND_META_PREFIX}{name}")
        if raw is not None:
            with contextlib.suppress(ValueError):
                entry["outbound"] = json.loads(raw)
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
        # Not held: past its expiry, or its holder's process is provably gone before it.
        expires = lease_row.expires_at
        ended = ("its process has exited" if expires is not None and float(expires) > now
                 else f"expired {ts(expires)}")
        out.append(f"lease     none held (last holder {lease_row.holder}, epoch {lease_row.epoch}, {ended})")
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
    blocked = [(name, b) for name, c in data["channels"].items() for b in c.get("blocked_partitions", ())]
    if blocked:
        out.append("blocked partitions (a key by its hash; the other keys go on)")
        out.append(table(
            ["channel", "key", "why", "head", "seq", "rows", "head age", "attempts", "next try / reason"],
            [[name, b["key_hash"], b["why"], b["head_id"] or "-", b["head_seq"] or "-", b["depth"],
              compact_duration(b["head_age_s"]), b["attempts"],
              compact_duration(b["next_attempt_in_s"]) if b["why"] == "retrying" else (b["paused_reason"] or "")]
             for name, b in blocked],
            right=(4, 5, 7),
        ))
    for name, c in data["channels"].items():
        ob = c.get("outbound")
        if isinstance(ob, dict):
            error = f", last error: {ob.get('last_error')}" if ob.get("state") != "connected" and ob.get("last_error") else ""
            out.append(f"outbound  {name}  {ob.get('state')} to {ob.get('connect')} since {ob.get('since')}"
                       f"{error}  (pid {ob.get('pid')})")
    return "\n".join(out)


# -- queue list --------------------------------------------------------------------


def list_item(row: ListedRow, *, show_body: bool, key_secret: str) -> dict[str, Any]:
    """One ``queue list --json`` entry (docs/queue-list.schema.json); ``error_text``, ``server_reason`` added.

    ``key_secret``: the queue's (``store.key_hash_secret()``), for the partition key's hash.
    """
    item: dict[str, Any] = {
        "id": row.id, "channel": row.channel, "seq": row.seq, "state": row.state,
        "control_id": row.control_id, "message_type": row.message_type, "attempts": row.attempts,
        "received_at": ts(row.received_at), "error_code": row.error_code, "remote": row.remote,
        "updated_at": ts(row.updated_at), "error_text": row.error_text,
        "server_reason": row.server_reason,
        "partition": key_hash(row.partition_key, key_secret) if row.partition_key is not None else None,
    }  # fmt: skip
    if show_body:
        item["encoding"] = row.encoding
        item["body"] = decode(row.body, row.encoding)
    return item


def render_list(items: list[dict[str, Any]], *, show_body: bool, width: int = DEFAULT_WIDTH) -> str:
    """``queue list`` as a table fitted to ``width``; with bodies, each row's segments under it."""
    lines = fit_list(items, width)
    if not show_body:
        return "\n".join(lines) + "\n"
    out: list[str] = [lines[0] + "\n"]
    for item, line in zip(items, lines[1:], strict=True):
        out.append(line + "\n")
        out.extend(f"    {seg}\n" for seg in segments(item["body"] or ""))
        out.append("\n")
    return "".join(out)


def state_table(rows: Iterable[ListedRow], key_secret: str) -> str:
    """``queue retry --state … --dry-run``: the rows that would move, in delivery order, ids whole.

    Not fitted to the terminal: it names exactly which rows a re-drive would
    move, so every id is shown in full.
    """
    items = [list_item(r, show_body=False, key_secret=key_secret) for r in rows]
    return render_list(items, show_body=False, width=sys.maxsize)


# -- queue show --------------------------------------------------------------------


def show_fields(row: StoredRow) -> dict[str, Any]:
    """Every column but the body, in display form (RFC 3339 times, ACKs as text).

    Values stay as stored (an empty MSH field is ``""``, an unset column
    None) — the JSON shape; :func:`render_show` writes both as ``-``.
    ``server_reason`` comes right after ``server_status``.
    """
    encoding = row.encoding
    out: dict[str, Any] = {}
    for f in dataclasses.fields(row):
        key, value = f.name, getattr(row, f.name)
        if key == "server_reason":
            continue
        if key == "body":
            out["body_bytes"] = len(value)
        elif key in _TIME_FIELDS:
            out[key] = ts(value)
        elif key in ("ack_sent", "app_ack"):
            out[key] = decode(value, encoding)
        else:
            out[key] = value
        if key == "server_status":
            out["server_reason"] = row.server_reason
    out["attempts_since_redrive"] = int(row.attempts) - int(row.redrive_base)
    return out


def render_show(fields: dict[str, Any]) -> str:
    """``queue show`` as text: one field a line, then the three ACKs a segment a line; unset is ``-``."""
    out: list[str] = []
    blocks = ("ack_sent", "app_ack", "server_ack")
    width = max(len(k) for k in fields)
    for key, value in fields.items():
        if key in blocks:
            continue
        out.append(f"{key.ljust(width)}  {cell(value)}")
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


# -- queue show --raw on a terminal ----------------------------------------------------


def raw_for_terminal(body: bytes, encoding: str | None) -> str:
    """A stored message for a person at a terminal: a segment per line, nothing that moves the cursor.

    HL7 ends segments with CR, which sends a terminal's cursor back to the
    start of the line, so the raw bytes draw each segment over the last.
    Here each segment gets its own line, and any other control character
    (an escape sequence in hostile bytes, a stray VT or FS) is shown as
    ``\\xNN``/``\\uNNNN`` instead of acting. Redirected output gets the exact bytes.
    """
    text = decode(body, encoding) or ""
    lines = text.replace("\r\n", "\r").replace("\n", "\r").split("\r")
    if lines and lines[-1] == "":
        lines.pop()

    def visible(ch: str) -> str:
        if ch == "\t" or ch.isprintable() or unicodedata.category(ch) == "Zs":
            return ch
        code = ord(ch)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return "".join("".join(visible(ch) for ch in line) + "\n" for line in lines)
