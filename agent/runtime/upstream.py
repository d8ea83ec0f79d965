"""The WebSocket link to the upstream server (SPEC 5), kept thin on purpose.

``UpstreamLink.run()`` owns the connection: connect, hello, wait for welcome,
publish a :class:`Session`, and reconnect with capped exponential backoff and
jitter (``agent.core.retry``) whenever it drops, until ``close()``. A ``Session`` is
one authenticated connection: ``transmit()`` writes one frame and waits for the
``transmit_response`` with the same id *and* attempt.

Before every write to the server (hello, transmit) the link asks the
dispatcher's ``write_allowed`` guard whether its lease still stands; a refusal
means the frame is never written (``LeaseExpired``). ``hello`` carries the
lease epoch and the queue's id; a server that saw a higher epoch for them
refuses this holder and closes with 4001, after which the link stops
reconnecting (``refused``) and the dispatcher rechecks its lease.

What this module deliberately does not do: retry transmits, time them out, or
decide what a status means. Those belong to the dispatcher, which holds the
lease and settles rows (SPEC 6); a link that retried on its own could send a
frame the database does not know is inflight.

Frames are JSON built and parsed by ``agent.core.protocol``; message bodies are
never logged.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.http11 import USER_AGENT

from agent.core.protocol import (
    ErrorMessage,
    Hello,
    Transmit,
    TransmitResponse,
    Welcome,
    parse_server_frame,
)
from agent.core.protocol import max_frame_bytes as _max_frame_bytes
from agent.core.retry import backoff
from agent.errors import LocalError, ProtocolError
from agent.runtime.aio import unless, wait_event

log = structlog.get_logger(__name__)

#: RFC 6455 section 7.1.5: with no Close frame received, the close code is 1006.
ABNORMAL_CLOSURE = 1006
#: RFC 6455 section 7.4.1: 1009, "message too big" (SPEC 5 rejects the largest transmit).
MESSAGE_TOO_BIG = 1009
#: Close code of protocol v1 (RFC 6455 section 7.4.2: 4000-4999 are private
#: use): the server has seen a higher lease epoch for this agent and queue,
#: so this session's holder is stale.
EPOCH_REFUSED = 4001
#: A session that lived this long counts as healthy: the reconnect backoff starts over.
STABLE_SESSION_SECONDS = 30.0
#: Error texts from the server are operator hints; keep log lines bounded.
_MAX_LOGGED_TEXT = 500

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Everything the link needs from ``[server]`` (SPEC 3) plus identity for hello."""

    url: str
    token: str | None
    agent_id: str
    version: str
    connect_timeout: float = 10.0  # TCP + TLS + HTTP upgrade, and again for the welcome
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    max_frame_bytes: int = _max_frame_bytes(1_048_576)  # SPEC 5, default max_message_bytes
    proxy: str = "none"  # "none" (SPEC 5 default: ignore *_PROXY env) or a proxy URL
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    reconnect_initial: float = 1.0
    reconnect_cap: float = 60.0
    #: Called before every connect (token_file rotation needs no restart);
    #: ``token`` is used when it is None or fails.
    token_source: Callable[[], str | None] | None = None
    #: The lease epoch this link's sessions dispatch under, and the queue's
    #: UUID: sent in hello so a server can refuse a stale holder.
    epoch: int | None = None
    queue_id: str | None = None


class SessionClosed(LocalError):
    """The session's connection ended; raised to every transmit still waiting.

    ``code``/``reason`` come from the Close frame of whoever closed first: the
    server's when ``by_server``, else ours; 1006 when no Close frame was
    exchanged (RFC 6455 section 7.1.5); ``None`` when there never was a
    connection. Use :attr:`too_big` for SPEC 5's 1009 rule: only a 1009 the
    *server* sent blames our largest transmit (a 1009 we sent means the
    server's frame was too big for us).
    """

    def __init__(self, code: int | None, reason: str = "", *, by_server: bool = False) -> None:
        super().__init__(f"upstream session closed (code {code}: {reason or 'no reason'})")
        self.code = code
        self.reason = reason
        self.by_server = by_server

    @property
    def too_big(self) -> bool:
        """The server closed with 1009: a frame we sent exceeded its limit (SPEC 5)."""
        return self.by_server and self.code == MESSAGE_TOO_BIG

    @property
    def epoch_refused(self) -> bool:
        """The server closed with 4001: it has seen a higher lease epoch for this agent and queue."""
        return self.by_server and self.code == EPOCH_REFUSED

    def copy(self) -> SessionClosed:
        """A fresh exception with the same facts (one instance per raise)."""
        return SessionClosed(self.code, self.reason, by_server=self.by_server)


