"""Logging: structlog, one JSON object per line on stderr (journald and Docker capture it).

The production setup follows structlog's recommendations: context bound with
contextvars (ids per connection and per message), a filtering bound logger
(a disabled level costs one method call), loggers cached on first use. The
stdlib ``logging`` (websockets logs through it) is rendered by the same
processors into the same stream, at warning and above only: websockets' debug
output includes frame contents, i.e. message bodies.

Never log message bodies or patient data; as a last line of defence, values of
the keys ``body``, ``raw`` and ``payload`` are replaced before rendering.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = ["FORBIDDEN_KEYS", "bind", "configure_logging"]

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "console")
FORBIDDEN_KEYS = frozenset({"body", "raw", "payload"})

# The handler this module installed on the root logger, so a reconfigure
# replaces it instead of stacking duplicates.
_stdlib_handler: logging.Handler | None = None


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at write time.

    Cached loggers keep their file object; binding the *current* stderr lazily
    means a logger cached before the stream was swapped (pytest capture, a
    daemon redirect) never writes to a closed file.
    """

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except (OSError, ValueError):
            _abandon_stderr()
            return len(text)

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            _abandon_stderr()


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


def _redact_bodies(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """Replace message-body keys: HL7 bodies carry patient data (SPEC 4, last bullet)."""
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


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Configure structlog and route stdlib logging into the same output.

    ``stream`` defaults to stderr (looked up at write time). Safe to call again:
    the previous configuration and root handler are replaced; loggers already
    cached keep the old processors, so call this before logging starts.
    """
    global _stdlib_handler
    level = level.lower()
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use json or console")
    out: Any = stream if stream is not None else _CurrentStderr()
    shared = _shared_processors(fmt)
    renderer = _renderer(fmt)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        context_class=dict,
        cache_logger_on_first_use=True,
    )

    # stdlib records (websockets, asyncio) go through the same processors.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(out)
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
