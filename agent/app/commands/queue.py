"""Operator commands: ``hl7-agent queue stats|list|show|retry|purge|export`` and
``hl7-agent channel pause|resume`` (SPEC 2, SPEC 6).

They work on the same database file as a running daemon, so they are built
to be polite neighbours: the file is opened with ``db.open_existing`` (never
created: SPEC 2 "read-only commands never create a database"), reads run in
autocommit under ``PRAGMA query_only``, and every write is one short guarded
statement in its own ``BEGIN IMMEDIATE`` over at most a batch of rows, so the
daemon's group commit never waits long behind an operator. A lock held past
``busy_timeout`` is one clear line and exit 1.

Guards live in the SQL (``queue/operator.sql``), not only here: a re-drive
moves only ``failed``/``rejected`` rows and a purge deletes only terminal rows,
whatever the caller passed. Purging never deletes dedupe keys (SPEC 6).

Nothing here logs: stdout carries the answer (tables or JSON), stderr carries
errors, notes and, on a terminal only, progress.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import getpass
import json
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from agent.app.config import Settings, parse_duration
from agent.core import states
from agent.core.mllp import encode_frame
from agent.core.timefmt import compact_duration, human_bytes, rfc3339
from agent.errors import DatabaseLocked, IncompatibleDatabase, StorageError, UsageError
from agent.storage import sqlite as db
from agent.storage.store import SqliteStore

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

RETRY_BATCH = 500
PURGE_BATCH = 1000
EXPORT_BATCH = 500
#: The shortest id prefix ``queue show`` resolves (8 hex digits: collisions are rare).
MIN_ID_PREFIX = 8

#: Terminal states an operator may purge; ``failed`` too (never automatically, SPEC 6).
PURGEABLE = ("processed", "rejected", "failed", "nacked")
REDRIVABLE = ("failed", "rejected")

Command = Callable[[Settings, argparse.Namespace], int]


# -- plumbing ------------------------------------------------------------------


def _err(message: str) -> None:
    print(f"hl7-agent: {message}", file=sys.stderr)


def _command(fn: Command) -> Command:
    """Common exit paths: a closed pipe (``queue list | head``) ends quietly with 1."""

    @functools.wraps(fn)
    def wrapper(settings: Settings, args: argparse.Namespace) -> int:
        try:
            return fn(settings, args)
        except BrokenPipeError:
            # Python docs, "Note on SIGPIPE": point stdout at devnull so the
            # interpreter's final flush does not raise a second time.
            with contextlib.suppress(OSError, ValueError, AttributeError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            return EXIT_FAILURE

    return wrapper


def _locked(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


@contextlib.contextmanager
def open_store(settings: Settings, *, write: bool) -> Iterator[SqliteStore]:
    """The queue database of ``settings``, never created; sqlite errors become one line.

    ``write=False`` sets ``PRAGMA query_only`` so a read command cannot change
    the file even by a bug. ``write=True`` checks the file belongs to this
    ``agent.id`` first (SPEC 6: two agents never share a queue by mistake).
    """
    from agent.app.service import db_options, make_store

    try:
        conn = db.open_existing(settings.db_path, db_options(settings))
    except sqlite3.Error as exc:
        if _locked(exc):
            raise _locked_error(settings) from exc
        raise StorageError(f"cannot open queue database {settings.db_path}: {exc}") from exc
    try:
        store = make_store(conn, settings)
        if write:
            owner = dict(conn.execute(store.q["op_meta"]).fetchall()).get("agent_id")
            if owner is not None and owner != settings.agent.id:
                raise IncompatibleDatabase(
                    f"the queue database at {settings.db_path} belongs to agent.id {owner!r}, "
                    f"not {settings.agent.id!r}: check --config"
                )
        else:
            conn.execute("PRAGMA query_only = 1")
        yield store
    except sqlite3.Error as exc:
        if _locked(exc):
            raise _locked_error(settings) from exc
        raise StorageError(f"queue database error: {exc}") from exc
    finally:
        conn.close()


def _locked_error(settings: Settings) -> DatabaseLocked:
    return DatabaseLocked(
        f"the queue database {settings.db_path} stayed locked by another process beyond "
        f"busy_timeout ({settings.queue.busy_timeout:g}s); nothing was changed, try again"
    )


@contextlib.contextmanager
def _write_txn(conn: sqlite3.Connection) -> Iterator[None]:
    """One short BEGIN IMMEDIATE … COMMIT (the daemon keeps writing between ours)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


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


