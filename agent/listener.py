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
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any, cast

import structlog

from agent import acks, envelope, mllp
from agent.acks import AckCode, Outcome
from agent.envelope import Envelope, MalformedMsh, NoMshSegment
from agent.errors import HL7Error, StorageError
from agent.relay import AckRelay
from agent.sockets import guard_listener
from agent.store import AuditItem, IntakeItem, IntakeResult
from agent.writer import Writer

if TYPE_CHECKING:
    from agent.config import ChannelSettings
    from agent.metrics import AgentMetrics

log = structlog.get_logger(__name__)
_connection_ids = count(1)

#: Frames of one connection handled ahead of their ACK write (pipelining bound).
MAX_PIPELINED_FRAMES = 32
READ_CHUNK = 256 * 1024
#: Matches sockets.bind_listener and the systemd socket unit's Backlog=.
LISTEN_BACKLOG = 1024


@dataclass
class IntakeContext:
    """What every listener of a process shares."""

    writer: Writer
    relay: AckRelay
    application_ack_timeout: float = 30.0
    metrics: AgentMetrics | None = None
    #: Called with the channel name after a row was committed (wakes the dispatcher).
    on_committed: Callable[[str], None] | None = None
    #: Hands a live connection to the successor at shutdown (SPEC 7); True when taken.
    hand_over: Callable[[str, int, str, bytes], Awaitable[bool]] | None = None


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


