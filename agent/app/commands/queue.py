"""``hl7-agent queue stats|list|show|retry|fail|purge|export`` (docs/operations.md, docs/queue.md#operator-actions).

The commands run store methods only (agent/storage/store_operator.py holds
their queries and the guards: a re-drive moves only ``failed``/``rejected``
rows, a set-aside only ``queued`` ones, and a purge deletes only terminal
rows, whatever the caller passed; purging never deletes dedupe keys).
``retry`` and ``fail`` are agent/app/commands/moves.py. How the answers look
is agent/app/commands/render.py; opening the file politely next to a running
daemon, ids and the audit trail are agent/app/commands/common.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from agent.app.cli import EXIT_FAILURE, EXIT_OK
from agent.app.commands import render
from agent.app.commands.common import (
    MIN_ID_PREFIX,
    ActionRecord,
    channel_note,
    check_state,
    command,
    err,
    open_store,
    parse_since,
    resolve_ids,
)
from agent.app.commands.moves import RETRY_BATCH, cmd_fail, cmd_retry
from agent.app.commands.render import Progress
from agent.app.config import Settings, parse_duration
from agent.core.mllp import encode_frame
from agent.core.partition import key_hash
from agent.core.states import LIVE, State
from agent.core.timefmt import rfc3339
from agent.errors import UsageError
from agent.storage.rows import RowFilter

__all__ = [
    "MIN_ID_PREFIX",
    "RETRY_BATCH",
    "Progress",
    "cmd_export",
    "cmd_fail",
    "cmd_list",
    "cmd_purge",
    "cmd_retry",
    "cmd_show",
    "cmd_stats",
    "parse_since",
]

PURGE_BATCH = 1000
EXPORT_BATCH = 500


# -- queue stats ---------------------------------------------------------------


@command
def cmd_stats(settings: Settings, args: argparse.Namespace) -> int:
    """``queue stats [--json]``."""
    names = [c.name for c in settings.channels]
    partitioned = [c.name for c in settings.channels if c.partition_key]
    with open_store(settings, write=False) as store:
        data = render.stats_document(
            store.stats(names, partitioned), configured=names, settled=store.settled_by_channel(),
            flags=store.channel_flags(), meta=store.meta(), now=store.clock(),
        )
        lease_row = store.lease_row()
        now = store.clock()
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(render.render_stats(data, lease_row, now))
    sys.stdout.flush()
    return EXIT_OK


# -- queue list ----------------------------------------------------------------


@command
def cmd_list(settings: Settings, args: argparse.Namespace) -> int:
    """``queue list``: rows newest first (received_at DESC), bodies only on request."""
    state = check_state(args.state) if args.state else None
    if args.limit < 0:
        raise UsageError("--limit must be >= 0 (0 = no limit)")
    now = time.time()
    since = parse_since(args.since, now) if args.since else None
    channel_note(settings, args.channel)
    where = RowFilter(state=state, channel=args.channel, since=since, control_id=args.control_id,
                      limit=args.limit, show_body=args.show_body)
    with open_store(settings, write=False) as store:
        secret = store.key_hash_secret()
        items = [render.list_item(r, show_body=args.show_body, key_secret=secret) for r in store.list_rows(where)]
    if args.json:
        sys.stdout.write(json.dumps(items, indent=2) + "\n")
        return EXIT_OK
    if not items:
        print("no rows match", file=sys.stderr)
        return EXIT_OK
    sys.stdout.write(render.render_list(items, show_body=args.show_body, width=render.output_width()))
    if len(items) == args.limit:
        print(f"(first {args.limit} rows; --limit N for more, 0 for all)", file=sys.stderr)
    sys.stdout.flush()
    return EXIT_OK


# -- queue show ----------------------------------------------------------------


@command
def cmd_show(settings: Settings, args: argparse.Namespace) -> int:
    """``queue show ID [--raw] [--json]``."""
    if args.raw and args.json:
        raise UsageError("--raw and --json exclude each other")
    with open_store(settings, write=False) as store:
        resolved = resolve_ids(store, [args.id])
        row = store.row(resolved.ids[0]) if resolved.ids else None
        key, key_paused = store.row_partition(row.id) if row is not None else (None, None)
        secret = store.key_hash_secret()
    if row is None:
        err(resolved.problems[0] if resolved.problems else f"no row with id {args.id}")
        return EXIT_FAILURE
    if args.raw:
        sys.stdout.flush()
        if sys.stdout.isatty():
            # Segments end in CR, which makes a terminal draw each one over
            # the last: there, one segment per line, control bytes escaped.
            text = render.raw_for_terminal(row.body, row.encoding)
            sys.stdout.buffer.write(text.encode(sys.stdout.encoding or "utf-8", errors="replace"))
            sys.stdout.buffer.flush()
        else:
            # The stored bytes exactly as received (docs/queue.md#intake), for diffing or re-sending.
            sys.stdout.buffer.write(row.body)
            sys.stdout.buffer.flush()
        return EXIT_OK
    fields = render.show_fields(row)
    if key is not None:
        # By its hash (the key is patient data), and why it is not moving when its key is paused.
        fields["partition"] = key_hash(key, secret)
        fields["partition_paused"] = key_paused
    if args.json:
        sys.stdout.write(json.dumps(fields, indent=2) + "\n")
    else:
        sys.stdout.write(render.render_show(fields))
    sys.stdout.flush()
    return EXIT_OK


# -- queue purge ---------------------------------------------------------------


@command
def cmd_purge(settings: Settings, args: argparse.Namespace) -> int:
    """``queue purge --state S --older-than DURATION [--channel C] [--dry-run]``.

    Deletes terminal rows whose ``updated_at`` is older than the duration, in
    batches of PURGE_BATCH, each in its own short transaction. Dedupe keys stay
    until their window ends, so a purged message's retransmit is still caught.
    """
    state = check_state(args.state)
    if state in LIVE:
        raise UsageError(
            f"refusing to purge {state} rows: queued, claimed and inflight rows may still be "
            "delivered (docs/queue.md#operator-actions); purge takes processed, rejected, failed "
            "or nacked"
        )
    try:
        older_than = parse_duration(args.older_than)
    except ValueError as exc:
        raise UsageError(f"--older-than: {exc}") from None
    channel_note(settings, args.channel)
    cutoff = time.time() - older_than
    where = f"{state} row(s) last updated before {rfc3339(cutoff)}" + (
        f" on channel {args.channel}" if args.channel else ""
    )
    audit = ActionRecord("purge", channel=args.channel)
    with open_store(settings, write=not args.dry_run) as store:
        total = store.count_purgeable(state, args.channel, cutoff)
        if args.dry_run:
            print(f"would delete {total} {where} (dry run: nothing changed)")
            if state == State.FAILED and total:
                print(
                    "note: failed rows are undelivered messages; `queue export --state failed` "
                    "keeps a copy",
                    file=sys.stderr,
                )
            return EXIT_OK
        progress = Progress(f"purge {state}", total)
        deleted = 0
        detail = {"state": str(state), "older_than": args.older_than, "before": rfc3339(cutoff)}
        try:
            while True:
                with store.transaction():
                    n = store.purge(state, args.channel, cutoff, PURGE_BATCH)
                    if deleted + n:
                        audit.record(store, rows=deleted + n, detail=detail, last=n < PURGE_BATCH)
                deleted += n
                progress.advance(n)
                if n < PURGE_BATCH:
                    break
        finally:
            progress.close()
            audit.interrupted(store, rows=deleted, detail=detail)
    print(f"deleted {deleted} {where}; dedupe keys kept until their window ends")
    return EXIT_OK


# -- queue export --------------------------------------------------------------


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


@command
def cmd_export(settings: Settings, args: argparse.Namespace) -> int:
    """``queue export --state S [--channel C] [--format mllp|lines] OUT``.

    Order: by channel, then seq (the order the channel delivers in), rows
    without a seq (nacked audit rows) last by received time. Bodies are the
    stored bytes exactly, so their character set is preserved.
    """
    state = check_state(args.state)
    channel_note(settings, args.channel)
    out_name = "stdout" if args.out == "-" else args.out
    if args.out != "-" and not Path(args.out).parent.is_dir():
        err(f"cannot write {args.out}: no such directory")
        return EXIT_FAILURE
    if args.out != "-" and Path(args.out).is_dir():
        err(f"cannot write {args.out}: it is a directory; name a file inside it")
        return EXIT_FAILURE
    written = vanished = total_bytes = 0
    with open_store(settings, write=False) as store:
        # The id list first (one short read), then bodies in batches: no read
        # snapshot stays open for the whole export while the daemon writes.
        ids = store.export_ids(state, args.channel)
        progress = Progress("export", len(ids))
        try:
            with _output(args.out) as fh:
                for start in range(0, len(ids), EXPORT_BATCH):
                    batch = ids[start : start + EXPORT_BATCH]
                    bodies = store.export_bodies(batch)
                    for message_id in batch:
                        body = bodies.get(message_id)
                        if body is None:
                            vanished += 1  # purged since the id list was read
                            continue
                        data = encode_frame(body) if args.format == "mllp" else render.lines_form(body)
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
