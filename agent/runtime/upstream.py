"""The WebSocket link to the upstream server (docs/protocol.md), kept thin on purpose.

``UpstreamLink.run()`` owns the connection: connect, hello, wait for welcome,
publish a :class:`~agent.runtime.upstream_session.Session`, and reconnect with
capped exponential backoff and jitter (``agent.core.retry``) whenever it
drops, until ``close()``. A ``Session`` is one authenticated connection:
``transmit()`` writes one frame and waits for the ``transmit_response`` with
the same id *and* attempt (its routing is the sans-I/O
``agent.core.session.SessionCore``).

Before every write to the server (hello, transmit) the link asks the
dispatcher's ``write_allowed`` guard whether its lease still stands; a refusal
means the frame is never written (``LeaseExpired``). ``hello`` carries the
lease epoch and the queue's id; a server that saw a higher epoch for them
refuses this holder and closes with 4001, after which the link stops
reconnecting (``refused``) and the dispatcher rechecks its lease
(docs/protocol.md#epoch-fencing).

What this module deliberately does not do: retry transmits, time them out, or
decide what a status means. Those belong to the dispatcher, which holds the
lease and settles rows (docs/queue.md#recovery); a link that retried on its
own could send a frame the database does not know is inflight.

Frames are JSON built and parsed by ``agent.core.protocol``; message bodies are
never logged.

Just over 400 lines on purpose: connect, hello/welcome, the lease guard and
reconnecting are one connection lifecycle (the session itself is
agent.runtime.upstream_session).
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.http11 import USER_AGENT

from agent.core.protocol import (
    ABNORMAL_CLOSURE,
    EPOCH_REFUSED,
    ErrorMessage,
    Hello,
    Welcome,
    parse_server_frame,
)
from agent.core.protocol import max_frame_bytes as _max_frame_bytes
from agent.core.retry import backoff
from agent.core.session import (
    MAX_LOGGED_TEXT,
    SessionClosed,
    TransmitInProgress,
    TransmitTooLarge,
)
from agent.errors import ProtocolError
from agent.runtime.aio import unless, wait_event
from agent.runtime.tls_files import load_pair, verifying_context
from agent.runtime.upstream_session import LeaseExpired, Session

log = structlog.get_logger(__name__)

#: A session that lived this long counts as healthy: the reconnect backoff starts over.
STABLE_SESSION_SECONDS = 30.0
#: How long a closing handshake waits for the server's Close frame (websockets'
#: default is 10 s), ours at shutdown and the one after a keepalive ping went
#: unanswered: a server that froze must hold neither a stop past its budget nor
#: a dead session on the status page as "connected" (RFC 6455 7.1.1 lets the
#: client drop the TCP connection once it waited a reasonable time).
CLOSE_TIMEOUT = 2.0

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Everything the link needs from ``[server]`` (docs/configuration.md) plus identity for hello."""

    url: str
    token: str | None
    agent_id: str
    version: str
    connect_timeout: float = 10.0  # TCP + TLS + HTTP upgrade, and again for the welcome
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    max_frame_bytes: int = _max_frame_bytes(1_048_576)  # the default max_message_bytes
    proxy: str = "none"  # "none" (the default: ignore *_PROXY env) or a proxy URL
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


def safe_url(url: str) -> str:
    """The URL without userinfo or query, which may carry credentials (for logs, the status page, errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def url_for_token(url: str) -> str:
    """The URL to connect to when a bearer token authenticates: without its user info.

    websockets turns ``user:password@`` into an ``Authorization: Basic``
    header, which beside our ``Bearer`` one makes two: servers refuse that
    (500), and protocol v1 names the bearer token only.
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _ssl_context(settings: LinkSettings) -> ssl.SSLContext | None:
    return upstream_ssl_context(settings.url, settings.ca_file, settings.client_cert, settings.client_key)


def upstream_ssl_context(url: str | None, ca_file: str | Path | None, client_cert: str | Path | None,
                         client_key: str | Path | None) -> ssl.SSLContext | None:
    """TLS for wss:// from ca_file / client_cert / client_key; None for ws:// (or no URL)."""
    if url is None or urlsplit(url).scheme.lower() != "wss":
        return None
    context = verifying_context(ca_file, setting="ca_file")
    if client_cert:
        load_pair(context, client_cert, client_key, cert_key="client_cert", key_key="client_key")
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
        self._log = log.bind(url=safe_url(settings.url))

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

    async def close(self, within: float | None = None) -> None:
        """Close the connection and stop run(); waits for run() to return.

        ``within``: seconds, after which the connection is dropped without
        waiting any longer (a server that froze must not hold a stop past its budget).
        """
        self._stop.set()
        current = self._current
        try:
            async with asyncio.timeout(within):
                if current is not None and not current.closed:
                    await current.close(1001, "agent shutting down")
                if self._running:
                    await self._done.wait()
        except TimeoutError:
            self._log.warning("upstream_close_abandoned", after_s=within)
            if current is not None:
                current.abort()
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
            reason=reason[:MAX_LOGGED_TEXT],
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
                url_for_token(s.url) if token else s.url,
                additional_headers=headers,
                user_agent_header=f"hl7-agent/{s.version} {USER_AGENT}",
                # No proxy unless configured (docs/configuration.md). proxy=None stops websockets
                # from reading HTTPS_PROXY / ALL_PROXY from the environment.
                proxy=None if s.proxy == "none" else s.proxy,
                open_timeout=s.connect_timeout,
                ping_interval=s.ping_interval,
                ping_timeout=s.ping_timeout,
                close_timeout=CLOSE_TIMEOUT,
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
            self._log.warning("upstream_protocol_error", error=str(exc)[:MAX_LOGGED_TEXT])
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
                    "upstream_error_message", message=message.message[:MAX_LOGGED_TEXT]
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
