"""The websockets shell of one upstream session: it pumps frames through a SessionCore.

A :class:`Session` is one authenticated connection, after hello/welcome
(``agent.runtime.upstream.UpstreamLink`` opens it). ``transmit()`` writes one
frame and waits for the ``transmit_response`` with the same id *and* attempt;
which answer goes to which waiter, and which transmit a server's 1009 blames,
is decided by the sans-I/O ``agent.core.session.SessionCore``. Message bodies
are never logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from agent.core.protocol import ABNORMAL_CLOSURE, Transmit, TransmitResponse
from agent.core.session import SessionClosed, SessionCore
from agent.errors import LocalError

log = structlog.get_logger("agent.runtime.upstream")

__all__ = ["LeaseExpired", "Session"]


class LeaseExpired(LocalError):
    """The write guard could not confirm the lease: the frame was provably not written."""


class Session:
    """One authenticated connection, after hello/welcome: the websockets shell of a SessionCore.

    A reader task feeds every frame to the core, which says which waiting
    transmit it answers; it reads continuously, so the WebSocket never
    buffers frames without limit. Waiters are bounded by the callers.
    """

    def __init__(
        self,
        ws: ClientConnection,
        *,
        replay: bool,
        max_frame_bytes: int,
        generation: int = 1,
        on_closed: Callable[[Session], None] | None = None,
        write_allowed: Callable[[], bool] | None = None,
    ) -> None:
        self.replay = replay
        self.generation = generation  # counts sessions of one link: 1, 2, ...
        self._ws = ws
        self._core: SessionCore[asyncio.Future[TransmitResponse]] = SessionCore(max_frame_bytes)
        self._on_closed = on_closed
        self._write_allowed = write_allowed
        self._closed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._log = log.bind(session=generation)

    def start(self) -> None:
        """Start routing incoming frames (the link calls this once)."""
        if self._reader is None:
            self._reader = asyncio.create_task(
                self._read_loop(), name=f"upstream-session-{self.generation}"
            )

    # -- public API ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def close_info(self) -> SessionClosed | None:
        """Why the session ended (code, reason), or None while it is open."""
        return self._core.close_info if self.closed else None

    @property
    def in_flight(self) -> int:
        """Transmits waiting for their answer (for metrics)."""
        return self._core.in_flight

    async def wait_closed(self) -> SessionClosed:
        """Wait until the connection ends; return its close code and reason."""
        await self._closed.wait()
        assert self._core.close_info is not None
        return self._core.close_info

    async def transmit(self, t: Transmit) -> TransmitResponse:
        """Send ``t`` and wait for the answer to this id and attempt.

        Answers to another attempt of the same id are dropped and logged
        (settles are attempt-scoped). No timeout inside: the dispatcher wraps
        this in ``asyncio.timeout(response_timeout)``; cancelling is safe.

        Raises TransmitTooLarge (a ProtocolError) before sending anything when
        the frame exceeds max_frame_bytes, SessionClosed if the connection ends
        before the answer, TransmitInProgress if this id is already waiting,
        LeaseExpired (nothing written) when the write guard refuses.
        """
        frame = self._core.prepare(t)
        # The last check before the write, with no await between the two: a
        # holder frozen past its lease (SIGSTOP, a VM pause) wakes up here and
        # must not put its stale frame on the wire.
        if self._write_allowed is not None and not self._write_allowed():
            raise LeaseExpired(f"transmit {t.id} attempt {t.attempt} not sent: the lease is not proven valid")
        future: asyncio.Future[TransmitResponse] = asyncio.get_running_loop().create_future()
        self._core.expect(t, frame, future)
        try:
            try:
                await self._ws.send(frame.text)
            except ConnectionClosed:
                # The reader sees the same close and fails the future with the
                # server's close code; fall through and await it.
                pass
            return await future
        finally:
            self._core.forget(t.id, future)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection (closing handshake) and wait for the reader to finish."""
        await self._ws.close(code, reason)
        if self._reader is not None:
            await asyncio.wait({self._reader})
        else:
            self._mark_closed()

    def abort(self) -> None:
        """Drop the TCP connection at once (used when cancelled mid-close)."""
        self._ws.transport.abort()

    # -- internals -------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            async for frame in self._ws:
                got = self._core.receive(frame)
                if got.note is not None:
                    got.note.write(self._log)
                if got.waiter is not None and got.response is not None and not got.waiter.done():
                    got.waiter.set_result(got.response)
        except ConnectionClosed:
            pass  # abnormal closure; the close code is read below
        except Exception:  # noqa: BLE001 - logged with traceback; the session must end, not hang
            # Our bug, not the server's: drop the connection (the link
            # reconnects, the dispatcher recovers inflight rows) rather than
            # keep a session whose answers nobody routes.
            self._log.exception("upstream_reader_crashed")
            self._ws.transport.abort()
        finally:
            self._mark_closed()

    def _mark_closed(self) -> None:
        if self._closed.is_set():
            return
        code, reason, by_server = _close_facts(self._ws)
        info, waiters = self._core.close(code, reason, by_server=by_server)
        for future in waiters:
            if not future.done():
                future.set_exception(info.copy())
        self._closed.set()
        if self._on_closed is not None:
            self._on_closed(self)


def _close_facts(ws: ClientConnection) -> tuple[int | None, str, bool]:
    """Who closed first and with which code: (code, reason, by_server) (RFC 6455 section 7.1.5 / 7.4)."""
    p = ws.protocol
    if p.close_rcvd is not None and (p.close_sent is None or p.close_rcvd_then_sent):
        return p.close_rcvd.code, p.close_rcvd.reason, True
    if p.close_sent is not None:
        return p.close_sent.code, p.close_sent.reason, False
    return ABNORMAL_CLOSURE, "connection lost without a Close frame", False
