"""One upstream session's bookkeeping, sans I/O: which transmit waits for which answer, and why it ended.

The websockets shell (``agent.runtime.upstream.Session``) writes the frames
this object prepares and feeds it the frames it reads; this object decides:

- :meth:`SessionCore.prepare`: the frame text for a transmit, or why it must
  not be written (too large, the same id already waiting, the session over);
- :meth:`SessionCore.receive`: which waiter a ``transmit_response`` answers —
  the one waiting for that id *and* attempt: an answer to an older send that
  timed out must never settle a newer one (docs/protocol.md#attempts) — and
  a note for anything else the server said;
- :meth:`SessionCore.close`: the close facts every waiter gets, with the
  transmit a server's 1009 blames (docs/protocol.md#close-codes).

A waiter is whatever the shell resolves (an ``asyncio.Future``): opaque here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from agent.core.dispatch import Note, too_big_victim
from agent.core.protocol import (
    EPOCH_REFUSED,
    MESSAGE_TOO_BIG,
    ErrorMessage,
    Transmit,
    TransmitResponse,
    Welcome,
    parse_server_frame,
)
from agent.errors import LocalError, ProtocolError

__all__ = [
    "Received",
    "SessionClosed",
    "SessionCore",
    "TransmitInProgress",
    "TransmitTooLarge",
]

W = TypeVar("W")
#: Error texts from the server are operator hints; keep log lines bounded.
MAX_LOGGED_TEXT = 500


class SessionClosed(LocalError):
    """The session's connection ended; raised to every transmit still waiting.

    ``code``/``reason`` come from the Close frame of whoever closed first: the
    server's when ``by_server``, else ours; 1006 when no Close frame was
    exchanged (RFC 6455 section 7.1.5); ``None`` when there never was a
    connection. ``victim``: with a server's 1009, the id of the largest
    transmit that was in flight (:attr:`too_big` blames it alone; a 1009 we
    sent means the server's frame was too big for us).
    """

    def __init__(self, code: int | None, reason: str = "", *, by_server: bool = False,
                 victim: str | None = None) -> None:
        super().__init__(f"upstream session closed (code {code}: {reason or 'no reason'})")
        self.code = code
        self.reason = reason
        self.by_server = by_server
        self.victim = victim

    @property
    def too_big(self) -> bool:
        """The server closed with 1009: a frame we sent exceeded its limit (docs/protocol.md#size-limits)."""
        return self.by_server and self.code == MESSAGE_TOO_BIG

    @property
    def epoch_refused(self) -> bool:
        """The server closed with 4001: it has seen a higher lease epoch for this agent and queue."""
        return self.by_server and self.code == EPOCH_REFUSED

    def copy(self) -> SessionClosed:
        """A fresh exception with the same facts (one instance per raise)."""
        return SessionClosed(self.code, self.reason, by_server=self.by_server, victim=self.victim)


class TransmitTooLarge(ProtocolError):
    """The transmit frame exceeds max_frame_bytes, so it was never sent (the row is settled rejected)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"transmit frame of {size} bytes exceeds the {limit} byte frame limit")
        self.size = size
        self.limit = limit


class TransmitInProgress(LocalError):
    """A transmit for this id is already waiting on this session (a dispatcher bug)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A transmit ready to write: its JSON text and that text's size in UTF-8 bytes."""

    text: str
    size: int


@dataclass(frozen=True, slots=True)
class Received(Generic[W]):
    """What one frame from the server means: a waiter to resolve, and/or a note to log."""

    waiter: W | None = None
    response: TransmitResponse | None = None
    note: Note | None = None


@dataclass(slots=True)
class _Waiting(Generic[W]):
    attempt: int
    size: int
    waiter: W


class SessionCore(Generic[W]):
    """The transmits waiting on one session, keyed by id, and the session's end."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._waiting: dict[str, _Waiting[W]] = {}
        self.close_info: SessionClosed | None = None

    @property
    def in_flight(self) -> int:
        """Transmits waiting for their answer."""
        return len(self._waiting)

    def prepare(self, t: Transmit) -> Frame:
        """The frame for ``t``; raises TransmitTooLarge, SessionClosed or TransmitInProgress instead.

        The size is checked first: a frame over the limit is never sent, on
        this session or any other (docs/protocol.md#size-limits).
        """
        text = t.to_json()
        # An ASCII text is its own UTF-8 size (str.isascii reads a flag: no copy).
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
        if size > self.max_frame_bytes:
            raise TransmitTooLarge(size, self.max_frame_bytes)
        if self.close_info is not None:
            raise self.close_info.copy()
        if t.id in self._waiting:
            raise TransmitInProgress(f"transmit {t.id} is already waiting on this session")
        return Frame(text, size)

    def expect(self, t: Transmit, frame: Frame, waiter: W) -> None:
        """``t`` is about to be written: its answer goes to ``waiter``."""
        self._waiting[t.id] = _Waiting(t.attempt, frame.size, waiter)

    def forget(self, message_id: str, waiter: W) -> None:
        """The waiter gave up (answered, cancelled, timed out): a later answer finds no one."""
        current = self._waiting.get(message_id)
        if current is not None and current.waiter is waiter:
            del self._waiting[message_id]

    def receive(self, frame: str | bytes) -> Received[W]:
        """Route one frame the server sent."""
        try:
            message = parse_server_frame(frame)
        except ProtocolError as exc:
            return Received(note=Note.of("warning", "upstream_protocol_error",
                                         error=str(exc)[:MAX_LOGGED_TEXT]))
        if isinstance(message, TransmitResponse):
            return self._answer(message)
        if isinstance(message, ErrorMessage):
            return Received(note=Note.of("warning", "upstream_error_message",
                                         message=message.message[:MAX_LOGGED_TEXT]))
        assert isinstance(message, Welcome)
        return Received(note=Note.of("warning", "upstream_unexpected_welcome"))

    def _answer(self, response: TransmitResponse) -> Received[W]:
        waiting = self._waiting.get(response.id)
        if waiting is None:
            return Received(note=Note.of("info", "upstream_response_unmatched", id=response.id,
                                         attempt=response.attempt, status=response.status))
        if response.attempt != waiting.attempt:
            return Received(note=Note.of("info", "upstream_response_stale", id=response.id,
                                         attempt=response.attempt, waiting_attempt=waiting.attempt,
                                         status=response.status))
        del self._waiting[response.id]
        return Received(waiter=waiting.waiter, response=response)

    def close(self, code: int | None, reason: str, *, by_server: bool) -> tuple[SessionClosed, list[W]]:
        """The session ended: its close facts (the first close counts) and every waiter to fail."""
        if self.close_info is None:
            victim = None
            if by_server and code == MESSAGE_TOO_BIG:
                victim = too_big_victim((mid, w.size) for mid, w in self._waiting.items())
            self.close_info = SessionClosed(code, reason, by_server=by_server, victim=victim)
        waiters = [w.waiter for w in self._waiting.values()]
        self._waiting.clear()
        return self.close_info, waiters
