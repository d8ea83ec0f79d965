"""MLLP listeners: one per channel, an ``asyncio.Protocol`` per sender (agent.runtime.mllp_connection).

The listener keeps admission: ``max_connections`` and
``max_connections_per_source`` with longest-idle eviction, refusals logged
once per source per minute, ``allowed_sources``, TLS; and it adopts
connections a predecessor hands over at an upgrade. Each connection is a
thin shell over the intake core (agent.core.intake), which decides.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from agent.core.addresses import format_peer
from agent.core.intake import MAX_PIPELINED_FRAMES
from agent.core.intake_types import NOTHING_OWED, ChannelPolicy, Owed
from agent.runtime.mllp_connection import Connection, ConnectionSet, source_address
from agent.runtime.relay import AckRelay
from agent.runtime.sockets import guard_listener
from agent.runtime.tls import CrowdedOut, HandshakeFailures, TlsAccept, handshake_timeout
from agent.runtime.tls_files import load_ca, load_pair
from agent.storage.writer import Writer

if TYPE_CHECKING:
    from agent.app.config import ChannelSettings
    from agent.runtime.metrics import AgentMetrics

__all__ = ["LISTEN_BACKLOG", "ChannelListener", "IntakeContext", "build_server_ssl", "channel_policy"]

log = structlog.get_logger(__name__)

#: Matches sockets.bind_listener and the systemd socket unit's Backlog=.
LISTEN_BACKLOG = 1024
#: A newcomer refused because every connection is busy is logged once per
#: source per this many seconds (a retrying sender must not flood the log).
REFUSAL_LOG_INTERVAL = 60.0


@dataclass
class IntakeContext:
    """What every listener of a process shares."""

    writer: Writer
    relay: AckRelay
    application_ack_timeout: float = 30.0
    metrics: AgentMetrics | None = None
    #: Called with the channel name after a row was committed (wakes the dispatcher).
    on_committed: Callable[[str], None] | None = None
    #: Hands a live connection (channel, fd, remote, unhandled bytes, owed ACKs) to the
    #: successor at shutdown (zero-downtime upgrade); True when taken.
    hand_over: Callable[[str, int, str, bytes, Owed], Awaitable[bool]] | None = None


def channel_policy(channel: ChannelSettings, application_ack_timeout: float) -> ChannelPolicy:
    """The settings of ``channel`` the intake core applies."""
    return ChannelPolicy(
        name=channel.name, ack=channel.ack, encoding=channel.encoding,
        max_message_bytes=int(channel.max_message_bytes),
        accept_message_types=tuple(channel.accept_message_types),
        accept_processing_ids=tuple(channel.accept_processing_ids),
        accept_versions=tuple(channel.accept_versions),
        frame_timeout=float(channel.frame_timeout), idle_timeout=float(channel.idle_timeout),
        application_ack_timeout=application_ack_timeout,
    )


def build_server_ssl(channel: ChannelSettings) -> ssl.SSLContext | None:
    """TLS for a channel: ``tls_cert``/``tls_key``; ``tls_client_ca`` makes client certs required."""
    if channel.tls_cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_pair(ctx, channel.tls_cert, channel.tls_key)
    if channel.tls_client_ca is not None:
        load_ca(ctx, channel.tls_client_ca, setting="tls_client_ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ChannelListener(ConnectionSet):
    """Accepts senders for one channel on a listening socket it may share with a peer process."""

    def __init__(self, channel: ChannelSettings, sock: socket.socket, ctx: IntakeContext) -> None:
        self.channel = channel
        self.sock = sock
        self.ctx = ctx
        self.policy = channel_policy(channel, ctx.application_ack_timeout)
        self._track_connections()
        self._server: asyncio.Server | None = None
        self._allowed = [ipaddress.ip_network(c, strict=False) for c in channel.allowed_sources]
        #: (kind, source) -> (when a refusal was last logged, refusals since then)
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}
        self._ssl = build_server_ssl(channel)
        self.log = log.bind(channel=channel.name)
        self._handshake_failures = HandshakeFailures(self.log)
        #: TLS handshakes under way, oldest first: their raw transports (closed with the
        #: connections) and peers.
        self._handshakes: dict[asyncio.Task[None], tuple[asyncio.Transport, Any]] = {}

    async def start(self) -> None:
        # The listener may be shared with other processes (systemd, a
        # predecessor or successor), any of which can switch it to blocking
        # mode: guard accept() against that (see agent.runtime.sockets).
        self.sock = guard_listener(self.sock)
        # asyncio calls listen() again: keep the shared socket's deep backlog
        # (a successor shares this accept queue during an upgrade).
        # TLS is started per connection (TlsAccept), not by create_server:
        # asyncio drops a failed server handshake without a word.
        factory = self._protocol if self._ssl is None else self._tls_protocol
        self._server = await asyncio.get_running_loop().create_server(
            factory, sock=self.sock, backlog=LISTEN_BACKLOG
        )

    def _protocol(self) -> Connection:
        return Connection(self)

    def _tls_protocol(self) -> TlsAccept:
        assert self._ssl is not None
        return TlsAccept(self, self._ssl, timeout=handshake_timeout(self.channel.frame_timeout))

    def handshake_started(self, task: asyncio.Task[None], transport: asyncio.Transport, peer: Any) -> None:
        """Track a handshake; first make room as admission does for connections.

        Handshakes under way are bounded by ``max_connections_per_source``
        per source and ``max_connections`` per channel: at the bound, the
        oldest unfinished one (of that source, else of the channel) is
        closed. It is owed nothing; a sender that is merely slow retries, and
        a source opening connections it never uses only crowds out its own.
        """
        source = source_address(peer)
        per_source = min(self.channel.max_connections_per_source, self.channel.max_connections)
        while len(mine := [t for t, (_, p) in self._handshakes.items() if source_address(p) == source]) >= per_source:
            self._crowd_out(mine[0])
        while len(self._handshakes) >= self.channel.max_connections:
            self._crowd_out(next(iter(self._handshakes)))
        self._handshakes[task] = (transport, peer)
        task.add_done_callback(self._handshake_done)

    def _handshake_done(self, task: asyncio.Task[None]) -> None:
        self._handshakes.pop(task, None)

    def _crowd_out(self, task: asyncio.Task[None]) -> None:
        transport, peer = self._handshakes.pop(task)
        task.cancel()
        transport.abort()
        self.tls_failed(peer, CrowdedOut())

    def _drop_handshakes(self) -> None:
        """A connection still in its TLS handshake has been owed nothing yet: close it."""
        for task, (transport, _) in list(self._handshakes.items()):
            task.cancel()
            transport.abort()

    def tls_failed(self, peer: Any, exc: BaseException) -> None:
        """A TLS handshake failed: logged (rate-limited per source) and counted."""
        self._handshake_failures.failed(source_address(peer), format_peer(peer), exc,
                                        handshake_timeout(self.channel.frame_timeout))
        self._count_refusal("tls_handshake")

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    @property
    def can_hand_over(self) -> bool:
        """TLS state cannot move between processes; without a successor there is nobody to take it."""
        return self.ctx.hand_over is not None and self._ssl is None

    def stop_accepting(self) -> None:
        """Close our handle on the listening socket; a successor holding the same socket goes on."""
        if self._server is not None:
            self._server.close()

    def close_connections(self) -> None:
        self._drop_handshakes()
        super().close_connections()

    def abort_connections(self) -> None:
        self._drop_handshakes()
        super().abort_connections()

    async def adopt(self, sock: socket.socket, remote: str, buffered: bytes, owed: Owed = NOTHING_OWED) -> bool:
        """Serve a connection a predecessor handed over mid-stream (zero-downtime upgrade).

        What the sender is still owed comes along and is answered first, in
        order, before any frame the predecessor had not handled.
        """
        if self._ssl is not None or not self.serving:
            return False  # TLS state cannot move between processes; nor do we take work while stopping
        if len(owed.replies) > MAX_PIPELINED_FRAMES:
            return False  # more than one connection can have in progress: not from a sane predecessor
        sock.setblocking(False)
        conn = Connection(self, adopted=(remote, buffered, owed))
        await asyncio.get_running_loop().connect_accepted_socket(lambda: conn, sock=sock)
        return True

    # -- admission -----------------------------------------------------------

    def admit(self, conn: Connection, peer: Any) -> bool:
        """Whether a new sender may connect: its source allowed, and room made for it."""
        if not self.source_allowed(peer):
            self.refuse_source(peer)
            return False
        return self._admit(conn.source, conn.remote)

    def refuse_source(self, peer: Any) -> None:
        """A peer outside allowed_sources: counted, and logged once per source per minute (a scan must not flood)."""
        self._count_refusal("source_not_allowed")
        not_logged = self._log_due("source", source_address(peer))
        if not_logged is not None:
            self.log.warning("connection_refused_source", peer=format_peer(peer), not_logged=not_logged)

    def source_allowed(self, peer: Any) -> bool:
        if not self._allowed:
            return True
        try:
            address = ipaddress.ip_address(peer[0])
        except (TypeError, ValueError, IndexError):
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in net for net in self._allowed)

    def _admit(self, source: str, remote: str) -> bool:
        """Make room for a newcomer, or refuse it when every connection in the way is busy.

        A channel (or one source) at its limit closes its longest-idle
        connection — no partial frame, no ACK owed — so connections that went
        silent (a device that rebooted without FIN, a scanner, a health check
        that never closes) cannot lock senders out. Only when all of them are
        busy is the newcomer closed at once.
        """
        channel = self.channel
        limits: list[tuple[str, int, str | None]] = [("max_connections", channel.max_connections, None)]
        if channel.max_connections_per_source < channel.max_connections:
            # Only a per-source limit below the channel's binds first; one at
            # or above it is met as the channel's, and named so.
            limits.insert(0, ("max_connections_per_source", channel.max_connections_per_source, source))
        for key, limit, only_source in limits:
            while True:
                open_now = [c for c in self.connections if not c.evicted
                            and (only_source is None or c.source == only_source)]
                if len(open_now) < limit:
                    break
                if not self._evict_longest_idle(open_now, remote, key):
                    self._refuse(source, remote, key, limit)
                    return False
        return True

    def _evict_longest_idle(self, candidates: list[Connection], newcomer: str, key: str) -> bool:
        idle = [(since, conn) for conn in candidates if (since := conn.idle_since()) is not None]
        if not idle:
            return False
        since, victim = min(idle, key=lambda pair: pair[0])
        victim.log.info("connection_evicted", idle_s=round(time.monotonic() - since, 1),
                        limit=key, for_peer=newcomer)
        victim.evict()
        if self.ctx.metrics is not None:
            self.ctx.metrics.connection_evicted(self.channel.name)
        return True

    def _refuse(self, source: str, remote: str, key: str, limit: int) -> None:
        """Log a refusal once per source per minute, with the count of those not logged."""
        self._count_refusal("busy" if key == "max_connections" else "source_busy")
        not_logged = self._log_due("limit", source)
        if not_logged is not None:
            self.log.warning("connection_refused_limit", peer=remote, limit=key, value=limit,
                             open=len(self.connections), not_logged=not_logged)

    def _log_due(self, kind: str, source: str) -> int | None:
        """The refusals of ``kind`` from ``source`` not logged since its last line, when one is due now; else None."""
        now = time.monotonic()
        key = (kind, source)
        last = self._refusals.get(key)
        if last is not None and now - last[0] < REFUSAL_LOG_INTERVAL:
            self._refusals[key] = (last[0], last[1] + 1)
            return None
        if len(self._refusals) >= 4096:  # many sources (a scan): forget those logged long ago
            self._refusals = {k: v for k, v in self._refusals.items()
                              if now - v[0] < REFUSAL_LOG_INTERVAL}
            if len(self._refusals) >= 4096:
                self._refusals.clear()  # memory first; at worst a few more log lines
        self._refusals[key] = (now, 0)
        return last[1] if last else 0

    def _count_refusal(self, reason: str) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.connection_refused(self.channel.name, reason)

    # -- the connections' lifetime ----------------------------------------------

