"""MLLP listeners: one per channel, a connection task per sender (SPEC section 4).

Thin asyncio around the pure parts: ``mllp.MllpDecoder`` frames the bytes,
``envelope`` reads the MSH, ``acks`` builds the answers, the writer thread
commits. Per connection, frames are handled as they arrive (so pipelined
frames share group commits) but their ACKs are written strictly in arrival
order, each in its own write. An accept ACK is written only after the row's
commit returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import itertools
import socket
import ssl
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog

from agent.core import acks, envelope, mllp
from agent.core.acks import AckCode, Outcome
from agent.core.addresses import format_peer
from agent.core.envelope import Envelope, MalformedMsh, NoMshSegment
from agent.errors import HL7Error, StorageError
from agent.runtime.adoption import NOTHING_OWED, Owed, OwedFrame, OwedRelay, OwedReply, OwedWait
from agent.runtime.aio import unless
from agent.runtime.relay import AckRelay
from agent.runtime.sockets import guard_listener
from agent.runtime.tls import HandshakeFailures, server_handshake
from agent.storage.store import AuditItem, IntakeItem, IntakeResult
from agent.storage.writer import Writer

if TYPE_CHECKING:
    from agent.app.config import ChannelSettings
    from agent.runtime.metrics import AgentMetrics

log = structlog.get_logger(__name__)
_connection_ids = count(1)

#: Frames of one connection handled ahead of their ACK write (pipelining bound).
MAX_PIPELINED_FRAMES = 32
READ_CHUNK = 256 * 1024
#: Bytes framed per read: one decoder pass stays short (tiny frames are many
#: events), so one connection's flood cannot hold the event loop for long.
FEED_CHUNK = 16 * 1024
#: A connection whose last frames were only counted (over the audit-row limit)
#: waits this long before its next read: handling a junk flood flat out would
#: keep the event loop, and the GIL, from every other channel and the writer.
JUNK_READ_PAUSE = 0.01
#: Matches sockets.bind_listener and the systemd socket unit's Backlog=.
LISTEN_BACKLOG = 1024
#: Rejected or unparseable frames kept as audit rows, per connection per window;
#: beyond it they are counted (a metric, one log line per window), not stored,
#: so a flood of junk can neither fill the disk nor queue up on the writer.
AUDIT_ROWS_PER_WINDOW = 100
AUDIT_WINDOW = 60.0
#: Audit rows of one connection waiting for the writer; at the bound reading pauses.
MAX_PENDING_AUDITS = 32
#: Application ACKs one connection waits for at once (enhanced mode). Beyond it
#: the ACK is recorded undelivered and replayed on retransmit: memory per
#: connection stays bounded while the server does not answer.
MAX_PENDING_RELAYS = 256
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


@dataclass
class Reply:
    """ACK frames to write in order, each with what to record once written."""

    acks: list[tuple[bytes, Callable[[bool], None] | None]] = field(default_factory=list)
    #: After writing: wait for this row's application ACK and relay it (enhanced mode).
    relay_for: tuple[str, Envelope] | None = None

    def add(self, ack: bytes | None, on_written: Callable[[bool], None] | None = None) -> Reply:
        if ack is not None:
            self.acks.append((ack, on_written))
        return self


@dataclass(eq=False)
class _Held:
    """An application ACK the sender waits for (original mode, ``ack = "application"``)."""

    message_id: str
    inbound: Envelope
    codec: str
    deadline: float  # time.monotonic()


@dataclass(eq=False)
class _Relay:
    """An enhanced-mode application ACK this connection relays once its row settles."""

    message_id: str
    inbound: Envelope
    #: The reply whose ACKs are written before the relay starts (None: already written).
    reply_task: asyncio.Task[Any] | None


@dataclass(eq=False)
class _OutcomeRecorder:
    """Records whether the source got a row's final ACK, once its write is known."""

    conn: Connection
    message_id: str

    def __call__(self, written: bool) -> None:
        if not self.conn.moved:  # it went to the successor, which records it
            self.conn._set_outcome(self.message_id, "delivered" if written else "undelivered")


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
        self.connections: set[Connection] = set()
        self._adopted_tasks: set[asyncio.Task[None]] = set()
        self._no_connections = asyncio.Event()
        self._no_connections.set()
        self._server: asyncio.Server | None = None
        self._allowed = [ipaddress.ip_network(c, strict=False) for c in channel.allowed_sources]
        #: source -> (when a refusal was last logged, refusals since then)
        self._refusals: dict[str, tuple[float, int]] = {}
        self._ssl = build_server_ssl(channel)
        self.log = log.bind(channel=channel.name)
        self._handshake_failures = HandshakeFailures(self.log)

    async def start(self) -> None:
        # The listener may be shared with other processes (systemd, a
        # predecessor or successor), any of which can switch it to blocking
        # mode: guard accept() against that (see agent.runtime.sockets).
        self.sock = guard_listener(self.sock)
        # asyncio calls listen() again: keep the shared socket's deep backlog
        # (a successor shares this accept queue during an upgrade).
        # TLS is started per connection (_tls_handshake), not here: asyncio would
        # drop a failed handshake without a word.
        self._server = await asyncio.start_server(
            self._accept, sock=self.sock, limit=READ_CHUNK, backlog=LISTEN_BACKLOG
        )

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    def stop_accepting(self) -> None:
        """Close our handle on the listening socket; a successor holding the same socket goes on."""
        if self._server is not None:
            self._server.close()

    def close_connections(self) -> None:
        """Ask every connection to close after the message it is reading (SPEC 7)."""
        for conn in list(self.connections):
            conn.request_close()

    async def wait_connections_closed(self) -> None:
        """Until every connection task of this listener has finished."""
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
            conn.release_held.set()

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

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        remote = format_peer(peer)
        if not self._source_allowed(peer):
            self.log.warning("connection_refused_source", peer=remote)
            self._count_refusal("source_not_allowed")
            writer.close()
            return
        if self._ssl is not None and not await self._tls_handshake(writer, peer, remote):
            return
        if not self._admit(source_address(peer), remote):
            writer.close()
            return
        # No await between admission and _serve adding the connection: the count stays exact.
        await self._serve(Connection(self, reader, writer, remote))

    async def _tls_handshake(self, writer: asyncio.StreamWriter, peer: Any, remote: str) -> bool:
        """TLS on a channel with tls_cert; a failure is logged (rate-limited per source) and counted."""
        assert self._ssl is not None
        error = await server_handshake(writer, self._ssl)
        if error is None:
            return True
        self._handshake_failures.failed(source_address(peer), remote, error)
        self._count_refusal("tls_handshake")
        return False

    # -- admission -----------------------------------------------------------

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
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
        conn = Connection(self, reader, writer, remote, initial=buffered)
        await conn._take_owed(owed)
        conn.log.info("connection_adopted", buffered=len(buffered), replies_owed=len(owed.replies),
                      relays_owed=len(owed.relays))
        task = asyncio.create_task(self._serve(conn), name=f"adopted-{conn.conn_id}")
        self._adopted_tasks.add(task)
        task.add_done_callback(self._adopted_tasks.discard)
        return True

    async def _serve(self, conn: Connection) -> None:
        sock = conn.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                # SPEC 4: each ACK in its own write, not coalesced by Nagle.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(conn)
        self._no_connections.clear()
        if self.ctx.metrics is not None:
            self.ctx.metrics.connection_opened(self.channel.name)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)
            if self.ctx.metrics is not None:
                self.ctx.metrics.connection_closed(self.channel.name)
            if not self.connections:
                self._no_connections.set()


