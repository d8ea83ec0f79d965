"""MLLP over TLS: the server-side handshake, and failed handshakes logged without flooding.

The listener accepts plain TCP and runs the handshake itself (``start_tls``,
in :class:`TlsAccept`) instead of handing an ``ssl`` context to
``create_server``: asyncio
drops a failed server handshake silently (it reports it only in debug mode),
so an operator would never learn that a sender speaks plain MLLP to a TLS
port or presents a certificate the channel's CA did not sign. It also lets
``allowed_sources`` refuse a peer before any TLS work is spent on it.

Failures are logged as ``tls_handshake_failed`` once per source address per
minute, with the number of failures not logged since (``not_logged``): a
sender retrying every second must not fill the log. Nothing of what the
peer sent is logged, only the TLS library's reason.

A handshake is admission's too: it must finish within
:func:`handshake_timeout` (``frame_timeout`` at most: a connection that sends
nothing is slowloris before its first byte of MLLP as after), and handshakes
under way are bounded like connections (``ChannelListener.handshake_started``:
a newcomer crowds out the oldest unfinished one of its source, or of the
channel), so connections that never finish one cannot hold a channel or the
process's file descriptors.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent.runtime.mllp_connection import Connection

if TYPE_CHECKING:
    from agent.runtime.mllp_server import ChannelListener

#: Seconds a sender has at most to complete the handshake once connected (one
#: takes milliseconds; asyncio's default, 60 s, let idle sockets pile up).
HANDSHAKE_TIMEOUT = 10.0
#: A source's failures are logged at most once per this many seconds.
FAILURE_LOG_INTERVAL = 60.0
#: Sources remembered for the rate limit; a scan of many addresses is forgotten, not hoarded.
MAX_SOURCES = 4096

#: OpenSSL reasons that mean the peer does not speak TLS at all.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL",
                      "UNEXPECTED_RECORD", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"})


class CrowdedOut(Exception):
    """A handshake not finished when newer connections needed its place."""


def handshake_timeout(frame_timeout: float) -> float:
    """The time a channel's senders get for the handshake: HANDSHAKE_TIMEOUT, never above ``frame_timeout``."""
    return min(HANDSHAKE_TIMEOUT, frame_timeout)


def failure_reason(exc: BaseException, timeout: float = HANDSHAKE_TIMEOUT) -> str:
    """A short, body-free description of why a handshake failed, for operators."""
    if isinstance(exc, CrowdedOut):
        return ("handshake not finished when newer connections needed its place "
                "(max_connections_per_source, max_connections)")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or type(exc).__name__
        text = reason.lower().replace("_", " ")
        if reason in _NOT_TLS:
            return f"{text} (the sender does not speak TLS: plain MLLP on a TLS port?)"
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return f"{text} (the channel requires a client certificate: tls_client_ca)"
        return text
    if isinstance(exc, TimeoutError | ConnectionAbortedError):
        # asyncio aborts a handshake past ssl_handshake_timeout with ConnectionAbortedError.
        return f"no handshake within {timeout:g}s"
    if isinstance(exc, ConnectionError | EOFError):
        return "connection closed during the handshake"
    return type(exc).__name__


class HandshakeFailures:
    """Rate-limited ``tls_handshake_failed`` lines: once per source per interval, with a count."""

    def __init__(self, log: Any, *, interval: float = FAILURE_LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._interval = interval
        self._clock = clock
        #: source -> (when its failure was last logged, failures since then not logged)
        self._seen: dict[str, tuple[float, int]] = {}

    def failed(self, source: str, peer: str, exc: BaseException, timeout: float = HANDSHAKE_TIMEOUT) -> bool:
        """Record one failure; True when it was logged (the first of its source this interval)."""
        now = self._clock()
        last = self._seen.get(source)
        if last is not None and now - last[0] < self._interval:
            self._seen[source] = (last[0], last[1] + 1)
            return False
        if len(self._seen) >= MAX_SOURCES:
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self._interval}
            if len(self._seen) >= MAX_SOURCES:
                self._seen.clear()  # memory first; at worst a few more log lines
        self._seen[source] = (now, 0)
        self._log.warning("tls_handshake_failed", peer=peer, reason=failure_reason(exc, timeout),
                          not_logged=last[1] if last else 0)
        return True


class TlsAccept(asyncio.Protocol):
    """A TLS channel's accepted connection until its handshake is done, then a ``Connection``.

    Reading is paused in ``connection_made``, before the loop starts reading
    the socket, so no byte of the ClientHello reaches anything but
    ``start_tls``. A peer outside ``allowed_sources`` is closed before any TLS
    work; a failed handshake is reported to the listener and the socket aborted.
    """

    def __init__(self, listener: ChannelListener, context: ssl.SSLContext, *,
                 timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self._listener = listener
        self._context = context
        self._timeout = timeout

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        peer = transport.get_extra_info("peername")
        if not self._listener.source_allowed(peer):
            self._listener.refuse_source(peer)
            transport.close()
            return
        task = asyncio.get_running_loop().create_task(self._handshake(transport, peer))
        self._listener.handshake_started(task, transport, peer)

    async def _handshake(self, transport: asyncio.Transport, peer: Any) -> None:
        early = _Early()
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport, early, self._context, server_side=True, ssl_handshake_timeout=self._timeout)
        except (OSError, EOFError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            transport.abort()
            self._listener.tls_failed(peer, exc)
            return
        if tls is None or early.lost:  # the peer went away as the handshake ended
            transport.abort()
            return
        # What arrived between the handshake's end and this step (a sender
        # writes its first frame at once) waited in ``early``: nothing is lost.
        conn = Connection(self._listener)
        tls.set_protocol(conn)
        conn.connection_made(tls)
        if early.data:
            conn.data_received(b"".join(early.data))
        if early.eof and not tls.is_closing():
            conn.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        pass  # start_tls notices the lost connection itself

    def data_received(self, data: bytes) -> None:  # pragma: no cover - reading is paused
        raise AssertionError("TlsAccept reads nothing: start_tls owns the socket")


class _Early(asyncio.Protocol):
    """Holds what the TLS transport delivers before the connection's protocol takes over."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True  # keep the transport open: the connection still answers

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
