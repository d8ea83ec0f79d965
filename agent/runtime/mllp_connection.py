"""One sender's MLLP connection: an ``asyncio.Protocol`` shell over the intake core.

``data_received`` feeds ``agent.core.intake.IntakeConnection``, and the
actions it hands back are applied here — commit through the writer thread
(its result back on the loop with one thread hop), write one ACK frame per
``transport.write`` (TCP_NODELAY: docs/acks.md#how-acks-are-written), ask
the relay for application ACKs, pause and resume reading, hand the
connection to a successor. Nothing is decided here: which ACK, in which
order, when to stop reading is the core's. An accept ACK only ever comes
from a commit result, after the row's COMMIT returned.

About 550 lines on purpose: one method per kind of action the core hands
back (``_APPLY``, at the end, maps each action type to its method), each next
to the asyncio.Protocol callback it answers, so a reader can check that every
action is applied and nothing is decided here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import ipaddress
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

import structlog

from agent.core.addresses import format_peer
from agent.core.intake import IntakeConnection
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
    Committed,
    Count,
    Counter,
    Log,
    NewMessage,
    Owed,
    RecordOutcome,
)
from agent.core.partition import PartitionKey
from agent.storage.store import AuditItem, IntakeItem, IntakeResult, SqliteStore
from agent.storage.writer import Writer

if TYPE_CHECKING:
    from agent.app.config import ChannelSettings
    from agent.core.intake_types import ChannelPolicy
    from agent.runtime.mllp_server import IntakeContext

__all__ = ["SYSTEM_CLOCK", "Connection", "ConnectionOwner", "ConnectionSet", "audit_item", "intake_item", "source_address"]

T = TypeVar("T")
P = ParamSpec("P")
log = structlog.get_logger(__name__)
_connection_ids = count(1)


class _SystemClock:
    """The clock the intake core reads: ``time.monotonic`` for timers, ``time.time`` for rows."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


SYSTEM_CLOCK = _SystemClock()


def _submit(
    writer: Writer, method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
) -> concurrent.futures.Future[T]:
    """``writer.call`` for a protocol callback: the store method in the next batch, no coroutine."""
    return writer.submit(lambda store: method(store, *args, **kwargs))