# -- value helpers -------------------------------------------------------------


def _ts(value: float | None) -> str | None:
    """RFC 3339 UTC, or None for an unset timestamp."""
    return rfc3339(float(value)) if value else None


def _decode(data: bytes | str | None, encoding: str | None) -> str | None:
    """Text of a stored body or ACK for display, never raising on odd bytes."""
    if data is None:
        return None
    if isinstance(data, str):
        return data
    try:
        return data.decode(encoding or "utf-8", errors="replace")
    except LookupError:
        return data.decode("utf-8", errors="replace")


def _segments(text: str) -> list[str]:
    """HL7 segments of a message or ACK: ``\\r`` (and sloppy ``\\n``) end each one."""
    return [s for s in text.replace("\r\n", "\r").replace("\n", "\r").split("\r") if s]




def _table(
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


def parse_since(text: str, now: float) -> float:
    """``--since``: a duration back from now (``2h``) or an RFC 3339 time with its offset."""
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"--since {text!r}: give a duration (30m, 2h, 7d) or an RFC 3339 time "
            "(2024-05-01T08:00:00Z)"
        ) from None
    if when.tzinfo is None:
        # RFC 3339 requires the offset; guessing local vs UTC would shift the window silently.
        raise UsageError(f"--since {text!r}: add a time zone offset (Z or +02:00)")
    return when.timestamp()


def _check_state(value: str, flag: str = "--state") -> str:
    state = value.strip().lower()
    if state not in states.ALL:
        raise UsageError(f"{flag} {value!r}: use one of {', '.join(states.ALL)}")
    return state


def _channel_note(settings: Settings, channel: str | None) -> None:
    """A typo in --channel otherwise looks like an empty queue."""
    if channel is not None and channel not in {c.name for c in settings.channels}:
        print(f"note: channel {channel!r} is not in the configuration", file=sys.stderr)


# -- queue stats ---------------------------------------------------------------


def collect_stats(store: SqliteStore, configured: list[str]) -> dict[str, Any]:
    """SPEC 2's ``queue stats --json`` object, with keys added (never removed).

    Added: ``generated_at``; per channel the terminal counts, ``configured``,
    ``paused_at``/``paused_reason``; ``db.agent_id``/``db.schema_version``.
    """
    data = store.stats(configured)
    channels: dict[str, dict[str, Any]] = data["channels"]
    blank = {"queued": 0, "claimed": 0, "inflight": 0, "oldest_queued_age_s": None, "paused": False}
    for entry in channels.values():
        entry.update({s: 0 for s in PURGEABLE})
    for name, state, n in store.conn.execute(store.q["op_settled_by_channel"]):
        entry = channels.setdefault(name, {**blank, **{s: 0 for s in PURGEABLE}})
        entry[state] = int(n)
    flags = {r[0]: r for r in store.conn.execute(store.q["channel_flags"])}
    for name, entry in channels.items():
        flag = flags.get(name)
        entry["configured"] = name in configured
        entry["paused_at"] = _ts(flag[3]) if flag and flag[2] else None
        entry["paused_reason"] = flag[4] if flag and flag[2] else None
    data["channels"] = dict(sorted(channels.items()))
    meta = dict(store.conn.execute(store.q["op_meta"]).fetchall())
    data["db"]["agent_id"] = meta.get("agent_id")
    data["db"]["schema_version"] = int(meta["schema_version"]) if "schema_version" in meta else None
    data["generated_at"] = rfc3339(store.clock())
    return data


