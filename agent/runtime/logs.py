"""Logging: structlog, one JSON object per line on stderr (journald and Docker capture it).

The production setup follows structlog's recommendations: context bound with
contextvars (ids per connection and per message), a filtering bound logger
(a disabled level costs one method call), loggers cached on first use. The
stdlib ``logging`` (websockets logs through it) is rendered by the same
processors into the same sink, at warning and above only: websockets' debug
output includes frame contents, i.e. message bodies.

Logging never blocks the caller. A rendered line goes into a bounded queue;
one writer thread writes the queue to stderr. When the reader of stderr stops
reading (a stuck journald stream, a Docker log driver that stalls) the pipe
fills and only that thread waits: the event loop keeps answering senders.
Once the queue is full, new lines are dropped and counted
(``lines_dropped()``, exported as ``hl7_agent_log_lines_dropped_total``), and
when the stream takes lines again one ``log_lines_dropped`` line says how many
are missing; a line is dropped whole or written whole, never cut. At exit the
queue is written out with a bounded wait.

When stderr is the journal (systemd sets ``JOURNAL_STREAM`` to its
``device:inode``), each line starts with its syslog priority ``<N>`` (RFC 5424
severities), which journald strips and stores as the entry's PRIORITY, so
``journalctl -p err`` finds the errors; the JSON after the prefix is unchanged.

Never log message bodies or patient data; as a last line of defence, values of
the keys ``body``, ``raw`` and ``payload`` are replaced before rendering.

Over 400 lines on purpose: the sink, the journald prefix and the structlog
configuration are one pipeline, and a line's whole way from a call to stderr
(redacted, rendered, queued, written whole or dropped and counted) reads here.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = [
    "EXIT_FLUSH_SECONDS",
    "FORBIDDEN_KEYS",
    "QUEUE_LINES",
    "bind",
    "configure_logging",
    "flush_logs",
    "lines_dropped",
    "stderr_is_journal",
]

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "console")
FORBIDDEN_KEYS = frozenset({"body", "raw", "payload"})

#: Lines the queue holds while stderr does not take them (a few MB at most);
#: beyond that, lines are dropped and counted.
QUEUE_LINES = 8192

#: How long the process waits at exit for queued lines to reach stderr. A
#: reader that is gone or stuck must not hold up an exit (systemd would kill
#: us at TimeoutStopSec), but ``agent_stopped`` and start-up errors should
#: reach a reader that is merely slow.
EXIT_FLUSH_SECONDS = 2.0

#: Most lines the writer takes from the queue per turn (a burst costs few
#: system calls; see _ATOMIC_BYTES for how they are written).
_BATCH_LINES = 256

#: The largest write(2) that a pipe or FIFO takes whole or not at all (POSIX
#: PIPE_BUF, 4096 on Linux). The writer writes pieces of at most this size
#: that end at a line end, so the pipe (Docker's log FIFO, a supervisor's
#: pipe) never holds half a line: not while a stuck reader keeps the writer
#: blocked, and not after the process ended in that state (exit after a
#: timed-out flush, SIGKILL), when the reader would get a cut JSON line with
#: whatever is written next glued to it. On journald's stream socket a piece
#: this small is queued as one buffer, so it is whole there too in practice.
#: Only a single line longer than this can still be split.
_ATOMIC_BYTES = select.PIPE_BUF

#: The writer re-checks the queue at least this often even without a wake-up
#: (a safety net; the normal path is the wake-up event).
_IDLE_WAIT = 1.0

#: Syslog severities (RFC 5424 section 6.2.1) by our level name, as the
#: ``<N>`` prefix journald reads (SyslogLevelPrefix=yes is its default).
SYSLOG_PRIORITY: Mapping[str, int] = {
    "debug": 7,
    "info": 6,
    "warning": 4,
    "error": 3,
    "critical": 2,
}
_DEFAULT_PRIORITY = 6

# The handler this module installed on the root logger, so a reconfigure
# replaces it instead of stacking duplicates.
_stdlib_handler: logging.Handler | None = None


def _abandon_stderr() -> None:
    """The log reader is gone (EPIPE, ENOSPC, closed): logging must never stop intake.

    fd 2 is pointed at /dev/null, so every later write — ours, the stdlib's,
    and the interpreter's final flush (which would otherwise turn exit 0
    into 120) — succeeds and goes nowhere.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass


def _line_pieces(data: bytes, limit: int = _ATOMIC_BYTES) -> Iterator[memoryview]:
    """``data`` (whole lines) cut at line ends into pieces of at most ``limit`` bytes.

    A line longer than ``limit`` is one piece of its own, the only kind larger
    than ``limit``.
    """
    view = memoryview(data)
    start, size = 0, len(data)
    while start < size:
        end = size if size - start <= limit else data.rfind(b"\n", start, start + limit) + 1
        if end <= start:
            end = data.find(b"\n", start) + 1 or size
        yield view[start:end]
        start = end


