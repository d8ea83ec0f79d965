"""Outbound channels (``connect``): the agent dials a sender that acts as the MLLP server.

Some systems only push to whoever connects to them (Mirth calls the other
side "client mode"). An :class:`OutboundChannel` keeps one connection to
such a sender open and, when it is lost or cannot be made, dials again
after a capped, jittered backoff (agent.core.retry) that starts over once a
connection stands. What arrives on it goes through the very same
``Connection`` shell and intake core as a listener's connections: ACK after
COMMIT, dedupe, batches, enhanced mode, application ACKs, timeouts.

At a stop the connection finishes the frame being read, answers what is
owed and closes; it is never handed to a successor (the successor dials its
own). During an upgrade overlap both processes may hold a connection to the
sender for a moment; whichever one a message arrives on commits it to the
shared queue before its ACK, and dedupe makes a resend harmless.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import ssl
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import structlog

from agent.core import retry
from agent.core.intake_types import ChannelPolicy
from agent.core.timefmt import rfc3339
from agent.runtime.mllp_connection import Connection, ConnectionSet, keep_alive
from agent.runtime.mllp_server import IntakeContext, channel_policy
from agent.runtime.tls_files import load_pair, verifying_context
from agent.storage.store import SqliteStore

if TYPE_CHECKING:
    from agent.app.config import ChannelSettings

__all__ = ["CONNECT_TIMEOUT", "OutboundChannel", "build_client_ssl"]

log = structlog.get_logger(__name__)

#: How long one dial (TCP and, with TLS, the handshake) may take.
CONNECT_TIMEOUT = 10.0
#: Reconnect delays are drawn from [base * (1 - JITTER), base] (agent.core.retry).
JITTER = 0.2
#: A connection that stood this long starts the backoff over; one the sender
#: closes at once (it serves another client) keeps backing off instead of
#: being redialled every ``reconnect_initial``.
STABLE_AFTER = 10.0

OutboundState = Literal["connecting", "connected", "reconnecting", "stopped"]


def build_client_ssl(channel: ChannelSettings) -> ssl.SSLContext | None:
    """TLS to the sender: its certificate verified against ``tls_server_ca``; ours from ``tls_cert``/``tls_key``."""
    if channel.tls_server_ca is None:
        return None
    ctx = verifying_context(channel.tls_server_ca, setting="tls_server_ca")
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if channel.tls_cert is not None:
        load_pair(ctx, channel.tls_cert, channel.tls_key)
    return ctx


def describe(exc: BaseException) -> str:
    """A dial failure in one line, without a traceback (for the log, the status page and ``last_error``)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {(exc.reason or str(exc)).lower().replace('_', ' ')}"
    if isinstance(exc, TimeoutError):
        return f"no connection within {CONNECT_TIMEOUT:g}s"
    if isinstance(exc, OSError):
        if exc.errno:  # asyncio words it "Connect call failed (address)"; the errno says why
            return os.strerror(exc.errno).lower()
        return str(exc.strerror or exc).lower()
    return type(exc).__name__