def render_stats(data: dict[str, Any], lease_row: Sequence[Any] | None, now: float) -> str:
    out: list[str] = []
    d = data["db"]
    out.append(
        f"database  {d['path']}  ({human_bytes(d['size_bytes'])}, WAL {human_bytes(d['wal_bytes'])})"
        f"  agent.id {d.get('agent_id')}  schema {d.get('schema_version')}"
    )
    lease = data["lease"]
    if lease is not None:
        expires = lease_row[6] if lease_row else None
        left = f" (in {compact_duration(float(expires) - now)})" if expires else ""
        out.append(
            f"lease     {lease['holder']}  epoch {lease['epoch']}  expires {lease['expires_at']}{left}"
        )
    elif lease_row is not None and lease_row[0] is not None:
        out.append(
            f"lease     none held (last holder {lease_row[0]}, epoch {lease_row[5]}, "
            f"expired {_ts(lease_row[6])})"
        )
    else:
        out.append("lease     none held" + (f" (epoch {lease_row[5]})" if lease_row else ""))
    out.append("")
    st = data["states"]
    out.append(
        _table(list(states.ALL), [[st.get(s, 0) for s in states.ALL]], right=range(len(states.ALL)))
    )
    headers = [
        "channel",
        "queued",
        "claimed",
        "inflight",
        "failed",
        "rejected",
        "oldest queued",
        "paused",
    ]
    rows = []
    for name, c in data["channels"].items():
        paused = "yes" if c["paused"] else "no"
        if c["paused"] and c.get("paused_reason"):
            paused += f" ({c['paused_reason']}, {c.get('paused_at')})"
        label = name if c.get("configured", True) else f"{name} (not configured)"
        rows.append(
            [
                label,
                c["queued"],
                c["claimed"],
                c["inflight"],
                c.get("failed", 0),
                c.get("rejected", 0),
                compact_duration(c["oldest_queued_age_s"]),
                paused,
            ]
        )
    if rows:
        out.append(_table(headers, rows, right=range(1, 7)))
    else:
        out.append("no channels\n")
    return "\n".join(out)


@_command
def cmd_stats(settings: Settings, args: argparse.Namespace) -> int:
    """``queue stats [--json]``."""
    names = [c.name for c in settings.channels]
    with open_store(settings, write=False) as store:
        data = collect_stats(store, names)
        lease_row = store.conn.execute(store.q["lease_row"]).fetchone()
        now = store.clock()
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(render_stats(data, lease_row, now))
    sys.stdout.flush()
    return EXIT_OK


# -- queue list ----------------------------------------------------------------

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


def _list_row(row: sqlite3.Row | tuple[Any, ...], *, show_body: bool) -> dict[str, Any]:
    (
        id_,
        channel,
        seq,
        state,
        control_id,
        message_type,
        attempts,
        received_at,
        error_code,
        remote,
        updated_at,
        encoding,
        body,
    ) = row
    item: dict[str, Any] = {
        "id": id_, "channel": channel, "seq": seq, "state": state, "control_id": control_id,
        "message_type": message_type, "attempts": attempts, "received_at": _ts(received_at),
        "error_code": error_code, "remote": remote, "updated_at": _ts(updated_at),
    }  # fmt: skip
    if show_body:
        item["encoding"] = encoding
        item["body"] = _decode(body, encoding)
    return item