class Connection:
    """One sender's connection: read frames, handle them, write ACKs in order."""

    def __init__(
        self,
        listener: ChannelListener,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        remote: str,
        *,
        initial: bytes = b"",
    ) -> None:
        self.listener = listener
        #: Bytes a predecessor read from this stream but did not handle (adoption).
        self.initial = initial
        #: Re-framed bytes received but not handled when a close stopped reading.
        self.unhandled = bytearray()
        self.channel = listener.channel
        self.ctx = listener.ctx
        self.reader = reader
        self.writer = writer
        self.remote = remote
        #: The sender's address, the key of max_connections_per_source.
        self.source = source_address(writer.get_extra_info("peername"))
        self.conn_id = next(_connection_ids)
        self.decoder = mllp.MllpDecoder(self.channel.max_message_bytes)
        # Unbounded so the end-of-stream sentinel can always be put, even when
        # the ACK writer is gone; ``slots`` bounds the frames in progress.
        self.replies: asyncio.Queue[asyncio.Task[Reply] | None] = asyncio.Queue()
        self.slots = asyncio.Semaphore(MAX_PIPELINED_FRAMES)
        self.pending_frames = 0
        #: Frames (whole or oversize) handed to handling so far.
        self.frames_completed = 0
        #: Once closing: the frame count at which reading stops (SPEC 7).
        self.finish_upto: int | None = None
        self.write_lock = asyncio.Lock()
        self.closing = asyncio.Event()
        #: The sender closed its side (EOF): ACKs written now would not be read.
        self.peer_gone = asyncio.Event()
        self.closed = False
        self.junk_logged = False
        self.relay_tasks: set[asyncio.Task[None]] = set()
        #: Closed to admit a newcomer (it was the longest idle).
        self.evicted = False
        #: When a frame last completed or an ACK was written: what "idle" is measured from.
        self.last_activity = time.monotonic()
        #: Seconds of frame_timeout left to the frame in progress (None between frames).
        self.frame_time_left: float | None = None
        self.audit_jobs: set[asyncio.Future[str]] = set()
        self._audit_window_start = -AUDIT_WINDOW
        self._audit_rows_in_window = 0
        self._audit_unstored = 0
        self._audit_summary: asyncio.TimerHandle | None = None
        self._relay_overflow_logged = False
        self._junk_counted = False
        # -- what the sender is owed, so it can move with the connection at an upgrade --
        #: Reply tasks in arrival order; the last ``pending_frames`` are not taken by the ACK writer yet.
        self.reply_order: deque[asyncio.Task[Reply]] = deque()
        #: Application ACKs held for the server (original mode), by the reply task that holds them.
        self.held: dict[asyncio.Task[Any], _Held] = {}
        #: Enhanced-mode relays not finished yet, in the order their replies were built,
        #: by ``id()`` of the inbound envelope (one per frame; the entry keeps it alive).
        self.relays: dict[int, _Relay] = {}
        #: Relayed ACKs being written right now.
        self.relay_writes = 0
        #: Set: stop waiting for held ACKs (they moved to a successor, or AR is answered now).
        self.release_held = asyncio.Event()
        #: While a hand-over is under way: its outcome (True: what was owed moved with it).
        self.moving: asyncio.Future[bool] | None = None
        #: What this connection owed went to a successor: answer, write and record none of it here.
        self.moved = False
        #: Bytes read from the stream while handing over, kept for a later attempt.
        self.read_while_moving = bytearray()
        self.log = log.bind(channel=self.channel.name, peer=remote, conn=self.conn_id)

    # -- lifecycle -----------------------------------------------------------

    def request_close(self) -> None:
        self.closing.set()

    def abort(self) -> None:
        self.closed = True
        self.writer.transport.abort()

    def idle_since(self) -> float | None:
        """When this connection last did something, if it is idle now (no partial frame, no ACK owed)."""
        if self.closed or self.evicted or self.closing.is_set() or self.initial:
            return None
        if self.decoder.mid_frame or self._owes_ack() or self.audit_jobs:
            return None
        if self.writer.transport.get_write_buffer_size():
            return None  # an ACK the sender has not read yet
        return self.last_activity

    def evict(self) -> None:
        """Close this idle connection to admit a newcomer: nothing is owed, nothing to hand over."""
        self.evicted = True
        self.closed = True
        self.closing.set()

    async def serve(self) -> None:
        self.log.info("connection_opened")
        ack_writer = asyncio.create_task(self._write_replies(), name=f"acks-{self.conn_id}")
        try:
            await self._read_frames()
        except (ConnectionError, OSError) as exc:
            self.log.info("connection_lost", error=str(exc))
        finally:
            # Never block here: a full bounded queue whose consumer was
            # cancelled (loop teardown) would hang the process at exit.
            self.replies.put_nowait(None)
            with contextlib.suppress(Exception):
                await self._finish_replies(ack_writer)
            if self.closing.is_set() and not self.closed and not await self._hand_over(or_without_owed=True):
                await self._lingering_close()
            for task in list(self.relay_tasks):
                task.cancel()
            self._log_unstored_audits()
            self.closed = True
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
            self.log.info("connection_closed")

    async def _finish_replies(self, ack_writer: asyncio.Task[None]) -> None:
        """Until the ACK writer has written every answer — when stopping, only until the rest is owed.

        On shutdown, a connection whose sender waits for application ACKs the
        server has not given yet (``ack = "application"``, a slow server) does
        not hold the old process until its budget cuts it off: as soon as
        nothing but held ACKs and ready answers behind them are left, it goes
        to the successor together with them, which relays each when its row
        settles. With no successor the held ACKs wait here until
        ``release_held`` (the shutdown budget), then get AR "resend later".
        """
        tried = False
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            while not ack_writer.done():
                if not self.closing.is_set():
                    await asyncio.wait({ack_writer, closing}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                if not tried and self.held and not self.closed and self._quiet() and self._owed() is not None:
                    tried = True
                    if await self._hand_over(or_without_owed=False):
                        break
                # The writer reaches the first held ACK after writing what precedes it;
                # a short re-check, only while stopping.
                await asyncio.wait({ack_writer}, timeout=0.05)
        finally:
            closing.cancel()
        await ack_writer

    def _quiet(self) -> bool:
        """Nothing of ours is on its way to the socket (an ACK in asyncio's buffer would be lost with our fd)."""
        transport = cast(asyncio.Transport, self.writer.transport)
        return transport.get_write_buffer_size() == 0 and not self.relay_writes

    def _owed(self) -> Owed | None:
        """What this connection still owes its sender, in arrival order; None while that is not settled.

        Settled when every answer not yet written is either ready or an
        application ACK held for the server, and the ACK writer waits on the
        first of them — so it writes nothing while the connection moves.
        """
        waiting = self.pending_frames
        order = self.reply_order
        unconsumed = list(itertools.islice(order, len(order) - waiting, None)) if waiting else []
        # The writer took the first (the queue holds the others and the end marker) and waits on it.
        if unconsumed and (unconsumed[0].done() or self.replies.qsize() != len(unconsumed)):
            return None
        now = time.monotonic()
        replies: list[OwedReply] = []
        for task in unconsumed:
            held = self.held.get(task)
            if held is not None and not task.done():
                replies.append(OwedReply(wait=OwedWait(held.message_id, held.inbound, held.codec,
                                                       held.deadline - now)))
            elif task.done() and not task.cancelled() and task.exception() is None:
                reply = task.result()
                frames = tuple(OwedFrame(ack, cb.message_id if isinstance(cb, _OutcomeRecorder) else None)
                               for ack, cb in reply.acks)
                relay = OwedRelay(*reply.relay_for) if reply.relay_for is not None else None
                replies.append(OwedReply(frames=frames, relay=relay))
            else:
                return None  # still being handled (committing), or failed: the writer deals with it
        in_replies = set(unconsumed)
        relays = tuple(OwedRelay(r.message_id, r.inbound) for r in self.relays.values()
                       if r.reply_task not in in_replies)
        return Owed(tuple(replies), relays)

    async def _moved_away(self) -> bool:
        """True when what this connection owed went to a successor (waits while a hand-over is under way)."""
        if self.moving is not None:
            await asyncio.shield(self.moving)
        return self.moved

    async def _hand_over(self, *, or_without_owed: bool) -> bool:
        """Give the live connection to the successor, with every byte read but not handled and every ACK it owes.

        ``or_without_owed``: when the successor does not take what is owed (a
        previous version), hand the connection over without it — for relays
        only: they are then recorded undelivered and replayed on retransmit,
        as when a connection closes. Held application ACKs never go without
        their connection's owed list; the caller answers them AR instead.
        """
        if self.ctx.hand_over is None or self.peer_gone.is_set() or self.listener._ssl is not None:
            return False
        in_progress = self.decoder.unconsumed()
        sock = self.writer.get_extra_info("socket")
        if in_progress is None or sock is None:
            return False
        transport = cast(asyncio.Transport, self.writer.transport)
        deadline = time.monotonic() + 2.0
        while not self._quiet() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        owed = self._owed() if self._quiet() else None
        if owed is None:
            return False  # a sender that does not read, or an answer still in the works: close the usual way
        # From here no ACK may be written on our side, and nothing owed is
        # answered or recorded until the successor has said whether it took it.
        self.moving = asyncio.get_running_loop().create_future()
        self.closed = True
        transport.pause_reading()
        taken = moved = False
        try:
            buffered = await self._unread_bytes(in_progress)
            if buffered is None:
                return False  # the sender closed: nothing to hand on
            taken = await self.ctx.hand_over(self.channel.name, sock.fileno(), self.remote, buffered, owed)
            moved = taken and bool(owed)
            if not taken and owed and or_without_owed and not owed.replies:
                taken = await self.ctx.hand_over(self.channel.name, sock.fileno(), self.remote, buffered,
                                                 NOTHING_OWED)
        finally:
            self.moved = moved
            self.moving.set_result(moved)
            self.moving = None
            if not taken:
                self.closed = False
                transport.resume_reading()
        if not taken:
            return False
        if moved:
            self.release_held.set()  # their waits end here; the successor answers them
        # Our copy of the fd goes; the successor's keeps the connection open.
        transport.abort()
        self.log.info("connection_handed_over", buffered=len(buffered), replies_owed=len(owed.replies) if moved else 0,
                      relays_owed=len(owed.relays) if moved else 0)
        return True

    async def _unread_bytes(self, in_progress: bytes) -> bytes | None:
        """Every byte received but not handled, reading paused; None when the sender closed its side."""
        # Bytes asyncio already read into the stream buffer: with reading
        # paused, a read() returns them at its first step or would wait forever.
        while True:
            read = asyncio.ensure_future(self.reader.read(READ_CHUNK))
            await asyncio.sleep(0)
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await read
                break
            data = read.result()
            if not data:
                self.peer_gone.set()
                return None
            self.read_while_moving += data  # kept for a later attempt should this one fail
        return bytes(self.unhandled + in_progress + self.read_while_moving)

    async def _lingering_close(self, linger: float = 2.0) -> None:
        """Close after the last ACK without ever resetting the connection (SPEC 7).

        FIN first (half-close), then read and discard until the sender closes
        too. A sender that already sent its next frame sees a clean EOF instead
        of its ACK and resends on a new connection — to the successor, through
        the shared accept queue; nothing it sent was committed here. Closing
        with unread data would send a RST, which can discard the ACK we just
        wrote before the sender read it.
        """
        with contextlib.suppress(OSError, RuntimeError):
            if self.writer.can_write_eof():
                await self.writer.drain()
                self.writer.write_eof()
        deadline = time.monotonic() + linger
        discarded = 0
        with contextlib.suppress(OSError, ConnectionError, TimeoutError):
            while (remaining := deadline - time.monotonic()) > 0:
                data = await asyncio.wait_for(self.reader.read(READ_CHUNK), remaining)
                if not data:
                    break
                discarded += len(data)
        if discarded:
            self.log.info("bytes_after_close_discarded", count=discarded)

    async def _read_chunk(self) -> bytes:
        """The next bytes, or b"" at EOF, on a timeout, or when asked to close while idle."""
        read = asyncio.ensure_future(self.reader.read(FEED_CHUNK))
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            waiting = {read, closing}
            while True:
                timeout, kind = self._read_timeout()
                started = time.monotonic()
                done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if self.frame_time_left is not None:
                    self.frame_time_left -= time.monotonic() - started
                if read in done:
                    return self._note_eof(read.result())
                if closing in done:
                    # Asked to close: finish a frame that is being read, else stop now.
                    if self._stop_reading():
                        return b""
                    waiting = {read}
                    continue
                if kind == "idle" and self._owes_ack():
                    continue  # idle counts only once nothing is owed
                self._timed_out(kind)
                return b""
        finally:
            for fut in (read, closing):
                if not fut.done():
                    fut.cancel()

    def _read_timeout(self) -> tuple[float | None, str]:
        """How long the next read may wait, and which timeout ends it."""
        if self.decoder.mid_frame and self.frame_time_left is not None:
            return max(self.frame_time_left, 0.0), "frame"
        idle = self.channel.idle_timeout
        if not idle:
            return None, ""
        if self._owes_ack():
            return idle, "idle"  # look again later; the clock restarts with the ACK write
        return max(self.last_activity + idle - time.monotonic(), 0.0), "idle"

    def _owes_ack(self) -> bool:
        return bool(self.pending_frames or self.relay_tasks or self.write_lock.locked())

    def _timed_out(self, kind: str) -> None:
        if kind == "frame":
            # Slowloris: a started frame that does not complete would hold the
            # connection (and its buffer) for good. Nothing of it was committed;
            # ACKs owed for earlier frames are still written before the close.
            self.log.warning("connection_frame_timeout", frame_timeout=self.channel.frame_timeout,
                             buffered=self.decoder.buffered_bytes())
        else:
            self.log.info("connection_idle_timeout", idle_timeout=self.channel.idle_timeout)
        if self.ctx.metrics is not None:
            self.ctx.metrics.connection_timed_out(self.channel.name, kind)

    def _note_eof(self, data: bytes) -> bytes:
        if not data:
            self.peer_gone.set()
        return data

    def _stop_reading(self) -> bool:
        """Aborted, or closing and the frame being received when the close came is complete.

        SPEC 7: on shutdown a connection finishes the message it is reading
        and no more. A sender that pipelines never looks idle, so "stop when
        not mid-frame" could keep it reading until the budget runs out; the
        frame count fixed at the first look after the close bounds it to the
        frames already received plus the one in progress.
        """
        if self.closed:
            return True
        if not self.closing.is_set():
            return False
        if self.finish_upto is None:
            self.finish_upto = self.frames_completed + (1 if self.decoder.mid_frame else 0)
        return self.frames_completed >= self.finish_upto

    def _stop_between_frames(self) -> bool:
        """Closing, at a frame boundary inside a chunk: handle nothing past the frame in progress."""
        if not self.closing.is_set():
            return False
        if self.finish_upto is None:
            self.finish_upto = self.frames_completed  # between two frames: none is in progress
        return self.frames_completed >= self.finish_upto

    async def _read_frames(self) -> None:
        while True:
            if self._stop_reading():
                if self.decoder.mid_frame and not self.closed:
                    self.log.info("frame_after_close_dropped", buffered=self.decoder.buffered_bytes())
                return
            if self._junk_counted:  # a flood of junk: slow this sender down, not the others
                self._junk_counted = False
                await asyncio.sleep(JUNK_READ_PAUSE)
            data, self.initial = (self.initial, b"") if self.initial else (await self._read_chunk(), b"")
            if not data:
                if self.decoder.mid_frame:
                    self.log.warning("connection_closed_mid_frame", buffered=self.decoder.buffered_bytes())
                return
            was_mid_frame = self.decoder.mid_frame
            events = self.decoder.feed(data)
            self._time_frame(was_mid_frame, events)
            for index, event in enumerate(events):
                if self.closed:
                    return  # aborted: frames still buffered are not handled (no ACK could go out)
                if isinstance(event, (mllp.Frame, mllp.OversizeFrame)) and self._stop_between_frames():
                    # Received but not handled: kept for a successor that adopts this
                    # connection; otherwise no ACK goes out and the sender resends.
                    for rest in events[index:]:
                        if isinstance(rest, mllp.Frame):
                            self.unhandled += mllp.encode_frame(rest.payload)
                    return
                received_at = time.time()
                if not isinstance(event, mllp.JunkSkipped):
                    self.last_activity = time.monotonic()
                if isinstance(event, mllp.Frame):
                    self.frames_completed += 1
                    await self._enqueue(functools.partial(self._handle_frame, event.payload, received_at))
                elif isinstance(event, mllp.OversizeFrame):
                    self.frames_completed += 1
                    await self._enqueue(functools.partial(self._handle_oversize, event, received_at))
                elif not self.junk_logged:
                    self.junk_logged = True
                    self.log.warning("bytes_outside_frame_skipped", count=event.count)

    def _time_frame(self, was_mid_frame: bool, events: list[mllp.Event]) -> None:
        """Start frame_timeout's clock when a frame begins; stop it between frames.

        A frame the sender restarts (a new start block inside it) keeps the
        clock of the first: restarting must not be a way around the timeout.
        """
        if not self.decoder.mid_frame:
            self.frame_time_left = None
        elif not was_mid_frame or self.frame_time_left is None or any(
            not isinstance(e, mllp.JunkSkipped) for e in events
        ):
            self.frame_time_left = self.channel.frame_timeout

    async def _enqueue(self, handle: Callable[[], Coroutine[Any, Any, Reply]]) -> None:
        """Start handling a frame once a pipelining slot is free; its ACK is written in arrival order.

        Audit rows are written without holding a slot, so they have their own
        bound: reading pauses while this connection has too many queued.
        """
        while len(self.audit_jobs) >= MAX_PENDING_AUDITS:
            await asyncio.wait(set(self.audit_jobs), return_when=asyncio.FIRST_COMPLETED)
        await self.slots.acquire()
        self.pending_frames += 1
        task = asyncio.create_task(handle())
        self._track_reply(task)
        self.replies.put_nowait(task)

    def _track_reply(self, task: asyncio.Task[Reply]) -> None:
        """Keep reply tasks in arrival order, so what is owed can move in order (see ``_owed``)."""
        self.reply_order.append(task)
        while len(self.reply_order) > self.pending_frames:
            self.reply_order.popleft()  # taken by the writer and done with

    async def _write_replies(self) -> None:
        while True:
            task = await self.replies.get()
            if task is None:
                return
            try:
                reply = await task
            except Exception as exc:  # noqa: BLE001 - a bug in one frame must not kill the connection
                # The handlers answer their own failures (_handle_frame); this is
                # only reached by a bug outside them. Type only: no message body.
                self.log.error("frame_handling_failed", error_type=type(exc).__name__)
                reply = Reply()
            finally:
                self.pending_frames -= 1
                self.slots.release()
            for ack, on_written in reply.acks:
                ok = await self._write_ack(ack)
                if on_written is not None:
                    on_written(ok)
            if reply.relay_for is not None:
                message_id, env = reply.relay_for
                if len(self.relay_tasks) >= MAX_PENDING_RELAYS:
                    self._relay_overflow(message_id)
                    continue
                task_ = asyncio.create_task(self._relay_application_ack(message_id, env))
                self.relay_tasks.add(task_)
                task_.add_done_callback(self.relay_tasks.discard)

    async def _write_ack(self, ack: bytes) -> bool:
        """Write one ACK frame; True when it counts as delivered.

        A sender that half-closed after its last frame (``nc -N`` style) still
        reads its ACK, so the ACK is written even after EOF — but then it is
        recorded undelivered (we cannot know it was read; a retransmit gets it
        replayed and marked delivered).
        """
        if self.closed or self.writer.is_closing():
            return False
        async with self.write_lock:
            try:
                # Whatever the ACK's origin (built here, the server's text,
                # a row an older version stored): exactly one frame goes out.
                self.writer.write(mllp.encode_ack_frame(ack))
                await self.writer.drain()
            except (ConnectionError, OSError) as exc:
                self.log.info("ack_write_failed", error=str(exc))
                return False
        self.last_activity = time.monotonic()
        return not self.peer_gone.is_set()

    def _relay_overflow(self, message_id: str) -> None:
        """Too many application ACKs awaited on this connection: this one is replayed on retransmit."""
        self._record_outcome(message_id)(False)
        if not self._relay_overflow_logged:
            self._relay_overflow_logged = True
            self.log.warning("application_acks_not_awaited", limit=MAX_PENDING_RELAYS, id=message_id)

    # -- outcome bookkeeping -------------------------------------------------

    def _set_outcome(self, message_id: str, outcome: str) -> None:
        """Record whether the source got its final ACK; rides along with the next commit."""
        self.ctx.writer.defer(lambda s: s.set_ack_outcome(message_id, outcome))

    def _record_outcome(self, message_id: str) -> _OutcomeRecorder:
        return _OutcomeRecorder(self, message_id)

    def _audit(self, item: AuditItem, *, limited: bool = True) -> bool:
        """Keep a ``nacked`` audit row; False when it was only counted (over the limit).

        ``limited``: rejected and unparseable frames count against the
        per-connection limit per minute; inbound ACKs (one per ACK we relayed)
        do not, but every audit row goes through the per-connection queue bound.
        """
        if limited and not self._audit_allowed():
            return False
        future = asyncio.wrap_future(self.ctx.writer.submit(lambda s: s.record_audit(item)))
        self.audit_jobs.add(future)
        future.add_done_callback(self._audit_done)
        return True

    def _audit_done(self, future: asyncio.Future[str]) -> None:
        self.audit_jobs.discard(future)
        if not future.cancelled() and future.exception() is not None:
            self.log.warning("audit_row_failed", error=str(future.exception()))

    def _audit_quota_left(self) -> bool:
        """Whether the next rejected frame would still be stored (and so logged) in this window."""
        return (time.monotonic() - self._audit_window_start >= AUDIT_WINDOW
                or self._audit_rows_in_window < AUDIT_ROWS_PER_WINDOW)

    def _audit_allowed(self) -> bool:
        """Take one audit row of this window's quota; else count the frame (metric, summary line)."""
        now = time.monotonic()
        if now - self._audit_window_start >= AUDIT_WINDOW:
            self._log_unstored_audits()
            self._audit_window_start = now
            self._audit_rows_in_window = 0
        if self._audit_rows_in_window < AUDIT_ROWS_PER_WINDOW:
            self._audit_rows_in_window += 1
            return True
        self._audit_unstored += 1
        self._junk_counted = True
        if self.ctx.metrics is not None:
            self.ctx.metrics.audit_row_not_stored(self.channel.name)
        if self._audit_summary is None:
            # One line at the end of the window, not one per frame.
            self._audit_summary = asyncio.get_running_loop().call_later(
                max(self._audit_window_start + AUDIT_WINDOW - now, 0.0), self._log_unstored_audits
            )
        return False

    def _log_unstored_audits(self) -> None:
        if self._audit_summary is not None:
            self._audit_summary.cancel()
            self._audit_summary = None
        if self._audit_unstored:
            self.log.warning("audit_rows_not_stored", count=self._audit_unstored,
                             limit=AUDIT_ROWS_PER_WINDOW, window_s=AUDIT_WINDOW)
            self._audit_unstored = 0

    def _rejected(self, code: AckCode) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.message_rejected(self.channel.name, str(code))

    # -- frames --------------------------------------------------------------

    async def _handle_oversize(self, event: mllp.OversizeFrame, received_at: float) -> Reply:
        try:
            return await self._intake_oversize(event, received_at)
        except Exception as exc:  # noqa: BLE001 - answered below: no frame ends in silence
            return self._handling_failed(exc, event.prefix, received_at)

    async def _intake_oversize(self, event: mllp.OversizeFrame, received_at: float) -> Reply:
        if self._audit_quota_left():  # junk log lines are limited like its audit rows
            self.log.warning("frame_too_large", size=event.size, limit=self.channel.max_message_bytes)
        text = f"message of {event.size} bytes exceeds max_message_bytes {self.channel.max_message_bytes}"
        try:
            env: Envelope | None = envelope.read_msh(event.prefix)
        except NoMshSegment:
            self._audit(AuditItem(self.channel.name, self.remote, event.prefix, "207", text, received_at=received_at))
            return Reply()
        except MalformedMsh as exc:
            env = exc.partial
        return self._reject(env, event.prefix, Outcome.TOO_LARGE, 207, text, received_at,
                            codec=self._codec_or_default(env))

    def _codec_or_default(self, env: Envelope | None) -> str:
        if env is None:
            return "ascii"
        try:
            return envelope.resolve_codec(env.charset, self.channel.encoding)
        except HL7Error:
            return "ascii"

    def _reject(
        self,
        env: Envelope | None,
        body: bytes,
        outcome: Outcome,
        error_code: int,
        text: str,
        received_at: float,
        *,
        codec: str = "ascii",
        audit: bool = True,
    ) -> Reply:
        """A non-accept ACK (if MSH-15 wants one) plus a ``nacked`` audit row."""
        enhanced = env.enhanced if env is not None else False
        code = acks.ack_code(outcome, enhanced)
        ack: bytes | None = None
        if env is None or acks.commit_ack_wanted(env, success=False):
            ack = acks.build_ack(
                env, code, text=text, error_code=error_code, codec=codec,
                inbound_control_id=envelope.scrape_control_id(body) if env is None else "",
            )
            self._rejected(code)
        stored = False
        if audit:
            stored = self._audit(
                AuditItem(
                    self.channel.name, self.remote, body, str(error_code), text,
                    sending_app=env.sending_app if env else "",
                    sending_facility=env.sending_facility if env else "",
                    control_id=env.control_id if env else "",
                    message_type=env.message_type if env else "",
                    ack_sent=ack, received_at=received_at,
                )
            )
        if stored or not audit:  # junk log lines are limited like its audit rows
            self.log.info(
                "message_rejected", code=str(code), error_code=error_code, reason=text,
                control_id=env.control_id if env else None,
                message_type=env.message_type if env else None,
            )
        return Reply().add(ack)

    async def _handle_frame(self, payload: bytes, received_at: float) -> Reply:
        """Handle one frame; an unexpected error still gets the sender an answer."""
        try:
            return await self._intake_frame(payload, received_at)
        except Exception as exc:  # noqa: BLE001 - answered below: no frame ends in silence
            return self._handling_failed(exc, payload, received_at)

    def _handling_failed(self, exc: Exception, payload: bytes, received_at: float) -> Reply:
        """Last resort for a frame whose handling raised: AE/CE 207 and an audit row, never silence.

        Any frame whose MSH can be read gets an ACK (except an inbound ACK, or
        where MSH-15 waives it) and every frame an audit row, whatever went
        wrong. HL7 table 0357: 207 application internal error. The log line
        names the exception type and where it was raised, never its text,
        which may quote the message.
        """
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        self.log.error("frame_handling_failed", error_type=type(exc).__name__, where=where)
        text = "internal error while handling the message; resending it is safe"
        env: Envelope | None = None
        try:
            try:
                env = envelope.read_msh(payload)
            except MalformedMsh as malformed:
                env = malformed.partial
            except NoMshSegment:
                # No MSH: no ACK is owed, the frame is kept as an audit row.
                self._audit(AuditItem(self.channel.name, self.remote, payload, "207", text,
                                      received_at=received_at))
                return Reply()
            if env is not None and env.is_ack:
                self._audit(AuditItem(self.channel.name, self.remote, payload, "207", text,
                                      received_at=received_at))
                return Reply()
            return self._reject(env, payload, Outcome.MALFORMED, 207, text, received_at)
        except Exception as again:  # noqa: BLE001 - even the reject failed: the minimal ACK still goes out
            self.log.error("frame_handling_failed", error_type=type(again).__name__, where="reject")
            wanted = env is None or acks.commit_ack_wanted(env, success=False)
            if not wanted:
                return Reply()
            code = acks.ack_code(Outcome.MALFORMED, env is not None and env.enhanced)
            return Reply().add(acks.build_ack(None, code, text=text, error_code=207))

    async def _intake_frame(self, payload: bytes, received_at: float) -> Reply:
        name = self.channel.name
        try:
            env = envelope.read_msh(payload)
        except NoMshSegment:
            wide = envelope.sniff_wide_encoding(payload)
            if wide is not None:
                # SPEC 4: UTF-16/32 is forbidden by HL7 and rejected — but its MSH
                # can be read, so the sender gets an ACK, in ASCII.
                return self._reject(envelope.read_wide_msh(payload, wide), payload, Outcome.MALFORMED, 102,
                                    f"{wide.upper()} is not allowed for HL7 over MLLP; send an 8-bit encoding",
                                    received_at)
            # SPEC 4: a frame with no MSH gets no ACK; it is kept as an audit row.
            if self._audit(AuditItem(name, self.remote, payload, "100", "no MSH segment", received_at=received_at)):
                self.log.warning("frame_without_msh_dropped", size=len(payload))
            return Reply()
        except MalformedMsh as exc:
            if exc.partial is not None and exc.partial.is_ack:
                env = exc.partial  # an inbound ACK is never answered, even a sloppy one
            else:
                return self._reject(exc.partial, payload, Outcome.MALFORMED, exc.error_code, exc.text,
                                    received_at, codec=self._codec_or_default(exc.partial))
        if self.ctx.metrics is not None:
            self.ctx.metrics.message_received(name)
        if env.is_ack:
            # A sender acknowledging what we relayed: recorded, never queued or answered.
            self.log.info("inbound_ack_recorded", control_id=env.control_id)
            self._audit(
                AuditItem(name, self.remote, payload, "0", "inbound ACK recorded",
                          sending_app=env.sending_app, sending_facility=env.sending_facility,
                          control_id=env.control_id, message_type=env.message_type,
                          received_at=received_at),
                limited=False,
            )
            return Reply()
        try:
            codec = envelope.resolve_codec(env.charset, self.channel.encoding)
            envelope.decode_message(payload, codec)
        except HL7Error as exc:
            return self._reject(env, payload, Outcome.MALFORMED, exc.error_code, exc.text, received_at,
                                codec="ascii")
        refused = envelope.unsupported_reason(
            env, message_types=self.channel.accept_message_types,
            processing_ids=self.channel.accept_processing_ids, versions=self.channel.accept_versions,
        )
        if refused is not None:
            return self._reject(env, payload, Outcome.UNSUPPORTED, refused[0], refused[1], received_at,
                                codec=codec)
        ack_mode = "enhanced" if env.enhanced else self.channel.ack
        commit_ack = None
        if ack_mode != "application" and acks.commit_ack_wanted(env, success=True):
            commit_ack = acks.build_ack(env, acks.ack_code(Outcome.COMMITTED, env.enhanced), codec=codec)
        item = IntakeItem(
            channel=name, remote=self.remote, sending_app=env.sending_app,
            sending_facility=env.sending_facility, control_id=env.control_id,
            message_type=env.message_type, body=payload, encoding=codec, ack_mode=ack_mode,
            accept_ack_type=env.accept_ack_type, application_ack_type=env.application_ack_type,
            commit_ack=commit_ack, received_at=received_at,
        )
        try:
            result = await self.ctx.writer.run(lambda s: s.intake(item))
        except StorageError as exc:
            # SPEC 4: a storage failure is answered AR/CE ("resend later"), never AA/CA.
            self.log.error("message_not_committed", control_id=env.control_id, error=str(exc))
            return self._reject(env, payload, Outcome.RESEND_LATER, 207,
                                "storage failure: message not accepted, resend later",
                                received_at, codec=codec, audit=False)
        return await self._answer(env, codec, item, result)

    async def _answer(self, env: Envelope, codec: str, item: IntakeItem, result: IntakeResult) -> Reply:
        mlog = self.log.bind(control_id=env.control_id, message_type=env.message_type, id=result.message_id)
        if result.outcome == "backpressure":
            mlog.warning("message_refused_backpressure")
            return self._reject(env, item.body, Outcome.RESEND_LATER, 207,
                                "queue full: message not accepted, resend later",
                                item.received_at, codec=codec, audit=False)
        if result.outcome == "conflict":
            mlog.warning("control_id_reused_with_other_body", prior_id=result.message_id)
            return self._reject(env, item.body, Outcome.DUPLICATE_KEY, 205,
                                f"duplicate key identifier: MSH-10 {env.control_id} was used for another message",
                                item.received_at, codec=codec)
        if result.outcome == "accepted":
            mlog.info("message_committed", seq=result.seq)
            if self.ctx.metrics is not None:
                self.ctx.metrics.message_committed(item.channel)
            if self.ctx.on_committed is not None:
                self.ctx.on_committed(item.channel)
            return await self._final_acks(env, codec, result.message_id, item.ack_mode,
                                          commit_ack=item.commit_ack, app_ack=None)
        # duplicate: replay the final ACK byte for byte (SPEC 4 and 6)
        mlog.info("retransmit_answered_from_dedupe", prior_state=result.prior_state)
        return await self._final_acks(env, codec, result.message_id, result.ack_mode,
                                      commit_ack=result.commit_ack, app_ack=result.app_ack)

    async def _final_acks(
        self, env: Envelope, codec: str, message_id: str, ack_mode: str,
        *, commit_ack: bytes | None, app_ack: bytes | None,
    ) -> Reply:
        reply = Reply()
        if ack_mode == "commit":
            if commit_ack is None:
                self._set_outcome(message_id, "not_owed")
                return reply
            return reply.add(commit_ack, self._record_outcome(message_id))
        if ack_mode == "enhanced":
            reply.add(commit_ack)
            success = None if app_ack is None else acks.read_ack_code(app_ack) in ("AA", "CA")
            if app_ack is not None:
                if acks.application_ack_wanted(env, success=bool(success)):
                    reply.add(app_ack, self._record_outcome(message_id))
                else:
                    self._set_outcome(message_id, "not_owed")
            elif env.application_ack_type.upper() == "NE":
                self._set_outcome(message_id, "not_owed")
            else:
                reply.relay_for = (message_id, env)
                self._expect_relay(message_id, env)
            return reply
        # Original mode, channel ack = "application": hold the answer for the server's ACK.
        if app_ack is None:
            return await self._hold_application_ack(env, codec, message_id, self.ctx.application_ack_timeout)
        return reply.add(app_ack, self._record_outcome(message_id))

    async def _hold_application_ack(self, env: Envelope, codec: str, message_id: str, timeout: float) -> Reply:
        """Original mode, ``ack = "application"``: the answer is the server's ACK, or AR after ``timeout``.

        Waits even after the sender's EOF: a half-closed sender still reads; a
        gone one makes the write count as undelivered. At shutdown the held
        ACK moves with the connection to a successor (see ``_finish_replies``),
        or, with none, ``release_held`` ends the wait with AR "resend later".
        """
        task = asyncio.current_task()
        assert task is not None  # always run inside a reply task
        self.held[task] = _Held(message_id, env, codec, time.monotonic() + timeout)
        try:
            done = await unless(self.ctx.relay.wait(message_id, timeout), self.release_held)
            app_ack = done.result() if done is not None else None
            if await self._moved_away():
                return Reply()  # the successor answers it, on this same connection
        finally:
            self.held.pop(task, None)
        if app_ack is not None:
            return Reply().add(app_ack, self._record_outcome(message_id))
        self._set_outcome(message_id, "undelivered")
        if self.release_held.is_set():
            self.log.info("application_ack_deferred_at_stop", id=message_id, control_id=env.control_id)
        else:
            self.log.info("application_ack_timed_out", id=message_id, control_id=env.control_id)
        ar = acks.build_ack(
            env, AckCode.AR, codec=codec, error_code=207,
            text="accepted and queued; resend later for the application response",
        )
        self._rejected(AckCode.AR)
        return Reply().add(ar)

    def _expect_relay(self, message_id: str, env: Envelope) -> _Relay:
        """Note an enhanced-mode relay owed from now on, so it can move with the connection."""
        entry = _Relay(message_id, env, asyncio.current_task())
        self.relays[id(env)] = entry
        return entry

    async def _relay_application_ack(self, message_id: str, env: Envelope) -> None:
        """Enhanced mode: relay the server's ACK when it comes, if this connection is idle."""
        if id(env) not in self.relays:
            self._expect_relay(message_id, env)
        try:
            if self.moved:
                return  # it went to the successor with the connection
            try:
                app_ack = await self.ctx.relay.wait(message_id, timeout=None)
                if app_ack is None or await self._moved_away():
                    return
            except asyncio.CancelledError:
                # The connection closed first: the sender's retransmit gets it replayed.
                self._record_outcome(message_id)(False)
                raise
            success = acks.read_ack_code(app_ack) in ("AA", "CA")
            if not acks.application_ack_wanted(env, success=success):
                self._set_outcome(message_id, "not_owed")
                return
            # Written only when no message on this connection awaits its own ACK
            # (senders match ACKs by order as often as by MSA-2).
            if self.pending_frames == 0 and not self.decoder.mid_frame and not self.closed:
                self.relay_writes += 1
                try:
                    written = await self._write_ack(app_ack)
                finally:
                    self.relay_writes -= 1
            else:
                written = False
            self._record_outcome(message_id)(written)
            self.log.info("application_ack_relayed" if written else "application_ack_undelivered", id=message_id)
        finally:
            self.relays.pop(id(env), None)

    def _start_relay(self, message_id: str, env: Envelope) -> None:
        self.relays[id(env)] = _Relay(message_id, env, None)
        task = asyncio.create_task(self._relay_application_ack(message_id, env), name=f"relay-{self.conn_id}")
        self.relay_tasks.add(task)
        task.add_done_callback(self.relay_tasks.discard)

    async def _take_owed(self, owed: Owed) -> None:
        """Adopted with ACKs owed: answer them first, in order, before any frame not yet handled."""
        for entry in owed.replies:
            await self._enqueue(functools.partial(self._owed_reply, entry))
        for relay in owed.relays:
            self._start_relay(relay.message_id, relay.inbound)

    async def _owed_reply(self, owed: OwedReply) -> Reply:
        """One answer a predecessor owed: its ready frames, or the application ACK it held."""
        if owed.wait is not None:
            w = owed.wait
            return await self._hold_application_ack(w.inbound, w.codec, w.message_id, w.timeout)
        reply = Reply()
        for frame in owed.frames:
            reply.add(frame.frame, None if frame.message_id is None else self._record_outcome(frame.message_id))
        if owed.relay is not None:
            reply.relay_for = (owed.relay.message_id, owed.relay.inbound)
            self._expect_relay(owed.relay.message_id, owed.relay.inbound)
        return reply