def format_peer(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peer or "unknown")


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
        self._ssl = build_server_ssl(channel)
        self.log = log.bind(channel=channel.name)

    async def start(self) -> None:
        # The listener may be shared with other processes (systemd, a
        # predecessor or successor), any of which can switch it to blocking
        # mode: guard accept() against that (see agent.sockets).
        self.sock = guard_listener(self.sock)
        # asyncio calls listen() again: keep the shared socket's deep backlog
        # (a successor shares this accept queue during an upgrade).
        self._server = await asyncio.start_server(
            self._accept, sock=self.sock, ssl=self._ssl, limit=READ_CHUNK, backlog=LISTEN_BACKLOG
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
            writer.close()
            return
        if self.channel.max_connections and len(self.connections) >= self.channel.max_connections:
            self.log.warning("connection_refused_limit", peer=remote, limit=self.channel.max_connections)
            writer.close()
            return
        await self._serve(Connection(self, reader, writer, remote))

    async def adopt(self, sock: socket.socket, remote: str, buffered: bytes) -> bool:
        """Serve a connection a predecessor handed over mid-stream (SPEC 7 upgrade)."""
        if self._ssl is not None or not self.serving:
            return False  # TLS state cannot move between processes; nor do we take work while stopping
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
        conn = Connection(self, reader, writer, remote, initial=buffered)
        conn.log.info("connection_adopted", buffered=len(buffered))
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
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)
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
        self.log = log.bind(channel=self.channel.name, peer=remote, conn=self.conn_id)

    # -- lifecycle -----------------------------------------------------------

    def request_close(self) -> None:
        self.closing.set()

    def abort(self) -> None:
        self.closed = True
        self.writer.transport.abort()

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
                await ack_writer
            if self.closing.is_set() and not self.closed and not await self._hand_over():
                await self._lingering_close()
            for task in list(self.relay_tasks):
                task.cancel()
            self.closed = True
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
            self.log.info("connection_closed")

    async def _hand_over(self) -> bool:
        """Give the live connection to the successor, with every byte read but not handled (SPEC 7)."""
        if self.ctx.hand_over is None or self.peer_gone.is_set() or self.listener._ssl is not None:
            return False
        in_progress = self.decoder.unconsumed()
        sock = self.writer.get_extra_info("socket")
        if in_progress is None or sock is None:
            return False
        transport = cast(asyncio.Transport, self.writer.transport)
        # ACKs still in asyncio's write buffer would be lost with our fd.
        deadline = time.monotonic() + 2.0
        while transport.get_write_buffer_size() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if transport.get_write_buffer_size():
            return False  # a sender that does not read: close it the usual way
        # From here no ACK may be written on our side (a late enhanced-mode relay
        # is recorded undelivered and replayed on retransmit instead).
        self.closed = True
        transport.pause_reading()
        buffered = bytearray(self.unhandled + in_progress)
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
                self.closed = False
                transport.resume_reading()
                return False  # the sender closed: nothing to hand on
            buffered += data
        taken = await self.ctx.hand_over(self.channel.name, sock.fileno(), self.remote, bytes(buffered))
        if not taken:
            self.closed = False
            transport.resume_reading()
            return False
        # Our copy of the fd goes; the successor's keeps the connection open.
        transport.abort()
        self.log.info("connection_handed_over", buffered=len(buffered))
        return True

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
        """The next bytes, or b"" at EOF, on idle timeout, or when asked to close while idle."""
        read = asyncio.ensure_future(self.reader.read(READ_CHUNK))
        closing = asyncio.ensure_future(self.closing.wait())
        idle = self.channel.idle_timeout or None
        try:
            done, _ = await asyncio.wait(
                {read, closing}, timeout=idle, return_when=asyncio.FIRST_COMPLETED
            )
            if read in done:
                return self._note_eof(read.result())
            if not done:
                self.log.info("connection_idle_timeout", idle_timeout=idle)
                return b""
            # Asked to close: finish a frame that is being read, else stop now.
            if self._stop_reading():
                return b""
            return self._note_eof(await read)
        finally:
            for fut in (read, closing):
                if not fut.done():
                    fut.cancel()

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
            data, self.initial = (self.initial, b"") if self.initial else (await self._read_chunk(), b"")
            if not data:
                if self.decoder.mid_frame:
                    self.log.warning("connection_closed_mid_frame", buffered=self.decoder.buffered_bytes())
                return
            events = self.decoder.feed(data)
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
                if isinstance(event, mllp.Frame):
                    self.frames_completed += 1
                    await self._enqueue(functools.partial(self._handle_frame, event.payload, received_at))
                elif isinstance(event, mllp.OversizeFrame):
                    self.frames_completed += 1
                    await self._enqueue(functools.partial(self._handle_oversize, event, received_at))
                elif not self.junk_logged:
                    self.junk_logged = True
                    self.log.warning("bytes_outside_frame_skipped", count=event.count)

    async def _enqueue(self, handle: Callable[[], Coroutine[Any, Any, Reply]]) -> None:
        """Start handling a frame once a pipelining slot is free; its ACK is written in arrival order."""
        await self.slots.acquire()
        self.pending_frames += 1
        self.replies.put_nowait(asyncio.create_task(handle()))

    async def _write_replies(self) -> None:
        while True:
            task = await self.replies.get()
            if task is None:
                return
            try:
                reply = await task
            except Exception:  # a bug in one frame must not kill the connection
                self.log.exception("frame_handling_failed")
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
                self.writer.write(mllp.encode_frame(ack))
                await self.writer.drain()
            except (ConnectionError, OSError) as exc:
                self.log.info("ack_write_failed", error=str(exc))
                return False
        return not self.peer_gone.is_set()

    # -- outcome bookkeeping -------------------------------------------------

    def _set_outcome(self, message_id: str, outcome: str) -> None:
        """Record whether the source got its final ACK; rides along with the next commit."""
        self.ctx.writer.defer(lambda s: s.set_ack_outcome(message_id, outcome))

    def _record_outcome(self, message_id: str) -> Callable[[bool], None]:
        def record(written: bool) -> None:
            self._set_outcome(message_id, "delivered" if written else "undelivered")

        return record

    def _audit(self, item: AuditItem) -> None:
        future = self.ctx.writer.submit(lambda s: s.record_audit(item))
        future.add_done_callback(
            lambda f: f.exception() and self.log.warning("audit_row_failed", error=str(f.exception()))
        )

    def _rejected(self, code: AckCode) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.message_rejected(self.channel.name, str(code))

    # -- frames --------------------------------------------------------------

    async def _handle_oversize(self, event: mllp.OversizeFrame, received_at: float) -> Reply:
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
        if audit:
            self._audit(
                AuditItem(
                    self.channel.name, self.remote, body, str(error_code), text,
                    sending_app=env.sending_app if env else "",
                    sending_facility=env.sending_facility if env else "",
                    control_id=env.control_id if env else "",
                    message_type=env.message_type if env else "",
                    ack_sent=ack, received_at=received_at,
                )
            )
        self.log.info(
            "message_rejected", code=str(code), error_code=error_code, reason=text,
            control_id=env.control_id if env else None,
            message_type=env.message_type if env else None,
        )
        return Reply().add(ack)

    async def _handle_frame(self, payload: bytes, received_at: float) -> Reply:
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
            self.log.warning("frame_without_msh_dropped", size=len(payload))
            self._audit(AuditItem(name, self.remote, payload, "100", "no MSH segment", received_at=received_at))
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
                          received_at=received_at)
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
            return reply
        # Original mode, channel ack = "application": hold the answer for the server's ACK.
        if app_ack is None:
            # Waits even after the sender's EOF: a half-closed sender still
            # reads; a gone one makes the write count as undelivered.
            app_ack = await self.ctx.relay.wait(message_id, self.ctx.application_ack_timeout)
        if app_ack is not None:
            return reply.add(app_ack, self._record_outcome(message_id))
        self._set_outcome(message_id, "undelivered")
        self.log.info("application_ack_timed_out", id=message_id, control_id=env.control_id)
        ar = acks.build_ack(
            env, AckCode.AR, codec=codec, error_code=207,
            text="accepted and queued; resend later for the application response",
        )
        self._rejected(AckCode.AR)
        return reply.add(ar)

    async def _relay_application_ack(self, message_id: str, env: Envelope) -> None:
        """Enhanced mode: relay the server's ACK when it comes, if this connection is idle."""
        try:
            app_ack = await self.ctx.relay.wait(message_id, timeout=None)
        except asyncio.CancelledError:
            # The connection closed first: the sender's retransmit gets it replayed.
            self._record_outcome(message_id)(False)
            raise
        if app_ack is None:
            return
        success = acks.read_ack_code(app_ack) in ("AA", "CA")
        if not acks.application_ack_wanted(env, success=success):
            self._set_outcome(message_id, "not_owed")
            return
        # SPEC 4: written only when no message on this connection awaits its own ACK.
        if self.pending_frames == 0 and not self.decoder.mid_frame and not self.closed:
            written = await self._write_ack(app_ack)
        else:
            written = False
        self._record_outcome(message_id)(written)
        self.log.info("application_ack_relayed" if written else "application_ack_undelivered", id=message_id)