@_command
def cmd_list(settings: Settings, args: argparse.Namespace) -> int:
    """``queue list``: rows newest first (received_at DESC), bodies only on request."""
    state = _check_state(args.state) if args.state else None
    if args.limit < 0:
        raise UsageError("--limit must be >= 0 (0 = no limit)")
    now = time.time()
    since = parse_since(args.since, now) if args.since else None
    _channel_note(settings, args.channel)
    with open_store(settings, write=False) as store:
        cur = store.conn.execute(
            store.q["op_list"],
            {
                "state": state,
                "channel": args.channel,
                "since": since,
                "control_id": args.control_id,
                "limit": args.limit or -1,
                "show_body": 1 if args.show_body else 0,
            },
        )
        items = [_list_row(r, show_body=args.show_body) for r in cur]
    if args.json:
        sys.stdout.write(json.dumps(items, indent=2) + "\n")
        return EXIT_OK
    if not items:
        print("no rows match", file=sys.stderr)
        return EXIT_OK
    keys = (
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
    if not args.show_body:
        sys.stdout.write(_table(LIST_HEADERS, [[i[k] for k in keys] for i in items], right=(2, 6)))
    else:
        for item in items:
            sys.stdout.write(_table(LIST_HEADERS, [[item[k] for k in keys]], right=(2, 6)))
            for seg in _segments(item["body"] or ""):
                sys.stdout.write(f"    {seg}\n")
            sys.stdout.write("\n")
    if len(items) == args.limit:
        print(f"(first {args.limit} rows; --limit N for more, 0 for all)", file=sys.stderr)
    sys.stdout.flush()
    return EXIT_OK


# -- queue show ----------------------------------------------------------------

_TIME_FIELDS = (
    "received_at",
    "claimed_at",
    "sent_at",
    "settled_at",
    "updated_at",
    "next_attempt_at",
)


def _resolve_id(store: SqliteStore, text: str) -> str | None:
    """A full id, or a unique prefix of at least MIN_ID_PREFIX characters."""
    text = text.strip().lower()
    if store.conn.execute(store.q["op_row_state"], {"id": text}).fetchone() is not None:
        return text
    if len(text) < MIN_ID_PREFIX:
        return None
    found = [r[0] for r in store.conn.execute(store.q["op_ids_by_prefix"], {"prefix": text})]
    if len(found) > 1:
        raise _NotFound(f"id prefix {text!r} matches several rows; give more of the id")
    return found[0] if found else None


class _NotFound(Exception):
    """An id the operator named does not exist (exit 1, one line)."""


def show_fields(row: dict[str, Any]) -> dict[str, Any]:
    """Every column but the body, in display form (RFC 3339 times, ACKs as text)."""
    encoding = row.get("encoding")
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "body":
            out["body_bytes"] = len(value)
        elif key in _TIME_FIELDS:
            out[key] = _ts(value)
        elif key in ("ack_sent", "app_ack"):
            out[key] = _decode(value, encoding)
        else:
            out[key] = value
    out["attempts_since_redrive"] = int(row["attempts"]) - int(row["redrive_base"])
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
        for seg in _segments(value or ""):
            out.append(f"    {seg}")
    return "\n".join(out) + "\n"


@_command
def cmd_show(settings: Settings, args: argparse.Namespace) -> int:
    """``queue show ID [--raw] [--json]``."""
    if args.raw and args.json:
        raise UsageError("--raw and --json exclude each other")
    with open_store(settings, write=False) as store:
        try:
            message_id = _resolve_id(store, args.id)
        except _NotFound as exc:
            _err(str(exc))
            return EXIT_FAILURE
        cur = store.conn.execute(store.q["op_message"], {"id": message_id})
        found = cur.fetchone()
        row = (
            None
            if found is None
            else {d[0]: v for d, v in zip(cur.description, found, strict=True)}
        )
    if row is None:
        _err(f"no row with id {args.id}")
        return EXIT_FAILURE
    if args.raw:
        # The stored bytes exactly as received (SPEC 4), for diffing or re-sending.
        sys.stdout.flush()
        sys.stdout.buffer.write(row["body"])
        sys.stdout.buffer.flush()
        return EXIT_OK
    fields = show_fields(row)
    if args.json:
        sys.stdout.write(json.dumps(fields, indent=2) + "\n")
    else:
        sys.stdout.write(render_show(fields))
    sys.stdout.flush()
    return EXIT_OK


# -- queue retry ---------------------------------------------------------------


def _paused_hint(store: SqliteStore, channels: Iterable[str]) -> None:
    paused = store.paused_channels() & set(channels)
    for name in sorted(paused):
        print(
            f"note: channel {name} is paused; nothing is sent until "
            f"`hl7-agent channel resume {name}`",
            file=sys.stderr,
        )


@_command
def cmd_retry(settings: Settings, args: argparse.Namespace) -> int:
    """``queue retry (ID... | --state failed|rejected [--channel C]) [--dry-run]``.

    Operator re-drive (SPEC 6): failed/rejected → queued with the same id (a
    replaying server dedupes), due now, ``redrive_base = attempts`` so
    ``max_attempts`` counts afresh. The row keeps its seq: it goes back to the
    head of its channel and is sent before newer queued rows.
    """
    if args.ids and args.state:
        raise UsageError("give row ids or --state, not both")
    if not args.ids and not args.state:
        raise UsageError("give row ids, or --state failed|rejected [--channel C]")
    if args.channel and not args.state:
        raise UsageError("--channel goes with --state (ids already name their rows)")
    if args.ids:
        return _retry_ids(
            settings, list(dict.fromkeys(i.strip().lower() for i in args.ids)), args.dry_run
        )
    return _retry_state(settings, args.state, args.channel, args.dry_run)


def _retry_ids(settings: Settings, ids: list[str], dry_run: bool) -> int:
    refused = 0
    moved_channels: list[str] = []
    with open_store(settings, write=not dry_run) as store:
        conn = store.conn
        for start in range(0, len(ids), RETRY_BATCH):
            batch = ids[start : start + RETRY_BATCH]
            with contextlib.ExitStack() as stack:
                if not dry_run:
                    stack.enter_context(_write_txn(conn))
                now = time.time()
                for message_id in batch:
                    found = conn.execute(store.q["op_row_state"], {"id": message_id}).fetchone()
                    if found is None:
                        _err(f"{message_id}: no such row")
                        refused += 1
                        continue
                    state, channel, _seq = found
                    if state not in REDRIVABLE:
                        why = ("it may still be delivered" if state in states.LIVE
                               else "it is settled for good")  # fmt: skip
                        _err(
                            f"{message_id}: not moved: it is {state} ({why}); only failed/rejected "
                            "rows can be retried"
                        )
                        refused += 1
                        continue
                    if dry_run:
                        print(f"{message_id}: would be queued (is {state}, channel {channel})")
                        continue
                    cur = conn.execute(store.q["op_redrive_one"], {"id": message_id, "now": now})
                    if cur.rowcount != 1:  # the guard is in the UPDATE; count what it did
                        _err(f"{message_id}: not moved: its state changed meanwhile")
                        refused += 1
                        continue
                    moved_channels.append(channel)
                    print(f"{message_id}: queued (was {state}, channel {channel}, same id)")
        if moved_channels:
            _paused_hint(store, moved_channels)
    return EXIT_FAILURE if refused else EXIT_OK


def _retry_state(settings: Settings, state_arg: str, channel: str | None, dry_run: bool) -> int:
    state = _check_state(state_arg)
    if state not in REDRIVABLE:
        raise UsageError(f"--state {state}: only failed or rejected rows can be retried")
    _channel_note(settings, channel)
    params = {"state": state, "channel": channel}
    with open_store(settings, write=not dry_run) as store:
        conn = store.conn
        if dry_run:
            rows = conn.execute(store.q["op_select_state"], params).fetchall()
            if rows:
                sys.stdout.write(
                    _table(LIST_HEADERS, [[*r[:7], _ts(r[7]), r[8]] for r in rows], right=(2, 6))
                )
            print(
                f"would re-drive {len(rows)} {state} row(s) to queued (dry run: nothing changed)",
                file=sys.stderr,
            )
            return EXIT_OK
        total = int(conn.execute(store.q["op_count_state"], params).fetchone()[0])
        max_rowid = int(conn.execute(store.q["op_max_rowid"]).fetchone()[0])
        progress = Progress(f"retry {state}", total)
        per_channel: dict[str, int] = {}
        try:
            while True:
                with _write_txn(conn):
                    moved = conn.execute(
                        store.q["op_redrive_batch"],
                        {
                            **params,
                            "now": time.time(),
                            "max_rowid": max_rowid,
                            "limit": RETRY_BATCH,
                        },
                    ).fetchall()
                for (name,) in moved:
                    per_channel[name] = per_channel.get(name, 0) + 1
                progress.advance(len(moved))
                if len(moved) < RETRY_BATCH:
                    break
        finally:
            progress.close()
        count = sum(per_channel.values())
        detail = ", ".join(f"{k} {v}" for k, v in sorted(per_channel.items()))
        print(
            f"re-drove {count} {state} row(s) to queued, each with its id"
            + (f" ({detail})" if detail else "")
        )
        _paused_hint(store, per_channel)
    return EXIT_OK


# -- queue purge ---------------------------------------------------------------


@_command
def cmd_purge(settings: Settings, args: argparse.Namespace) -> int:
    """``queue purge --state S --older-than DURATION [--channel C] [--dry-run]``.

    Deletes terminal rows whose ``updated_at`` is older than the duration, in
    batches of PURGE_BATCH, each in its own short transaction. Dedupe keys stay
    until their window ends, so a purged message's retransmit is still caught.
    """
    state = _check_state(args.state)
    if state in states.LIVE:
        raise UsageError(
            f"refusing to purge {state} rows: queued, claimed and inflight rows may still be "
            "delivered (SPEC 6); purge takes processed, rejected, failed or nacked"
        )
    try:
        older_than = parse_duration(args.older_than)
    except ValueError as exc:
        raise UsageError(f"--older-than: {exc}") from None
    _channel_note(settings, args.channel)
    cutoff = time.time() - older_than
    params = {"state": state, "channel": args.channel, "cutoff": cutoff}
    where = f"{state} row(s) last updated before {rfc3339(cutoff)}" + (
        f" on channel {args.channel}" if args.channel else ""
    )
    with open_store(settings, write=not args.dry_run) as store:
        conn = store.conn
        total = int(conn.execute(store.q["op_count_purgeable"], params).fetchone()[0])
        if args.dry_run:
            print(f"would delete {total} {where} (dry run: nothing changed)")
            if state == "failed" and total:
                print(
                    "note: failed rows are undelivered messages; `queue export --state failed` "
                    "keeps a copy",
                    file=sys.stderr,
                )
            return EXIT_OK
        progress = Progress(f"purge {state}", total)
        deleted = 0
        try:
            while True:
                with _write_txn(conn):
                    n = conn.execute(
                        store.q["op_purge_batch"], {**params, "limit": PURGE_BATCH}
                    ).rowcount
                deleted += n
                progress.advance(n)
                if n < PURGE_BATCH:
                    break
        finally:
            progress.close()
    print(f"deleted {deleted} {where}; dedupe keys kept until their window ends")
    return EXIT_OK


# -- queue export --------------------------------------------------------------


def _lines_form(body: bytes) -> bytes:
    """One segment per line: ``\\r``/``\\r\\n`` segment ends become ``\\n``."""
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return text if text.endswith(b"\n") else text + b"\n"


@contextlib.contextmanager
def _output(out: str) -> Iterator[IO[bytes]]:
    """stdout for ``-``; else a 0600 temp file renamed onto OUT only when complete.

    The export holds patient data, hence 0600; the rename keeps a half-written
    export from passing for a whole one.
    """
    if out == "-":
        sys.stdout.flush()
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    target = Path(out)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".partial", dir=target.parent or Path(".")
    )
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@_command
def cmd_export(settings: Settings, args: argparse.Namespace) -> int:
    """``queue export --state S [--channel C] [--format mllp|lines] OUT``.

    Order: by channel, then seq (the order the channel delivers in), rows
    without a seq (nacked audit rows) last by received time. Bodies are the
    stored bytes exactly, so their character set is preserved.
    """
    state = _check_state(args.state)
    _channel_note(settings, args.channel)
    out_name = "stdout" if args.out == "-" else args.out
    if args.out != "-" and not Path(args.out).parent.is_dir():
        _err(f"cannot write {args.out}: no such directory")
        return EXIT_FAILURE
    if args.out != "-" and Path(args.out).is_dir():
        _err(f"cannot write {args.out}: it is a directory; name a file inside it")
        return EXIT_FAILURE
    written = vanished = total_bytes = 0
    with open_store(settings, write=False) as store:
        conn = store.conn
        # The id list first (one short read), then bodies in batches: no read
        # snapshot stays open for the whole export while the daemon writes.
        ids = [
            r[0]
            for r in conn.execute(
                store.q["op_export_ids"], {"state": state, "channel": args.channel}
            )
        ]
        progress = Progress("export", len(ids))
        try:
            with _output(args.out) as fh:
                for start in range(0, len(ids), EXPORT_BATCH):
                    batch = ids[start : start + EXPORT_BATCH]
                    bodies = dict(
                        conn.execute(store.q["op_bodies"], {"ids": json.dumps(batch)}).fetchall()
                    )
                    for message_id in batch:
                        body = bodies.get(message_id)
                        if body is None:
                            vanished += 1  # purged since the id list was read
                            continue
                        data = encode_frame(body) if args.format == "mllp" else _lines_form(body)
                        fh.write(data)
                        written += 1
                        total_bytes += len(data)
                    progress.advance(len(batch))
        finally:
            progress.close()
    note = f"; {vanished} purged meanwhile" if vanished else ""
    print(
        f"exported {written} {state} message(s), {total_bytes} bytes, {args.format} format, "
        f"to {out_name}{note}",
        file=sys.stderr,
    )
    return EXIT_OK