def intake_item(channel: str, remote: str, message: NewMessage, partition: PartitionKey | None = None) -> IntakeItem:
    """The row the store commits for ``message`` (received on ``channel`` from ``remote``).

    ``partition``: the channel's ``partition_key``; the row's key is read from
    the decoded text (agent.core.partition), None on a channel without one.
    """
    env = message.envelope
    return IntakeItem(
        channel=channel, remote=remote, sending_app=env.sending_app, sending_facility=env.sending_facility,
        control_id=env.control_id, message_type=env.message_type, body=message.body, encoding=message.codec,
        ack_mode=message.ack_mode, accept_ack_type=env.accept_ack_type,
        application_ack_type=env.application_ack_type, commit_ack=message.commit_ack,
        received_at=message.received_at,
        partition_key=partition.of(message.text) if partition is not None else None,
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


def _debug_enabled(logger: Any) -> bool:  # noqa: ANN401 - a structlog bound logger
    """Whether ``logger`` writes debug lines (a logger that cannot say is asked every time)."""
    enabled = getattr(logger, "is_enabled_for", None)
    return True if enabled is None else bool(enabled(logging.DEBUG))


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


class ConnectionOwner(Protocol):
    """What a connection needs of whoever made it: a listener (mllp_server) or an outbound channel (outbound)."""

    channel: ChannelSettings
    ctx: IntakeContext
    policy: ChannelPolicy

    @property
    def can_hand_over(self) -> bool: ...
    def admit(self, conn: Connection, peer: Any) -> bool: ...  # noqa: ANN401 - a socket address
    def opened(self, conn: Connection) -> None: ...
    def finished(self, conn: Connection) -> None: ...


class ConnectionSet:
    """The open connections of one channel's owner (a listener or an outbound channel).

    Counts them in the metrics and tells when the last one has finished; asks
    them all to close, abort, or answer their held application ACKs. The
    owner sets ``channel`` and ``ctx`` and calls ``_track_connections()``.
    """

    channel: ChannelSettings
    ctx: IntakeContext

    def _track_connections(self) -> None:
        self.connections: set[Connection] = set()
        self._no_connections = asyncio.Event()
        self._no_connections.set()

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

    def close_connections(self) -> None:
        """Ask every connection to close after the message it is reading (docs/deploy.md)."""
        for conn in list(self.connections):
            conn.request_close()

    async def wait_connections_closed(self) -> None:
        """Until every connection has finished."""
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


#: TCP keepalive (Linux): a peer gone without FIN (powered off, cable pulled) is
#: noticed in about 2 minutes, and its connection no longer counts against
#: max_connections. A live peer that does not read is frame_timeout's.
KEEPALIVE = ((getattr(socket, "TCP_KEEPIDLE", None), 60), (getattr(socket, "TCP_KEEPINTVL", None), 10),
             (getattr(socket, "TCP_KEEPCNT", None), 6))


def keep_alive(sock: socket.socket) -> None:
    """Turn TCP keepalive on with KEEPALIVE's timers (OSError if the socket refuses)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE:
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def unread_bytes(sock: Any) -> int:  # noqa: ANN401 - a socket or asyncio's TransportSocket
    """Bytes the kernel holds for ``sock`` that nobody has read yet (FIONREAD, tcp(7)); 0 if unknown."""
    if sock is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0


class Connection(asyncio.Protocol):
    """One sender's connection: pumps bytes into the intake core and applies its actions."""

    def __init__(self, listener: ConnectionOwner, *, adopted: tuple[str, bytes, Owed] | None = None) -> None:
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
        self._debug_logged = _debug_enabled(self.log)  # whether a debug line is written (one per message)
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
        self._debug_logged = _debug_enabled(self.log)
        # No await between admission and opened(): the listener's count stays exact.
        if self._adopted is None and not self.listener.admit(self, peer):
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                # Each ACK in its own write, not coalesced by Nagle (docs/acks.md#how-acks-are-written).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keep_alive(sock)
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
        since = self.core.idle_since()
        if since is not None and unread_bytes(transport.get_extra_info("socket")):
            # Its next frame has arrived and waits for the loop to read it:
            # closing now would cut a sender off with a frame in flight.
            return None
        return since

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
                    _APPLY[type(action)](self, action)  # self._apply(action), inlined: the hot loop
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
        # One dict lookup by the action's type (an isinstance chain cost up to
        # a dozen checks per action, several actions per message).
        _APPLY[type(action)](self, action)

    def _send(self, action: Send) -> None:
        transport = self._transport
        assert transport is not None
        ok = not transport.is_closing()
        if ok:
            transport.write(action.frame)
        self.core.written(action, ok)

    def _log(self, action: Log) -> None:
        if action.level == "debug" and not self._debug_logged:
            return  # what the logger would do, without the call (message_committed: one per message)
        getattr(self.log, action.level)(action.event, **action.fields)

    def _record_outcome(self, action: RecordOutcome) -> None:
        # Bookkeeping that may be lost in a crash: rides along with the next commit.
        self.ctx.writer.defer_ack_outcome(action.message_id, action.outcome)

    def _audit_action(self, action: Audit) -> None:
        self._audit(action.record)

    def _committed(self, action: Committed) -> None:
        if self.ctx.on_committed is not None:
            self.ctx.on_committed(self.channel.name)

    def _stop_waiting(self, action: StopWaiting) -> None:
        task = self._waits.pop(action.token, None)
        if task is not None:
            task.cancel()

    def _hand_over_action(self, action: HandOver) -> None:
        self._spawn(self._hand_over(action), "handover")

    def _half_close(self, action: HalfClose) -> None:
        transport = self._transport
        assert transport is not None
        with contextlib.suppress(OSError, RuntimeError):
            if transport.can_write_eof():
                transport.write_eof()

    def _close(self, action: Close) -> None:
        assert self._transport is not None
        self._transport.close()

    def _abort(self, action: Abort) -> None:
        assert self._transport is not None
        self._transport.abort()

    def _commit(self, action: Commit) -> None:
        # One frame, one row; an HL7 batch frame commits its members together as one
        # group, all or none.
        ticket = action.ticket
        channel, remote = self.channel.name, self.remote

        def done(results: list[IntakeResult] | None, error: BaseException | None) -> None:
            # On the loop, after the batch's COMMIT returned (one hop for the whole batch).
            if results is not None:
                self.core.commit_done(ticket, results)
            else:
                self.core.commit_failed(ticket, error or RuntimeError("commit failed"))
            self._run()

        partition = self.channel.partition
        items = action.items
        self.ctx.writer.intake([intake_item(channel, remote, items[0], partition)] if len(items) == 1
                               else [intake_item(channel, remote, message, partition) for message in items], done,
                               self._loop)

    def _audit(self, record: AuditRecord) -> None:
        future = _submit(self.ctx.writer, SqliteStore.record_audit, audit_item(self.channel.name, self.remote, record))

        def done(fut: concurrent.futures.Future[Any]) -> None:
            error = None if fut.cancelled() else fut.exception()
            message_id = None if fut.cancelled() or error is not None else fut.result()
            self.core.audit_done(None if error is None else str(error), message_id)
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


#: How the shell applies each kind of action the core hands back.
_APPLY: dict[type, Callable[[Connection, Any], None]] = {
    Send: Connection._send,
    Commit: Connection._commit,
    Count: Connection._count,
    Committed: Connection._committed,
    RecordOutcome: Connection._record_outcome,
    Log: Connection._log,
    Audit: Connection._audit_action,
    AwaitApplicationAck: Connection._await_ack,
    StopWaiting: Connection._stop_waiting,
    HandOver: Connection._hand_over_action,
    HalfClose: Connection._half_close,
    Close: Connection._close,
    Abort: Connection._abort,
}
