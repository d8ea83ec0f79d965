"""What every operator command shares: opening the queue, exit paths, argument checks.

The commands work on the same database file as a running daemon, so they are
polite neighbours: the file is never created (a command that only reads
never creates a database), reads run under a read-only connection, and every
write is a short transaction over at most a batch of rows (the store's
guarded queries), so the daemon's group commit never waits long behind an
operator. A lock held past ``busy_timeout`` is one clear line and exit 1.

Nothing here logs: stdout carries the answer (tables or JSON), stderr carries
errors, notes and, on a terminal only, progress. What a command changed is
written to the database with the change (:class:`ActionRecord`), and the
daemon logs it (``operator_action``), whichever process ran the command.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import getpass
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agent.app.cli import EXIT_FAILURE
from agent.app.config import Settings, parse_duration
from agent.core.states import ALL, State
from agent.errors import DatabaseLocked, UsageError
from agent.storage.store import SqliteStore, open_operator_store

Command = Callable[[Settings, argparse.Namespace], int]

#: The shortest id prefix a command resolves: 8 hex digits (a UUID's first
#: group), where two rows sharing one is rare enough to name them both.
MIN_ID_PREFIX = 8
#: Candidates named when a prefix matches several rows.
CANDIDATES_SHOWN = 10
_HEX = frozenset("0123456789abcdef")


def err(message: str) -> None:
    print(f"hl7-agent: {message}", file=sys.stderr)


def command(fn: Command) -> Command:
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


@contextlib.contextmanager
def open_store(settings: Settings, *, write: bool) -> Iterator[SqliteStore]:
    """The queue database of ``settings``, never created; database errors become one line.

    ``write=False``: a read-only connection. ``write=True`` checks the file
    belongs to this ``agent.id`` first (two agents never share a queue).
    """
    try:
        with open_operator_store(settings.db_path, settings.queue, settings.agent.id, write=write) as store:
            yield store
    except DatabaseLocked as exc:
        where = settings.queue.dsn_masked if settings.queue.backend == "postgresql" else settings.db_path
        raise DatabaseLocked(
            f"the queue database {where} stayed locked by another process beyond "
            f"busy_timeout ({settings.queue.busy_timeout:g}s); nothing was changed, try again"
        ) from exc


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


def check_state(value: str, flag: str = "--state") -> State:
    """A row state named on the command line (any case, spaces around it ignored)."""
    try:
        return State(value.strip().lower())
    except ValueError:
        raise UsageError(f"{flag} {value!r}: use one of {', '.join(ALL)}") from None


def channel_note(settings: Settings, channel: str | None) -> None:
    """A typo in --channel otherwise looks like an empty queue."""
    if channel is not None and channel not in {c.name for c in settings.channels}:
        print(f"note: channel {channel!r} is not in the configuration", file=sys.stderr)


def operator() -> str:
    """The OS user running this command, for the audit trail and pause reasons."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


# -- row ids ---------------------------------------------------------------------


@dataclass
class ResolvedIds:
    """What the ids an operator typed name: full ids (unique, in order) and a line per problem."""

    ids: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def resolve_ids(store: SqliteStore, texts: Iterable[str]) -> ResolvedIds:
    """Full ids for what the operator typed, the same rules for every command that takes ids.

    A full id, or a prefix of at least MIN_ID_PREFIX hex digits (any case)
    that starts exactly one row's id. Too short: "give at least 8
    characters"; several rows: they are named (up to CANDIDATES_SHOWN) so
    the operator can pick; none: "no row with id …".
    """
    out = ResolvedIds()
    for raw in texts:
        text = raw.strip().lower()
        if store.row_place(text) is not None:
            found = [text]
        elif sum(ch in _HEX for ch in text) < MIN_ID_PREFIX:
            out.problems.append(f"{raw.strip() or repr(raw)}: give at least {MIN_ID_PREFIX} characters of the id")
            continue
        else:
            found = store.resolve_id_prefix(text, MIN_ID_PREFIX, limit=CANDIDATES_SHOWN + 1)
        if not found:
            out.problems.append(f"no row with id {raw.strip()}")
        elif len(found) > 1:
            named = []
            for candidate in found[:CANDIDATES_SHOWN]:
                place = store.row_place(candidate)
                named.append(f"{candidate} ({place.state}, {place.channel})" if place else candidate)
            more = " and more" if len(found) > CANDIDATES_SHOWN else ""
            out.problems.append(f"id prefix {text} matches several rows: {', '.join(named)}{more}; "
                                "give more of the id")
        elif found[0] not in out.ids:
            out.ids.append(found[0])
    return out


# -- the audit trail ------------------------------------------------------------------


class ActionRecord:
    """The ``operator_actions`` entry of one command, written with the changes it describes.

    :meth:`record` runs inside the transaction of the change: one entry per
    command, kept current batch by batch (``rows`` and ``detail`` say what
    has committed), finished with the last batch. A command cut short marks
    it ``interrupted`` (:meth:`interrupted`); one that died leaves it
    ``running`` and the daemon logs it once it has been silent a while.
    """

    def __init__(self, action: str, *, channel: str | None = None, reason: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.action = action
        self.channel = channel
        self.reason = reason
        self.clock = clock
        self.user = operator()
        self.entry_id: int | None = None
        self.finished = False

    def record(self, store: SqliteStore, *, rows: int, detail: dict[str, Any], last: bool = True) -> None:
        """Inside the change's transaction: the whole action so far (``rows``, ``detail``)."""
        now = self.clock()
        if self.entry_id is None:
            self.entry_id = store.record_operator_action(
                self.action, os_user=self.user, pid=os.getpid(), now=now, rows=rows, detail=detail,
                channel=self.channel, reason=self.reason, done=last,
            )
        else:
            store.update_operator_action(self.entry_id, now=now, rows=rows, detail=detail,
                                         status="done" if last else "running", channel=self.channel)
        self.finished = last

    def interrupted(self, store: SqliteStore, *, rows: int, detail: dict[str, Any]) -> None:
        """After a batch failed or the command was stopped: the entry says so (its own transaction)."""
        if self.entry_id is None or self.finished:
            return
        with contextlib.suppress(Exception), store.transaction():
            store.update_operator_action(self.entry_id, now=self.clock(), rows=rows, detail=detail,
                                         status="interrupted", channel=self.channel)
        self.finished = True