# -- channel pause / resume ----------------------------------------------------


def _operator() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


@_command
def cmd_channel(settings: Settings, args: argparse.Namespace) -> int:
    """``channel pause|resume NAME``: the durable flag the dispatcher honours (SPEC 2, 6)."""
    name = args.name
    configured = [c.name for c in settings.channels]
    if name not in configured:
        _err(
            f"no channel named {name!r} in the configuration (configured: {', '.join(configured) or 'none'})"
        )
        return EXIT_FAILURE
    pause = args.channel_command == "pause"
    with open_store(settings, write=True) as store:
        conn = store.conn
        with _write_txn(conn):
            was_paused = name in store.paused_channels()
            if pause:
                if not was_paused:
                    store.pause_channel(name, f"operator ({_operator()})")
            elif was_paused:
                store.resume_channel(name)
        live = store.stats([name])["channels"][name]
    backlog = f"{live['queued']} queued, {live['claimed'] + live['inflight']} in flight"
    if pause:
        already = "already " if was_paused else ""
        print(
            f"channel {name}: {already}paused; dispatch holds (intake goes on) until "
            f"`hl7-agent channel resume {name}` [{backlog}]"
        )
    else:
        already = "" if was_paused else "already "
        print(f"channel {name}: {already}resumed; dispatch goes on [{backlog}]")
    return EXIT_OK
