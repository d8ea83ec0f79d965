"""MLLP over TLS: the server-side handshake, and failed handshakes logged without flooding.

The listener accepts plain TCP and runs the handshake itself (``start_tls``)
instead of handing an ``ssl`` context to ``asyncio.start_server``: asyncio
drops a failed server handshake silently (it reports it only in debug mode),
so an operator would never learn that a sender speaks plain MLLP to a TLS
port or presents a certificate the channel's CA did not sign. It also lets
``allowed_sources`` refuse a peer before any TLS work is spent on it.

Failures are logged as ``tls_handshake_failed`` once per source address per
minute, with the number of failures not logged since (``not_logged``): a
sender retrying every second must not fill the log. Nothing of what the
peer sent is logged, only the TLS library's reason.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Any

#: Seconds a sender has to complete the handshake once connected (asyncio's own default).
HANDSHAKE_TIMEOUT = 60.0
#: A source's failures are logged at most once per this many seconds.
FAILURE_LOG_INTERVAL = 60.0
#: Sources remembered for the rate limit; a scan of many addresses is forgotten, not hoarded.
MAX_SOURCES = 4096

#: OpenSSL reasons that mean the peer does not speak TLS at all.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL",
                      "UNEXPECTED_RECORD", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"})


def failure_reason(exc: BaseException, timeout: float = HANDSHAKE_TIMEOUT) -> str:
    """A short, body-free description of why a handshake failed, for operators."""
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

    def failed(self, source: str, peer: str, exc: BaseException) -> bool:
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
        self._log.warning("tls_handshake_failed", peer=peer, reason=failure_reason(exc),
                          not_logged=last[1] if last else 0)
        return True


async def server_handshake(writer: asyncio.StreamWriter, context: ssl.SSLContext, *,
                           timeout: float = HANDSHAKE_TIMEOUT) -> BaseException | None:
    """Upgrade an accepted connection to TLS (server side); the error when the handshake failed.

    Called first thing in the connection callback, before anything awaits:
    ``start_tls`` pauses reading before the loop can hand a byte of the
    ClientHello to the plain stream.
    """
    try:
        await writer.start_tls(context, ssl_handshake_timeout=timeout)
    except (OSError, EOFError, TimeoutError) as exc:  # ssl.SSLError is an OSError
        writer.transport.abort()
        return exc
    return None