class TransmitTooLarge(ProtocolError):
    """The transmit frame exceeds max_frame_bytes, so it was never sent (SPEC 5: settle rejected)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"transmit frame of {size} bytes exceeds the {limit} byte frame limit")
        self.size = size
        self.limit = limit


class TransmitInProgress(LocalError):
    """A transmit for this id is already waiting on this session (a dispatcher bug)."""


class LeaseExpired(LocalError):
    """The write guard could not confirm the lease: the frame was provably not written."""


def _safe_url(url: str) -> str:
    """The URL without userinfo or query, which may carry credentials (for logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class Session:
    """One authenticated connection, after hello/welcome.

    A reader task routes each ``transmit_response`` to the transmit waiting for
    that id and attempt; it reads continuously, so the WebSocket never buffers
    frames without limit. Waiters are bounded by the callers (one per channel).
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
        self._max_frame_bytes = max_frame_bytes
        self._on_closed = on_closed
        self._write_allowed = write_allowed
        self._waiters: dict[str, tuple[int, asyncio.Future[TransmitResponse]]] = {}
        self._closed = asyncio.Event()
        self._close_info: SessionClosed | None = None
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
    def closed_event(self) -> asyncio.Event:
        """Set once the connection is gone (for ``asyncio.wait`` alongside other events)."""
        return self._closed

    @property
    def close_info(self) -> SessionClosed | None:
        """Why the session ended (code, reason), or None while it is open."""
        return self._close_info

    @property
    def in_flight(self) -> int:
        """Transmits waiting for their answer (for metrics)."""
        return len(self._waiters)

    async def wait_closed(self) -> SessionClosed:
        """Wait until the connection ends; return its close code and reason."""
        await self._closed.wait()
        assert self._close_info is not None
        return self._close_info

    async def transmit(self, t: Transmit) -> TransmitResponse:
        """Send ``t`` and wait for the answer to this id and attempt.

        Answers to another attempt of the same id are dropped and logged (an
        answer to an older send that timed out must not settle this one, SPEC 6
        "settles are attempt-scoped"). No timeout inside: the dispatcher wraps
        this in ``asyncio.timeout(response_timeout)``; cancelling is safe.

        Raises TransmitTooLarge (a ProtocolError) before sending anything when
        the frame exceeds max_frame_bytes, SessionClosed if the connection ends
        before the answer, TransmitInProgress if this id is already waiting,
        LeaseExpired (nothing written) when the write guard refuses.
        """
        text = t.to_json()
        size = len(text.encode("utf-8"))
        if size > self._max_frame_bytes:
            raise TransmitTooLarge(size, self._max_frame_bytes)
        if self._close_info is not None:
            raise self._close_info.copy()
        if t.id in self._waiters:
            raise TransmitInProgress(f"transmit {t.id} is already waiting on this session")
        # The last check before the write, with no await between the two: a
        # holder frozen past its lease (SIGSTOP, a VM pause) wakes up here and
        # must not put its stale frame on the wire.
        if self._write_allowed is not None and not self._write_allowed():
            raise LeaseExpired(f"transmit {t.id} attempt {t.attempt} not sent: the lease is not proven valid")
        future: asyncio.Future[TransmitResponse] = asyncio.get_running_loop().create_future()
        self._waiters[t.id] = (t.attempt, future)
        try:
            try:
                await self._ws.send(text)
            except ConnectionClosed:
                # The reader sees the same close and fails the future with the
                # server's close code; fall through and await it.
                pass
            return await future
        finally:
            current = self._waiters.get(t.id)
            if current is not None and current[1] is future:
                del self._waiters[t.id]

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
                self._route(frame)
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

    def _route(self, frame: str | bytes) -> None:
        try:
            message = parse_server_frame(frame)
        except ProtocolError as exc:
            self._log.warning("upstream_protocol_error", error=str(exc)[:_MAX_LOGGED_TEXT])
            return
        if isinstance(message, TransmitResponse):
            self._deliver(message)
        elif isinstance(message, ErrorMessage):
            self._log.warning("upstream_error_message", message=message.message[:_MAX_LOGGED_TEXT])
        elif isinstance(message, Welcome):
            self._log.warning("upstream_unexpected_welcome")

    def _deliver(self, response: TransmitResponse) -> None:
        waiter = self._waiters.get(response.id)
        if waiter is None:
            self._log.info(
                "upstream_response_unmatched",
                id=response.id,
                attempt=response.attempt,
                status=response.status,
            )
            return
        attempt, future = waiter
        if response.attempt != attempt:
            self._log.info(
                "upstream_response_stale",
                id=response.id,
                attempt=response.attempt,
                waiting_attempt=attempt,
                status=response.status,
            )
            return
        del self._waiters[response.id]
        if not future.done():
            future.set_result(response)

    def _mark_closed(self) -> None:
        if self._close_info is not None:
            return
        self._close_info = _close_facts(self._ws)
        for _attempt, future in self._waiters.values():
            if not future.done():
                future.set_exception(self._close_info.copy())
        self._waiters.clear()
        self._closed.set()
        if self._on_closed is not None:
            self._on_closed(self)


def _close_facts(ws: ClientConnection) -> SessionClosed:
    """Who closed first and with which code (RFC 6455 section 7.1.5 / 7.4)."""
    p = ws.protocol
    if p.close_rcvd is not None and (p.close_sent is None or p.close_rcvd_then_sent):
        return SessionClosed(p.close_rcvd.code, p.close_rcvd.reason, by_server=True)
    if p.close_sent is not None:
        return SessionClosed(p.close_sent.code, p.close_sent.reason, by_server=False)
    return SessionClosed(ABNORMAL_CLOSURE, "connection lost without a Close frame")


def _ssl_context(settings: LinkSettings) -> ssl.SSLContext | None:
    """TLS for wss:// from ca_file / client_cert / client_key; None for ws://."""
    if urlsplit(settings.url).scheme != "wss":
        return None
    context = ssl.create_default_context(cafile=settings.ca_file)
    if settings.client_cert:
        context.load_cert_chain(settings.client_cert, settings.client_key)
    return context


class UpstreamLink:
    """Keeps one session to the server up, forever, until ``close()``."""

    def __init__(
        self,
        settings: LinkSettings,
        *,
        rng: random.Random | None = None,
        on_connected_change: Callable[[bool], None] | None = None,
        write_allowed: Callable[[], bool] | None = None,
    ) -> None:
        self._settings = settings
        self._token = settings.token
        self._rng = rng
        self._on_connected_change = on_connected_change
        self._current: Session | None = None
        self._generation = 0
        self._up = asyncio.Event()
        self._stop = asyncio.Event()
        self._done = asyncio.Event()
        self._running = False
        self._write_allowed = write_allowed
        #: Set when the server refused this link's epoch (close code 4001):
        #: the link does not reconnect; its owner rechecks the lease.
        self.refused = asyncio.Event()
        self.last_error: str | None = None
        self._log = log.bind(url=_safe_url(settings.url))

    # -- public API ----------------------------------------------------------

    @property
    def connected(self) -> bool:
        s = self._current
        return s is not None and not s.closed

    def current(self) -> Session | None:
        """The open session, or None (never blocks)."""
        s = self._current
        return s if s is not None and not s.closed else None

    async def session(self) -> Session:
        """Wait until a session is up and return it; SessionClosed once the link is closed or refused."""
        while True:
            if self._stop.is_set():
                raise SessionClosed(None, "upstream link closed")
            if self.refused.is_set():
                raise SessionClosed(EPOCH_REFUSED, "the server refused this lease epoch", by_server=True)
            s = self.current()
            if s is not None:
                return s
            await self._first(self._up.wait(), self._stop.wait(), self.refused.wait())

    async def run(self) -> None:
        """Connect, hello, welcome, publish; reconnect with backoff on loss; until close()."""
        if self._running:
            raise RuntimeError("UpstreamLink.run() is already running")
        self._running = True
        s = self._settings
        delays = backoff(s.reconnect_initial, 2.0, s.reconnect_cap, rng=self._rng)
        loop = asyncio.get_running_loop()
        try:
            while not self._stop.is_set() and not self.refused.is_set():
                session = await self._until_stopped(self._connect_once())
                if session is not None:
                    started = loop.time()
                    self._publish(session)
                    await self._first(session.wait_closed(), self._stop.wait())
                    if self._stop.is_set():
                        break
                    info = session.close_info
                    self.last_error = str(info)
                    self._log.warning(
                        "upstream_disconnected",
                        code=info.code if info else None,
                        reason=info.reason if info else "",
                        session=session.generation,
                    )
                    if info is not None and info.epoch_refused:
                        self._epoch_refused(info.reason, session=session.generation)
                        break
                    if loop.time() - started >= STABLE_SESSION_SECONDS:
                        delays = backoff(s.reconnect_initial, 2.0, s.reconnect_cap, rng=self._rng)
                if self.refused.is_set():
                    break
                delay = next(delays)
                self._log.info("upstream_reconnect_scheduled", delay_s=round(delay, 3))
                await wait_event(self._stop, delay)
        finally:
            current = self._current
            if current is not None and not current.closed:
                try:
                    await current.close(1001, "agent shutting down")
                except asyncio.CancelledError:
                    current.abort()
                    raise
            self._up.clear()
            self._running = False
            self._done.set()

    async def close(self) -> None:
        """Close the connection and stop run(); waits for run() to return."""
        self._stop.set()
        current = self._current
        if current is not None and not current.closed:
            await current.close(1001, "agent shutting down")
        if self._running:
            await self._done.wait()

    # -- internals -------------------------------------------------------------

    def _publish(self, session: Session) -> None:
        self._current = session
        self.last_error = None
        self._up.set()
        self._log.info("upstream_connected", replay=session.replay, session=session.generation)
        if self._on_connected_change is not None:
            self._on_connected_change(True)

    def _epoch_refused(self, reason: str, **fields: Any) -> None:
        """The server has seen a higher epoch for us: stop; the owner rechecks its lease."""
        s = self._settings
        self.last_error = f"server refused lease epoch {s.epoch} (close code {EPOCH_REFUSED})"
        self._log.error(
            "upstream_epoch_refused",
            epoch=s.epoch,
            queue_id=s.queue_id,
            reason=reason[:_MAX_LOGGED_TEXT],
            hint="another process of this agent dispatches under a newer lease epoch; "
            "this one stops sending and rechecks the lease",
            **fields,
        )
        self.refused.set()

    def _session_closed(self, session: Session) -> None:
        if session is self._current:
            self._up.clear()
            if self._on_connected_change is not None:
                self._on_connected_change(False)

    async def _first(self, *aws: Coroutine[Any, Any, Any]) -> None:
        """Wait until the first of ``aws`` finishes; cancel the rest."""
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    async def _until_stopped(self, coro: Awaitable[_T]) -> _T | None:
        """Run ``coro`` unless close() is called first (then cancel it and return None)."""
        done = await unless(coro, self._stop)
        return None if done is None or done.cancelled() else done.result()

    def _current_token(self) -> str | None:
        """The token for this connect: fresh from its source, else the last one known."""
        source = self._settings.token_source
        if source is not None:
            try:
                self._token = source()
            except Exception as exc:  # noqa: BLE001 - an unreadable file must not stop reconnecting
                self._log.warning("upstream_token_unreadable", error=str(exc))
        return self._token

    async def _connect_once(self) -> Session | None:
        """One attempt: WebSocket upgrade, hello, welcome. None (logged) on failure."""
        s = self._settings
        if self._write_allowed is not None and not self._write_allowed():
            self.last_error = "lease not proven valid: not connecting"
            self._log.warning("upstream_connect_skipped", epoch=s.epoch)
            return None
        token = self._current_token()
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            ws = await connect(
                s.url,
                additional_headers=headers,
                user_agent_header=f"hl7-agent/{s.version} {USER_AGENT}",
                # SPEC 5: no proxy unless configured. proxy=None stops websockets
                # from reading HTTPS_PROXY / ALL_PROXY from the environment.
                proxy=None if s.proxy == "none" else s.proxy,
                open_timeout=s.connect_timeout,
                ping_interval=s.ping_interval,
                ping_timeout=s.ping_timeout,
                max_size=s.max_frame_bytes,
                compression=None,
                ssl=_ssl_context(s),
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status == 401:
                self.last_error = "server refused the token (HTTP 401)"
                self._log.error(
                    "upstream_auth_failed",
                    status=status,
                    hint="the server refused the bearer token: fix [server] token or "
                    "token_file (HL7_AGENT_SERVER__TOKEN); retrying with backoff",
                )
            else:
                self.last_error = f"server refused the WebSocket upgrade (HTTP {status})"
                self._log.warning("upstream_upgrade_refused", status=status)
            return None
        except (OSError, TimeoutError, WebSocketException) as exc:
            # OSError covers refused connections, DNS and TLS (ssl.SSLError).
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._log.warning("upstream_connect_failed", error=self.last_error)
            return None

        try:
            replay = await self._handshake(ws)
        except asyncio.CancelledError:
            ws.transport.abort()
            raise
        if replay is None:
            return None
        self._generation += 1
        session = Session(
            ws,
            replay=replay,
            max_frame_bytes=s.max_frame_bytes,
            generation=self._generation,
            on_closed=self._session_closed,
            write_allowed=self._write_allowed,
        )
        session.start()
        return session

    async def _handshake(self, ws: ClientConnection) -> bool | None:
        """Send hello, wait up to connect_timeout for welcome; its replay flag, or None."""
        s = self._settings
        if self._write_allowed is not None and not self._write_allowed():
            self.last_error = "lease not proven valid: no hello sent"
            self._log.warning("upstream_hello_not_sent", epoch=s.epoch)
            ws.transport.abort()  # not even a Close frame: nothing goes out under this lease
            return None
        hello = Hello(agent_id=s.agent_id, version=s.version, epoch=s.epoch, queue_id=s.queue_id)
        try:
            await ws.send(hello.to_json())
            # asyncio.timeout, not wait_for (see agent.runtime.aio): a close() in the
            # turn the welcome arrives must cancel this connect, not let it
            # return a session nobody will ever close.
            async with asyncio.timeout(s.connect_timeout):
                welcome = await self._await_welcome(ws)
        except TimeoutError:
            self.last_error = f"no welcome within {s.connect_timeout} s"
            self._log.warning("upstream_welcome_timeout", timeout_s=s.connect_timeout)
            await ws.close(1002, "no welcome")
            return None
        except ProtocolError as exc:
            self.last_error = f"protocol error before welcome: {exc}"
            self._log.warning("upstream_protocol_error", error=str(exc)[:_MAX_LOGGED_TEXT])
            await ws.close(1002, "expected welcome")
            return None
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else ABNORMAL_CLOSURE
            self.last_error = f"connection closed before welcome (code {code})"
            self._log.warning("upstream_closed_before_welcome", code=code)
            if code == EPOCH_REFUSED and exc.rcvd is not None:
                self._epoch_refused(exc.rcvd.reason)
            return None
        return welcome.replay

    async def _await_welcome(self, ws: ClientConnection) -> Welcome:
        while True:
            message = parse_server_frame(await ws.recv())
            if isinstance(message, Welcome):
                return message
            if isinstance(message, ErrorMessage):
                self._log.warning(
                    "upstream_error_message", message=message.message[:_MAX_LOGGED_TEXT]
                )
                continue
            raise ProtocolError(f"expected welcome, got {type(message).__name__}")


__all__ = [
    "EPOCH_REFUSED",
    "LeaseExpired",
    "LinkSettings",
    "Session",
    "SessionClosed",
    "TransmitInProgress",
    "TransmitTooLarge",
    "UpstreamLink",
]
