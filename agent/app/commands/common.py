"""What every operator command shares: opening the queue, exit paths, argument checks.

The commands work on the same database file as a running daemon, so they are
polite neighbours: the file is never created (a command that only reads
never creates a database), reads run under a read-only connection, and every
write is a short transaction over at most a batch of rows (the store's
guarded queries), so the daemon's group commit never waits long behind an
operator. A lock held past ``busy_timeout`` is one clear line and exit 1.

Nothing here logs: stdout carries the answer (tables or JSON), stderr carries
errors, notes and, on a terminal only, progress.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import os
import sys
from collections.abc import Callable, Iterator

from agent.app.cli import EXIT_FAILURE
from agent.app.config import Settings, parse_duration
from agent.core.states import ALL, State
from agent.errors import DatabaseLocked, UsageError
from agent.storage.store import SqliteStore, open_operator_store

Command = Callable[[Settings, argparse.Namespace], int]


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