def _write_lines(fd: int, text: str) -> bool:
    """Write all of ``text`` (whole lines) to ``fd``, waiting as long as the reader needs.

    Each write(2) is whole lines of at most _ATOMIC_BYTES, so it lands in a
    pipe entirely or not at all; a partial write (a longer line, a regular
    file) is continued with its rest. False when the stream is broken (EPIPE,
    ENOSPC, closed): what is left of ``text`` is not written.
    """
    for piece in _line_pieces(text.encode("utf-8", "backslashreplace")):
        while piece:
            try:
                written = os.write(fd, piece)
            except BlockingIOError:
                # Someone set O_NONBLOCK on the shared open file description: wait
                # for room instead of spinning or dropping.
                with contextlib.suppress(OSError, ValueError):
                    select.select([], [fd], [], _IDLE_WAIT)
                continue
            except OSError:
                return False
            piece = piece[written:]
    return True


def _write_fd2(text: str) -> None:
    """Write all of ``text`` to fd 2; a broken stream is abandoned for /dev/null.

    Only the writer thread calls this, so waiting here never stalls the event
    loop. fd 2 is written with os.write, not through ``sys.stderr``: a thread
    blocked inside a buffered stream holds its lock, and the interpreter's
    final flush of that stream would then abort the process at exit.
    """
    if not _write_lines(2, text):
        _abandon_stderr()


