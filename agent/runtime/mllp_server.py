"""MLLP listeners: one per channel, an ``asyncio.Protocol`` per sender connection.

The connection is a thin shell over ``agent.core.intake.IntakeConnection``:
``data_received`` feeds the core, and the actions it hands back are applied
here — commit through the writer thread, write one ACK frame per
``transport.write`` (TCP_NODELAY: docs/acks.md#how-acks-are-written), ask
the relay for application ACKs, pause and resume reading, hand the
connection to a successor. Nothing is decided here: which ACK, in which
order, when to stop reading is the core's. An accept ACK only ever comes
from a commit result, after the row's COMMIT returned.

The listener keeps admission: ``max_connections`` and
``max_connections_per_source`` with longest-idle eviction, refusals logged
once per source per minute, ``allowed_sources``, TLS.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import structlog

from agent.core.addresses import format_peer
from agent.core.intake import MAX_PIPELINED_FRAMES, IntakeConnection
from agent.core.intake_actions import (
    Abort,
    Action,
    AwaitApplicationAck,
    Close,
    Commit,
    HalfClose,
    HandOver,
    Send,
    StopWaiting,
)
from agent.core.intake_types import (
    NOTHING_OWED,
    Audit,
    AuditRecord,
    ChannelPolicy,
    Committed,
    Count,
    Counter,
    Log,
    NewMessage,
    Owed,
    RecordOutcome,
)
from agent.runtime.relay import AckRelay
from agent.runtime.sockets import guard_listener
from agent.storage.store import AuditItem, IntakeItem, SqliteStore
from agent.storage.writer import Writer

if TYPE_CHECKING:
    from agent.app.config import ChannelSettings
    from agent.runtime.metrics import AgentMetrics

T = TypeVar("T")
P = ParamSpec("P")
log = structlog.get_logger(__name__)
_connection_ids = count(1)

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


class _SystemClock:
    """The clock the intake core reads: ``time.monotonic`` for timers, ``time.time`` for rows."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


SYSTEM_CLOCK = _SystemClock()


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


def _submit(
    writer: Writer, method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
) -> concurrent.futures.Future[T]:
    """``writer.call`` for a protocol callback: the store method in the next batch, no coroutine."""
    return writer.submit(lambda store: method(store, *args, **kwargs))


def intake_item(channel: str, remote: str, message: NewMessage) -> IntakeItem:
    """The row the store commits for ``message`` (received on ``channel`` from ``remote``)."""
    env = message.envelope
    return IntakeItem(
        channel=channel, remote=remote, sending_app=env.sending_app, sending_facility=env.sending_facility,
        control_id=env.control_id, message_type=env.message_type, body=message.body, encoding=message.codec,
        ack_mode=message.ack_mode, accept_ack_type=env.accept_ack_type,
        application_ack_type=env.application_ack_type, commit_ack=message.commit_ack,
        received_at=message.received_at,
    )


def audit_item(channel: str, remote: str, record: AuditRecord) -> AuditItem:
    """The ``nacked`` row the store keeps for ``record``."""
    env = record.envelope
    return AuditItem(
        channel, remote, record.body, record.error_code, record.error_text,
        sending_app=env.sending_app if env else "", sending_facility=env.sending_facility if env else "",
        control_id=env.control_id if env else "", message_type=env.message_type if env else "",
        ack_sent=record.ack_sent, received_at=record.received_at,
    )


