"""``hl7-agent queue retry`` and ``queue fail``: the operator moves a row (docs/queue.md#operator-actions).

Re-drive (``retry``) puts ``failed``/``rejected`` rows back to ``queued``;
set-aside (``fail``) makes ``queued`` rows ``failed`` so a head that can never
succeed stops blocking its channel. Both are guarded in the SQL whatever ids
were named (agent/storage/store_operator.py): a row the dispatcher may be
sending (``claimed``, ``inflight``) is never touched, and a claim and a
set-aside can never both win. Each command records what it changed for the
daemon's log in the same transaction as the change.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from agent.app.cli import EXIT_FAILURE, EXIT_OK
from agent.app.commands import render
from agent.app.commands.common import (
    ActionRecord,
    channel_note,
    check_state,
    command,
    err,
    open_store,
    resolve_ids,
)
from agent.app.commands.render import Progress
from agent.app.config import Settings
from agent.core import acks, envelope
from agent.core.states import LIVE, REDRIVABLE, State
from agent.errors import UsageError
from agent.storage.rows import SetAsideOutcome
from agent.storage.store import SqliteStore

__all__ = ["FAIL_BATCH", "RETRY_BATCH", "SET_ASIDE_CODE", "cmd_fail", "cmd_retry"]

RETRY_BATCH = 500
FAIL_BATCH = 500
#: ``error_code`` of a row an operator set aside (its ``error_text`` says who and why).
SET_ASIDE_CODE = "set_aside"
#: The longest ``--reason`` kept (it is stored with each row and logged once).
REASON_MAX = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def _batches(ids: Sequence[str], size: int) -> Iterator[tuple[list[str], bool]]:
    """``ids`` in slices of ``size``, each with whether it is the last one."""
    starts = range(0, len(ids), size)
    for start in starts:
        yield list(ids[start : start + size]), start == starts[-1]


def _per_channel(channels: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in channels:
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _only_channel(channels: Iterable[str]) -> str | None:
    """The channel of the audit entry: the one channel of the rows moved, None when several."""
    names = set(channels)
    return names.pop() if len(names) == 1 else None


def _paused_hint(store: SqliteStore, channels: Iterable[str]) -> None:
    paused = store.paused_channels() & set(channels)
    for name in sorted(paused):
        print(
            f"note: channel {name} is paused; nothing is sent until "
            f"`hl7-agent channel resume {name}`",
            file=sys.stderr,
        )


# -- queue retry ---------------------------------------------------------------


@command
def cmd_retry(settings: Settings, args: argparse.Namespace) -> int:
    """``queue retry (ID... | --state failed|rejected [--channel C]) [--dry-run]``.

    Operator re-drive (docs/queue.md#operator-actions): failed/rejected →
    queued with the same id (a replaying server dedupes), due now,
    ``redrive_base = attempts`` so ``max_attempts`` counts afresh. The row
    keeps its seq: it goes back to the head of its channel and is sent before
    newer queued rows.
    """
    if args.ids and args.state:
        raise UsageError("give row ids or --state, not both")
    if not args.ids and not args.state:
        raise UsageError("give row ids, or --state failed|rejected [--channel C]")
    if args.channel and not args.state:
        raise UsageError("--channel goes with --state (ids already name their rows)")
    if args.ids:
        return _retry_ids(settings, args.ids, args.dry_run)
    return _retry_state(settings, args.state, args.channel, args.dry_run)


def _retry_ids(settings: Settings, texts: list[str], dry_run: bool) -> int:
    audit = ActionRecord("retry")
    moved: list[tuple[str, str]] = []  # (id, channel)

    def detail() -> dict[str, Any]:
        return {"ids": [i for i, _ in moved], "channels": _per_channel(c for _, c in moved)}

    with open_store(settings, write=not dry_run) as store:
        resolved = resolve_ids(store, texts)
        for problem in resolved.problems:
            err(problem)
        refused = len(resolved.problems)
        try:
            for batch, last in _batches(resolved.ids, RETRY_BATCH):
                if dry_run:
                    outcomes = store.redrive_ids(batch, time.time(), dry_run=True)
                else:
                    with store.transaction():
                        outcomes = store.redrive_ids(batch, time.time())
                        moved.extend((o.id, o.channel or "") for o in outcomes if o.result == "moved")
                        if moved:
                            audit.channel = _only_channel(c for _, c in moved)
                            audit.record(store, rows=len(moved), detail=detail(), last=last)
                for o in outcomes:
                    if o.result == "missing":
                        err(f"no row with id {o.id}")
                    elif o.result == "refused":
                        why = "it may still be delivered" if o.state in LIVE else "it is settled for good"
                        err(f"{o.id}: not moved: it is {o.state} ({why}); only failed/rejected rows can be retried")
                    elif o.result == "changed":
                        err(f"{o.id}: not moved: its state changed meanwhile")
                    elif o.result == "would_move":
                        print(f"{o.id}: would be queued (is {o.state}, channel {o.channel})")
                        continue
                    else:
                        print(f"{o.id}: queued (was {o.state}, channel {o.channel}, same id)")
                        continue
                    refused += 1
        finally:
            audit.interrupted(store, rows=len(moved), detail=detail())
        if moved:
            _paused_hint(store, (c for _, c in moved))
    return EXIT_FAILURE if refused else EXIT_OK


def _retry_state(settings: Settings, state_arg: str, channel: str | None, dry_run: bool) -> int:
    state = check_state(state_arg)
    if state not in REDRIVABLE:
        raise UsageError(f"--state {state}: only failed or rejected rows can be retried")
    channel_note(settings, channel)
    with open_store(settings, write=not dry_run) as store:
        if dry_run:
            rows = store.rows_in_state(state, channel)
            if rows:
                sys.stdout.write(render.state_table(rows, store.key_hash_secret()))
            print(
                f"would re-drive {len(rows)} {state} row(s) to queued (dry run: nothing changed)",
                file=sys.stderr,
            )
            return EXIT_OK
        total = store.count_state(state, channel)
        last_rowid = store.last_rowid()
        progress = Progress(f"retry {state}", total)
        per_channel: dict[str, int] = {}
        audit = ActionRecord("retry", channel=channel)

        def detail() -> dict[str, Any]:
            return {"state": str(state), "channels": dict(sorted(per_channel.items()))}

        try:
            while True:
                with store.transaction():
                    moved = store.redrive_state(state, channel, up_to_rowid=last_rowid,
                                                limit=RETRY_BATCH, now=time.time())
                    for name in moved:
                        per_channel[name] = per_channel.get(name, 0) + 1
                    if per_channel:
                        audit.record(store, rows=sum(per_channel.values()), detail=detail(),
                                     last=len(moved) < RETRY_BATCH)
                progress.advance(len(moved))
                if len(moved) < RETRY_BATCH:
                    break
        finally:
            progress.close()
            audit.interrupted(store, rows=sum(per_channel.values()), detail=detail())
        count = sum(per_channel.values())
        summary = ", ".join(f"{k} {v}" for k, v in sorted(per_channel.items()))
        print(
            f"re-drove {count} {state} row(s) to queued, each with its id"
            + (f" ({summary})" if summary else "")
        )
        _paused_hint(store, per_channel)
    return EXIT_OK


# -- queue fail ------------------------------------------------------------------


def clean_reason(text: str | None) -> str | None:
    """The operator's ``--reason`` as one line of at most REASON_MAX characters; None when empty."""
    if text is None:
        return None
    line = " ".join(_CONTROL.sub(" ", text).split())
    if len(line) > REASON_MAX:
        line = line[: REASON_MAX - 1].rstrip() + "…"
    return line or None


def _owed_app_acks(store: SqliteStore, ids: Sequence[str], text: str) -> dict[str, bytes]:
    """The application ACK (AE) each sender waiting for one gets when its row is set aside.

    As when the dispatcher gives a row up: a sender on an application or
    enhanced channel is told its message was not delivered, instead of
    waiting and being asked to resend it forever. Never raises: a row whose
    ACK cannot be built is set aside without one.
    """
    owed: dict[str, bytes] = {}
    for message_id in ids:
        row = store.row(message_id)
        if row is None or row.state != State.QUEUED or row.ack_mode == "commit":
            continue
        try:
            inbound = envelope.read_msh(row.body)
            owed[message_id] = acks.app_ack_from_status(inbound, 500, row.encoding or "ascii", text=text)
        except Exception:  # noqa: BLE001, S112 - one row's ACK must not stop the set-aside
            continue
    return owed


def _refusal(o: SetAsideOutcome) -> str:
    """Why a named row was not set aside, and what to do about it."""
    if o.state in (State.CLAIMED, State.INFLIGHT):
        doing = ("the dispatcher has taken it to send it now" if o.state == State.CLAIMED
                 else "it was sent and waits for the server's answer")
        return (f"{o.id}: not set aside: it is {o.state} ({doing}); only queued rows can be set "
                f"aside. Wait for the answer and try again (between attempts a retried head is "
                f"queued), or `hl7-agent channel pause {o.channel}` first: a paused channel "
                "keeps a queued head queued")
    if o.state == State.FAILED:
        return f"{o.id}: not set aside: it is failed already"
    if o.state == State.NACKED:
        return f"{o.id}: not set aside: it is nacked (an audit row of refused intake, never sent)"
    return f"{o.id}: not set aside: it is {o.state} (settled: nothing left to send)"


@command
def cmd_fail(settings: Settings, args: argparse.Namespace) -> int:
    """``queue fail ID... [--reason TEXT]``: queued rows set aside as ``failed``.

    One guarded update per row (only a row queued at that instant moves); it
    never triggers ``on_reject`` (no pause), and the channel goes on with its
    next row. ``queue retry ID`` brings a row back, with its id and seq.
    """
    reason = clean_reason(args.reason)
    audit = ActionRecord("fail", reason=reason)
    error_text = f"set aside by {audit.user}" + (f": {reason}" if reason else "")
    moved: list[SetAsideOutcome] = []

    def detail() -> dict[str, Any]:
        return {"ids": [o.id for o in moved], "channels": _per_channel(o.channel or "" for o in moved)}

    with open_store(settings, write=True) as store:
        resolved = resolve_ids(store, args.ids)
        for problem in resolved.problems:
            err(problem)
        refused = len(resolved.problems)
        try:
            for batch, last in _batches(resolved.ids, FAIL_BATCH):
                with store.transaction():
                    now = time.time()
                    outcomes = store.set_aside(
                        batch, now, error_code=SET_ASIDE_CODE, error_text=error_text,
                        app_acks=_owed_app_acks(store, batch, f"not delivered: {error_text}"),
                    )
                    moved.extend(o for o in outcomes if o.result == "moved")
                    if moved:
                        audit.channel = _only_channel(o.channel or "" for o in moved)
                        audit.record(store, rows=len(moved), detail=detail(), last=last)
                for o in outcomes:
                    if o.result == "moved":
                        print(f"{o.id}: set aside as failed (was queued, channel {o.channel}, seq {o.seq}); "
                              f"`hl7-agent queue retry {o.id}` brings it back")
                        continue
                    err(_refusal(o) if o.result == "refused" else f"no row with id {o.id}")
                    refused += 1
        finally:
            audit.interrupted(store, rows=len(moved), detail=detail())
        if moved:
            channels = {o.channel or "" for o in moved}
            paused = store.paused_channels() & channels
            for name in sorted(channels - paused):
                print(f"channel {name} goes on with its next row", file=sys.stderr)
            _paused_hint(store, paused)
    return EXIT_FAILURE if refused else EXIT_OK