def _stream_writer(stream: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


class _LogSink:
    """A bounded queue of rendered lines and the one thread that writes them out.

    ``put`` is the hot path (every log call): a length check, an append, and a
    wake-up only when the writer sleeps. Appends and pops of a deque are
    atomic, so producers on any thread take no lock unless they drop.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target: Callable[[str], None] = _write_fd2
        self.notice: Callable[[int], str] | None = None
        self.dropped_total = 0
        self._lines: collections.deque[str] = collections.deque()
        self._unreported = 0
        self._drop_lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = False
        self._busy = False
        self._progress = threading.Condition()
        self._batches = 0
        self._gave_up_at = -1
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def put(self, line: str) -> None:
        lines = self._lines
        if len(lines) >= self.capacity:
            with self._drop_lock:
                self._unreported += 1
                self.dropped_total += 1
            return
        lines.append(line)
        if self._idle:
            self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued line was handed to the target; False on timeout."""
        self._wake.set()
        with self._progress:
            drained = self._progress.wait_for(lambda: not self._lines and not self._busy, timeout)
            if not drained:
                self._gave_up_at = self._batches
            return drained

    def stuck(self) -> bool:
        """True when the last flush timed out and the writer has written nothing since."""
        with self._progress:
            return self._gave_up_at == self._batches and bool(self._lines or self._busy)

    def _run(self) -> None:
        lines = self._lines
        while True:
            if not lines:
                # Clear, announce idle, re-check: a producer that appends after
                # the re-check sees _idle and sets the event, so no wake-up is lost.
                self._wake.clear()
                self._idle = True
                if not lines:
                    with self._progress:
                        self._progress.notify_all()
                    self._wake.wait(_IDLE_WAIT)
                self._idle = False
                continue
            self._busy = True
            batch = [lines.popleft() for _ in range(min(len(lines), _BATCH_LINES))]
            self._emit("\n".join(batch) + "\n")
            if self._unreported and len(lines) < self.capacity // 2:
                self._report_dropped()
            self._busy = False
            with self._progress:
                self._batches += 1
                self._progress.notify_all()

    def _report_dropped(self) -> None:
        """The stream takes lines again: say how many it missed, in one line."""
        with self._drop_lock:
            count, self._unreported = self._unreported, 0
        notice = self.notice
        if notice is not None:
            self._emit(notice(count) + "\n")

    def _emit(self, text: str) -> None:
        # A broken stream must not end the writer thread (there is nowhere
        # left to report it: this is the log).
        with contextlib.suppress(Exception):
            self.target(text)


_sink: _LogSink | None = None
_sink_lock = threading.Lock()


def _get_sink() -> _LogSink:
    global _sink
    with _sink_lock:
        if _sink is None:
            _sink = _LogSink(QUEUE_LINES)
            atexit.register(_flush_at_exit)
        return _sink


def flush_logs(timeout: float = EXIT_FLUSH_SECONDS) -> bool:
    """Wait (bounded) until queued lines are written; True when the queue is empty.

    The CLI calls this before it prints a final error line, so that line comes
    after the log lines that led to it; it also runs at interpreter exit.
    """
    sink = _sink
    return True if sink is None else sink.flush(timeout)


def _flush_at_exit() -> None:
    """The interpreter's last flush; skipped when the CLI's own flush already gave up.

    A stuck reader must cost the exit one EXIT_FLUSH_SECONDS, not two.
    """
    sink = _sink
    if sink is not None and not sink.stuck():
        sink.flush(EXIT_FLUSH_SECONDS)


def lines_dropped() -> int:
    """Log lines dropped since start because stderr did not take them (a counter)."""
    sink = _sink
    return 0 if sink is None else sink.dropped_total


class _SinkLogger:
    """structlog's wrapped logger: every method hands the rendered line to the sink."""

    def __init__(self, sink: _LogSink) -> None:
        self._put = sink.put

    def msg(self, message: str) -> None:
        self._put(message)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _SinkHandler(logging.Handler):
    """The stdlib root handler: formats on the caller's thread, writes through the sink."""

    def __init__(self, sink: _LogSink) -> None:
        super().__init__()
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._sink.put(self.format(record))
        except Exception:  # noqa: BLE001 — logging's own contract: report, never raise
            self.handleError(record)


def stderr_is_journal(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """True when ``fd`` is the journal stream systemd connected (``JOURNAL_STREAM``).

    systemd sets ``JOURNAL_STREAM=<device>:<inode>`` (decimal) for a service
    whose stdout or stderr goes to the journal; a child whose stderr was
    redirected elsewhere inherits the variable, hence the fstat comparison.
    """
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, sep, inode = value.partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


def _redact_bodies(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """Replace message-body keys: HL7 bodies carry patient data, which never goes to a log."""
    for key in FORBIDDEN_KEYS.intersection(event_dict):
        event_dict[key] = "<redacted>"
    return event_dict


def _shared_processors(fmt: str) -> list[Processor]:
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        structlog.processors.StackInfoRenderer(),
        _redact_bodies,
    ]
    if fmt == "json":
        # ConsoleRenderer formats exceptions itself (and warns if they are pre-formatted).
        processors.append(structlog.processors.format_exc_info)
    return processors


def _renderer(fmt: str) -> Processor:
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=False)


def _with_priority(renderer: Processor) -> Processor:
    """Prefix the rendered line with ``<N>``, its syslog priority, for journald.

    journald reads the prefix per line, so a multi-line rendering (a console
    traceback) gets it on every line; a JSON line is one line and its JSON
    starts right after the prefix.
    """
    prefixes = {name: f"<{value}>" for name, value in SYSLOG_PRIORITY.items()}
    default = f"<{_DEFAULT_PRIORITY}>"

    def render(logger: WrappedLogger, method: str, event_dict: EventDict) -> str:
        prefix = prefixes.get(str(event_dict.get("level", "")), default)
        text = str(renderer(logger, method, event_dict))
        if "\n" in text:
            text = text.replace("\n", "\n" + prefix)
        return prefix + text

    return render


def _notice_renderer(chain: list[Processor]) -> Callable[[int], str]:
    """The ``log_lines_dropped`` line, rendered by the configured processors."""

    def notice(count: int) -> str:
        event: Any = {
            "event": "log_lines_dropped",
            "lines": count,
            "hint": "stderr did not take log lines fast enough; they were dropped",
        }
        for processor in chain:
            event = processor(None, "warning", event)
        return str(event)

    return notice


def configure_logging(
    level: str = "info",
    fmt: str = "json",
    stream: TextIO | None = None,
    *,
    journald: bool | None = None,
) -> None:
    """Configure structlog and route stdlib logging into the same sink.

    ``stream`` defaults to fd 2 (stderr). ``journald`` adds the ``<N>``
    priority prefix; by default it is on exactly when stderr is the journal
    stream and no other stream was given. Safe to call again: the previous
    configuration and root handler are replaced (lines already queued are
    written first); loggers already cached keep the old processors, so call
    this before logging starts.
    """
    global _stdlib_handler
    level = level.lower()
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use json or console")
    if journald is None:
        journald = stream is None and stderr_is_journal()
    sink = _get_sink()
    sink.flush(EXIT_FLUSH_SECONDS)
    sink.target = _write_fd2 if stream is None else _stream_writer(stream)
    shared = _shared_processors(fmt)
    renderer = _renderer(fmt)
    if journald:
        renderer = _with_priority(renderer)
    sink.notice = _notice_renderer([*shared, renderer])
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_args: _SinkLogger(sink),
        context_class=dict,
        cache_logger_on_first_use=True,
    )

    # stdlib records (websockets, asyncio) go through the same processors.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = _SinkHandler(sink)
    handler.setFormatter(formatter)
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    _stdlib_handler = handler


def bind(**ids: Any) -> contextlib.AbstractContextManager[None]:
    """Bind ids (channel, peer, control_id, row id) to every log line inside the ``with``."""
    return structlog.contextvars.bound_contextvars(**ids)