class OutboundChannel(ConnectionSet):
    """One channel that dials its sender and keeps the connection (see the module docstring)."""

    can_hand_over = False  # TLS state cannot move, and the successor dials its own connection

    def __init__(self, channel: ChannelSettings, ctx: IntakeContext) -> None:
        assert channel.connect is not None
        self.channel = channel
        self.ctx = ctx
        self.policy: ChannelPolicy = channel_policy(channel, ctx.application_ack_timeout)
        self._track_connections()
        self.log = log.bind(channel=channel.name, connect=channel.connect)
        self._ssl = build_client_ssl(channel)
        self._gone = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.state: OutboundState = "connecting"
        self.since = time.time()
        self.last_error: str | None = None
        self.connects = 0
        self.failures = 0  # dial failures since the last connection stood
        self.last_delay = 0.0  # the last wait before a redial (seconds)

    # -- what the service asks (the same names as a listener's) -----------------

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"outbound-{self.channel.name}")

    @property
    def serving(self) -> bool:
        return self._task is not None and not self._task.done()

    def stop_accepting(self) -> None:
        """Dial no more; a connection that stands is closed gracefully by ``close_connections``."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        self._set_state("stopped")

    async def wait_connections_closed(self) -> None:
        await super().wait_connections_closed()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def status(self) -> dict[str, Any]:
        """For the status page, ``/status.json`` and ``queue stats``-style views."""
        return {
            "connect": self.channel.connect,
            "tls": self._ssl is not None,
            "state": self.state,
            "since": rfc3339(self.since, millis=False),
            "last_error": self.last_error,
            "connects": self.connects,
            "failed_attempts": self.failures,
        }

    # -- what a Connection asks of its owner (mllp_connection.ConnectionOwner) ---

    def admit(self, conn: Connection, peer: Any) -> bool:  # noqa: ANN401 - a socket address
        return not self._stopping

    def finished(self, conn: Connection) -> None:
        super().finished(conn)
        self._gone.set()

    # -- the dialling loop ---------------------------------------------------------

    def _delays(self) -> Iterator[float]:
        return retry.backoff(initial=float(self.channel.reconnect_initial), cap=float(self.channel.reconnect_cap),
                             jitter=JITTER)

    async def _run(self) -> None:
        delays = self._delays()
        while not self._stopping:
            conn = await self._dial()
            if conn is not None:
                began = time.monotonic()
                await self._gone.wait()
                if self._stopping:
                    return
                if time.monotonic() - began >= STABLE_AFTER:
                    delays = self._delays()  # it stood: the next loss starts the backoff over
                self._set_state("reconnecting", error="connection lost")
                self.log.warning("outbound_connection_lost")
            delay = self.last_delay = next(delays)
            self.log.debug("outbound_reconnect_scheduled", delay_s=round(delay, 2), failures=self.failures)
            await asyncio.sleep(delay)

    async def _dial(self) -> Connection | None:
        """One attempt: the connection (serving now), or None after logging and counting the failure."""
        host, port = self.channel.host, self.channel.port
        loop = asyncio.get_running_loop()
        self._gone.clear()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                transport, conn = await loop.create_connection(
                    lambda: Connection(self), host, port, ssl=self._ssl,
                    server_hostname=(self.channel.tls_server_name or host) if self._ssl is not None else None)
        except (OSError, TimeoutError, ValueError) as exc:  # ssl.SSLError is an OSError
            self.failures += 1
            error = describe(exc)
            if self.state != "reconnecting" or self.last_error != error:
                self.log.warning("outbound_connect_failed", error=error, failures=self.failures)
            self._set_state("reconnecting", error=error)
            if self.ctx.metrics is not None:
                self.ctx.metrics.outbound_attempt(self.channel.name, connected=False)
            return None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                # A sender that vanishes without FIN is noticed (the connection is dialled again).
                keep_alive(sock)
        self.connects += 1
        self.failures = 0  # dial failures; a connection that does not stand still backs off (STABLE_AFTER)
        self.last_error = None
        self._set_state("connected")
        self.log.info("outbound_connected", tls=self._ssl is not None, connects=self.connects)
        if self.ctx.metrics is not None:
            self.ctx.metrics.outbound_attempt(self.channel.name, connected=True)
        return conn

    def _set_state(self, state: OutboundState, *, error: str | None = None) -> None:
        changed = state != self.state or (error is not None and error != self.last_error)
        if state != self.state:
            self.since = time.time()
            self.state = state
        if error is not None:
            self.last_error = error
        if self.ctx.metrics is not None:
            self.ctx.metrics.set_outbound_connected(self.channel.name, state == "connected")
        if changed:
            self._record()

    def _record(self) -> None:
        """Keep the state in the queue database too, for ``queue stats`` (another process).

        Written when the state or the error changes, never per attempt; a
        failed write only costs the CLI its freshness (the page reads memory).
        """
        state = {k: v for k, v in self.status().items() if k not in ("connects", "failed_attempts")}
        state["pid"] = os.getpid()
        future: concurrent.futures.Future[None] = self.ctx.writer.submit(
            SqliteStore.record_outbound, self.channel.name, json.dumps(state, sort_keys=True))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