def source_address(peer: Any) -> str:
    """The sender's address without the port (IPv4-mapped IPv6 as IPv4): the per-source key."""
    if not isinstance(peer, tuple) or not peer:
        return str(peer or "unknown")
    try:
        address = ipaddress.ip_address(peer[0])
    except (TypeError, ValueError):
        return str(peer[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def build_server_ssl(channel: ChannelSettings) -> ssl.SSLContext | None:
    """TLS for a channel: ``tls_cert``/``tls_key``; ``tls_client_ca`` makes client certs required."""
    if channel.tls_cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(channel.tls_cert), str(channel.tls_key) if channel.tls_key else None)
    if channel.tls_client_ca is not None:
        ctx.load_verify_locations(cafile=str(channel.tls_client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ChannelListener:
    """Accepts senders for one channel on a listening socket it may share with a peer process."""

    def __init__(self, channel: ChannelSettings, sock: socket.socket, ctx: IntakeContext) -> None:
        self.channel = channel
        self.sock = sock
        self.ctx = ctx
        self.policy = channel_policy(channel, ctx.application_ack_timeout)
        self.connections: set[Connection] = set()
        self._no_connections = asyncio.Event()
        self._no_connections.set()
        self._server: asyncio.Server | None = None
        self._allowed = [ipaddress.ip_network(c, strict=False) for c in channel.allowed_sources]
        #: source -> (when a refusal was last logged, refusals since then)
        self._refusals: dict[str, tuple[float, int]] = {}
        self._ssl = build_server_ssl(channel)
        self.log = log.bind(channel=channel.name)

    async def start(self) -> None:
        # The listener may be shared with other processes (systemd, a
        # predecessor or successor), any of which can switch it to blocking
        # mode: guard accept() against that (see agent.runtime.sockets).
        self.sock = guard_listener(self.sock)
        # asyncio calls listen() again: keep the shared socket's deep backlog
        # (a successor shares this accept queue during an upgrade).
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, sock=self.sock, ssl=self._ssl, backlog=LISTEN_BACKLOG
        )

    def _protocol(self) -> Connection:
        return Connection(self)

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
        """Ask every connection to close after the message it is reading (docs/deploy.md)."""
        for conn in list(self.connections):
            conn.request_close()

    async def wait_connections_closed(self) -> None:
        """Until every connection of this listener has finished."""
        await self._no_connections.wait()

    def abort_connections(self) -> None:
        for conn in list(self.connections):
            conn.abort()

    def release_held_acks(self) -> None:
        """Stop waiting for the server: each held application ACK is answered AR "resend later" now.

        For a stop that found no successor to take the connections (a plain
        stop, a TLS channel, a successor of the previous version): each sender
        hears "resend later" before its connection closes, never silence.
        """
        for conn in list(self.connections):
            conn.release_held()

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
        if not self._source_allowed(peer):
            self.log.warning("connection_refused_source", peer=conn.remote)
            self._count_refusal("source_not_allowed")
            return False
        return self._admit(conn.source, conn.remote)

    def _source_allowed(self, peer: Any) -> bool:
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
        limits = (
            ("max_connections_per_source", min(self.channel.max_connections_per_source,
                                               self.channel.max_connections), source),
            ("max_connections", self.channel.max_connections, None),
        )
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
        now = time.monotonic()
        last = self._refusals.get(source)
        if last is not None and now - last[0] < REFUSAL_LOG_INTERVAL:
            self._refusals[source] = (last[0], last[1] + 1)
            return
        if len(self._refusals) >= 4096:  # many sources (a scan): forget those logged long ago
            self._refusals = {k: v for k, v in self._refusals.items()
                              if now - v[0] < REFUSAL_LOG_INTERVAL}
            if len(self._refusals) >= 4096:
                self._refusals.clear()  # memory first; at worst a few more log lines
        self._refusals[source] = (now, 0)
        self.log.warning("connection_refused_limit", peer=remote, limit=key, value=limit,
                         open=len(self.connections), not_logged=last[1] if last else 0)

    def _count_refusal(self, reason: str) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.connection_refused(self.channel.name, reason)

    # -- the connections' lifetime ----------------------------------------------

    def opened(self, conn: Connection) -> None:
        self.connections.add(conn)
        self._no_connections.clear()
        if self.ctx.metrics is not None:
            self.ctx.metrics.connection_opened(self.channel.name)

    def finished(self, conn: Connection) -> None:
        self.connections.discard(conn)
        if self.ctx.metrics is not None:
            self.ctx.metrics.connection_closed(self.channel.name)
        if not self.connections:
            self._no_connections.set()


class Connection(asyncio.Protocol):
    """One sender's connection: pumps bytes into the intake core and applies its actions."""

    def __init__(self, listener: ChannelListener, *, adopted: tuple[str, bytes, Owed] | None = None) -> None:
        self.listener = listener
        self.channel = listener.channel
        self.ctx = listener.ctx
        self.conn_id = next(_connection_ids)
        self.core = IntakeConnection(listener.policy, SYSTEM_CLOCK)
        self._adopted = adopted
        self.remote = adopted[0] if adopted is not None else "unknown"
        self.source = "unknown"
        #: Closed to admit a newcomer (it was the longest idle).
        self.evicted = False
        self.log = log.bind(channel=self.channel.name, conn=self.conn_id)
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._served = False  # admitted and counted by the listener
        self._lost = False
        self._reading = True
        self._running = False
        self._step_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._waits: dict[int, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        if self._adopted is None:
            self.remote = format_peer(peer)
        self.source = source_address(peer)
        self.log = self.log.bind(peer=self.remote)
        # No await between admission and opened(): the listener's count stays exact.
        if self._adopted is None and not self.listener.admit(self, peer):
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                # Each ACK in its own write, not coalesced by Nagle (docs/acks.md#how-acks-are-written).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._served = True
        self.listener.opened(self)
        self.log.info("connection_opened")
        if self._adopted is not None:
            _, buffered, owed = self._adopted
            self._adopted = None
            self.core.adopt(owed)
            self.log.info("connection_adopted", buffered=len(buffered), replies_owed=len(owed.replies),
                          relays_owed=len(owed.relays))
            if buffered:
                self.core.receive_data(buffered)
        self._run()

    def data_received(self, data: bytes) -> None:
        if self._served:
            self.core.receive_data(data)
            self._run()

    def eof_received(self) -> bool:
        if self._served:
            self.core.receive_eof()
            self._run()
        # Keep our side open: a sender that half-closed still reads its ACKs
        # (TLS cannot half-close: asyncio closes it either way).
        return self._served and self._transport is not None and self._transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if not self._served:
            return
        self.core.connection_lost(None if exc is None else str(exc))
        self._run()
        for task in list(self._waits.values()):
            task.cancel()
        self._waits.clear()
        self._maybe_finished()

    def pause_writing(self) -> None:
        self.core.writing_paused(True)
        self._run()

    def resume_writing(self) -> None:
        self.core.writing_paused(False)
        self._run()

    # -- what the listener and the service ask ----------------------------------

    def request_close(self) -> None:
        self.core.request_close(can_hand_over=self.listener.can_hand_over)
        self._run()

    def release_held(self) -> None:
        self.core.release_held()
        self._run()

    def abort(self) -> None:
        self.core.abort()
        self._run()

    def evict(self) -> None:
        self.evicted = True
        self.core.evict()
        self._run()

    def idle_since(self) -> float | None:
        """When this connection last did something, if it is idle now (see ``IntakeConnection.idle_since``)."""
        transport = self._transport
        if transport is None or transport.get_write_buffer_size():
            return None  # an ACK the sender has not read yet
        return self.core.idle_since()

    # -- applying the core's actions -------------------------------------------

    def _run(self) -> None:
        """Apply every action the core has, until it has none; then follow its reading and its clock."""
        if self._running:
            return  # called back from inside a write (pause_writing): the outer run takes it
        core = self.core
        self._running = True
        try:
            while actions := core.next_actions():
                for action in actions:
                    self._apply(action)
        finally:
            self._running = False
        transport = self._transport
        if transport is not None and not self._lost and core.reading != self._reading:
            self._reading = core.reading
            if self._reading:
                transport.resume_reading()
            else:
                transport.pause_reading()
        if core.more_to_do and not self._step_scheduled:
            self._step_scheduled = True
            self._loop.call_soon(self._step)  # the next slice on the next loop turn: other senders go first
        deadline = core.next_deadline()
        if deadline is not None and (self._timer is None or deadline < self._timer_at):
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), self._tick)
        if self._lost:
            self._maybe_finished()

    def _step(self) -> None:
        self._step_scheduled = False
        self.core.step()
        self._run()

    def _tick(self) -> None:
        self._timer = None
        self.core.tick()
        self._run()

    def _apply(self, action: Action) -> None:
        transport = self._transport
        assert transport is not None
        if isinstance(action, Send):
            ok = not transport.is_closing()
            if ok:
                transport.write(action.frame)
            self.core.written(action, ok)
        elif isinstance(action, Commit):
            self._commit(action)
        elif isinstance(action, Log):
            getattr(self.log, action.level)(action.event, **action.fields)
        elif isinstance(action, Count):
            self._count(action)
        elif isinstance(action, RecordOutcome):
            # Bookkeeping that may be lost in a crash: rides along with the next commit.
            message_id, outcome = action.message_id, action.outcome
            self.ctx.writer.defer(lambda store: SqliteStore.set_ack_outcome(store, message_id, outcome))
        elif isinstance(action, Audit):
            self._audit(action.record)
        elif isinstance(action, Committed):
            if self.ctx.on_committed is not None:
                self.ctx.on_committed(self.channel.name)
        elif isinstance(action, AwaitApplicationAck):
            self._await_ack(action)
        elif isinstance(action, StopWaiting):
            task = self._waits.pop(action.token, None)
            if task is not None:
                task.cancel()
        elif isinstance(action, HandOver):
            self._spawn(self._hand_over(action), "handover")
        elif isinstance(action, HalfClose):
            with contextlib.suppress(OSError, RuntimeError):
                if transport.can_write_eof():
                    transport.write_eof()
        elif isinstance(action, Close):
            transport.close()
        elif isinstance(action, Abort):
            transport.abort()

    def _commit(self, action: Commit) -> None:
        # One frame, one row today; HL7 batch frames (issue 10) commit theirs through
        # SqliteStore.intake_batch, all or none.
        (message,) = action.items
        future = _submit(self.ctx.writer, SqliteStore.intake, intake_item(self.channel.name, self.remote, message))
        ticket = action.ticket

        def done(fut: concurrent.futures.Future[Any]) -> None:
            if fut.cancelled():
                self.core.commit_failed(ticket, RuntimeError("commit cancelled"))
            elif (error := fut.exception()) is not None:
                self.core.commit_failed(ticket, error)
            else:
                self.core.commit_done(ticket, (fut.result(),))
            self._run()

        future.add_done_callback(lambda fut: self._from_writer(done, fut))

    def _audit(self, record: AuditRecord) -> None:
        future = _submit(self.ctx.writer, SqliteStore.record_audit, audit_item(self.channel.name, self.remote, record))

        def done(fut: concurrent.futures.Future[Any]) -> None:
            error = None if fut.cancelled() else fut.exception()
            self.core.audit_done(None if error is None else str(error))
            self._run()

        future.add_done_callback(lambda fut: self._from_writer(done, fut))

    def _from_writer(self, done: Callable[[concurrent.futures.Future[Any]], None],
                     fut: concurrent.futures.Future[Any]) -> None:
        """On the writer thread: hand the result to the event loop (one thread hop per job)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(done, fut)

    def _count(self, action: Count) -> None:
        metrics = self.ctx.metrics
        if metrics is None:
            return
        name = self.channel.name
        if action.counter is Counter.MESSAGE_RECEIVED:
            metrics.message_received(name)
        elif action.counter is Counter.MESSAGE_COMMITTED:
            metrics.message_committed(name)
        elif action.counter is Counter.MESSAGE_REJECTED:
            metrics.message_rejected(name, action.label)
        elif action.counter is Counter.AUDIT_ROW_NOT_STORED:
            metrics.audit_row_not_stored(name)
        elif action.counter is Counter.CONNECTION_TIMED_OUT:
            metrics.connection_timed_out(name, action.label)

    def _await_ack(self, action: AwaitApplicationAck) -> None:
        timeout = None if action.deadline is None else max(0.0, action.deadline - time.monotonic())

        async def wait() -> None:
            ack = await self.ctx.relay.wait(action.message_id, timeout)
            if self._waits.pop(action.token, None) is not None:
                self.core.application_ack(action.token, ack)
                self._run()

        self._waits[action.token] = self._spawn(wait(), f"ack-{self.conn_id}")

    async def _hand_over(self, offer: HandOver) -> None:
        """Give the live connection to the successor, with every byte not handled and every ACK owed."""
        taken = moved = False
        quiet = False
        try:
            transport = self._transport
            assert transport is not None
            assert self.ctx.hand_over is not None
            deadline = time.monotonic() + offer.quiet_within
            # An ACK still in asyncio's buffer would be lost with our copy of the fd.
            while transport.get_write_buffer_size() and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            quiet = not transport.get_write_buffer_size() and not self._lost
            sock = transport.get_extra_info("socket")
            if not quiet or sock is None:
                return
            fd = sock.fileno()
            taken = await self.ctx.hand_over(self.channel.name, fd, self.remote, offer.buffered, offer.owed)
            moved = taken and bool(offer.owed)
            if not taken and offer.owed and offer.or_without_owed and not offer.owed.replies:
                taken = await self.ctx.hand_over(self.channel.name, fd, self.remote, offer.buffered,
                                                 NOTHING_OWED)
        finally:
            self.core.handover_done(taken=taken, moved=moved, quiet=quiet)
            self._run()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _maybe_finished(self) -> None:
        if self._served and self._lost and self.core.finished:
            self._served = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for task in list(self._waits.values()):
                task.cancel()
            self.log.info("connection_closed")
            self.listener.finished(self)
