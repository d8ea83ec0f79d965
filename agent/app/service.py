"""The daemon: assembles database, listeners, dispatcher and admin, and stops them in order.

Shutdown order on SIGTERM (uvicorn's; docs/operations.md): stop accepting; let every
connection finish the frame it is reading (commit + ACK) and hand it to the
successor (with the application ACKs its sender still waits for), or close
it; without a successor give pending application ACKs a bounded wait, then
AR "resend later"; stop claiming and let in-flight transmits settle; release the
lease; checkpoint the WAL; exit 0 — all within ``agent.shutdown_budget``.
A second signal skips the waiting: connections are cut and the dispatcher
cancelled, but every job already handed to the writer is still committed, so
nothing that got an accept ACK is lost (inflight rows are recovered by the
next lease holder, docs/queue.md#recovery).

Over 400 lines on purpose: the start order and the stop order are read, and
reviewed, side by side in this one class.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
import signal
import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import structlog

from agent import __version__
from agent.app import overlap
from agent.app.config import ChannelSettings, Settings
from agent.app.preflight import data_dir_problem, file_warnings, log_start_failure, tls_problem
from agent.core.timefmt import rfc3339
from agent.errors import AdminListenInUse, ConfigError, StartupError, StorageError
from agent.runtime import adoption, audit, sockets
from agent.runtime.admin import AdminServer, LoopHeartbeat, RuntimeView
from agent.runtime.aio import cancel_and_wait, unless
from agent.runtime.handover import HandoverServer, receive_handover, receive_republished
from agent.runtime.metrics import AgentMetrics
from agent.runtime.mllp_server import ChannelListener, IntakeContext
from agent.runtime.outbound import OutboundChannel
from agent.runtime.relay import AckRelay
from agent.runtime.sdnotify import Notifier
from agent.runtime.upstream import safe_url
from agent.storage import maintenance
from agent.storage import sqlite as db
from agent.storage.maintenance import FREE_PAGE_SLACK
from agent.storage.store import SqliteStore, open_stores
from agent.storage.writer import Reader, Writer

if TYPE_CHECKING:
    from agent.runtime.dispatcher import Dispatcher

log = structlog.get_logger(__name__)

HANDOVER_SOCKET = "handover.sock"
#: How long a start whose port is taken waits for a predecessor to serve its listeners again
#: (its successor was killed, leaving a dead socket file: HandoverServer rechecks every second).
HANDOVER_REPUBLISH_WAIT = 3.0
#: At shutdown without a successor: time kept to answer held application ACKs AR and close after
#: (the lingering close waits up to 2 s for the sender to close its side).
HELD_ACK_GRACE = 2.5


#: How long a failed intake commit keeps /readyz at 503 when no later one succeeded.
INTAKE_FAILURE_SHOWN_S = 3.0


class Agent:
    """One daemon process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = AgentMetrics()
        self.metrics.set_info(agent_id=settings.agent.id, version=__version__)
        self.notifier = Notifier.from_environ()
        self.listeners: list[ChannelListener] = []
        self.outbound: list[OutboundChannel] = []
        self.stop_requested = asyncio.Event()
        self.force_stop = asyncio.Event()
        self.started_at = time.time()
        self.writer: Writer | None = None
        self.reader: Reader | None = None
        self.relay: AckRelay | None = None
        self.handover: HandoverServer | None = None
        self.adoption: adoption.AdoptionServer | None = None
        self.admin: AdminServer | None = None
        # The loop refreshes it; /healthz (another thread) fails when it goes stale.
        self.heartbeat = LoopHeartbeat()
        self.dispatcher: Dispatcher | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self._signals = 0
        #: Set when the configured admin address was taken at start and is not ours yet.
        self._admin_pending = False

    # -- start ---------------------------------------------------------------

    def _open_database(self) -> None:
        s = self.settings
        problem = data_dir_problem(s.agent.data_dir)
        if problem is not None:
            raise StartupError(problem.message(), key="agent.data_dir", path=str(problem.path),
                               error=problem.error)
        tls = tls_problem(s)
        if tls is not None:  # found now, not at every connect to come; a configuration error (exit 2)
            raise ConfigError(f"config error: {tls[1]}")
        # SQLite's file in data_dir, or the PostgreSQL database of queue.dsn.
        try:
            writer_store, reader_store = open_stores(s.db_path, s.queue, s.agent.id, time.time())
        except (OSError, StorageError) as exc:
            error = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
            if s.queue.backend == "postgresql":
                raise StartupError(f"queue.dsn: {error}", key="queue.dsn", error=error) from exc
            raise StartupError(f"agent.data_dir: {error}", key="agent.data_dir", path=str(s.db_path),
                               error=error) from exc
        self.writer = Writer(writer_store)
        self.writer.start()
        self.reader = Reader(reader_store)

    async def _listening_sockets(self) -> dict[str, socket.socket]:
        """systemd's sockets, else a predecessor's (handover), else bind (docs/deploy.md).

        systemd passes a socket unit's listeners (named after the channel) and
        those we gave its fd store before a crash (named ``<channel>.stored``).
        A stored one whose address no longer matches the channel's ``listen``
        (the configuration changed) is dropped from the store and bound anew;
        a socket unit's always wins, as its ListenStream= is the operator's
        choice. Whatever we bound or were handed goes to the fd store, so a
        restart after a crash refuses no connection.
        """
        channels = {c.name: c for c in self.settings.channels if not c.outbound}
        found: dict[str, socket.socket] = {}
        inherited = sockets.inherited_sockets()
        for name, socks in inherited.items():
            channel_name = name.removesuffix(sockets.STORED_SUFFIX)
            stored = channel_name != name
            channel = channels.get(channel_name)
            if channel is None or not socks or channel_name in found:
                if channel is None and not stored:
                    log.warning("inherited_socket_unused", name=name, hint="FileDescriptorName must equal a channel name")
                usable = False
            else:
                usable = not stored or sockets.same_address(socks[0], channel.host, channel.port)
            if not usable and stored:
                # A channel removed or moved since the crash: never keep serving the old address.
                log.info("stored_listener_dropped", channel=channel_name)
                sockets.forget_stored_listener(channel_name)
            if usable:
                found[channel_name] = socks[0]
                socks = socks[1:]
            for sock in socks:
                sock.close()
        if found:
            log.info("listeners_inherited_from_systemd", channels=sorted(found))
        to_store: dict[str, socket.socket] = {}
        missing = channels.keys() - found.keys()
        if missing:
            handed = await receive_handover(self.settings.agent.data_dir / HANDOVER_SOCKET)
            taken = self._take_handed(handed or {}, channels, missing, found, to_store)
            if taken:
                log.info("listeners_received_by_handover", channels=taken)
        reuse_port = self.settings.agent.reuse_port
        for index, channel in enumerate(self.settings.channels):
            if channel.name in found or channel.outbound:
                continue
            if reuse_port and not sockets.tcp_migrate_req_enabled():
                log.warning(
                    "reuse_port_may_reset_connections",
                    channel=channel.name,
                    hint="closing a SO_REUSEPORT listener resets its queued connections unless "
                    "net.ipv4.tcp_migrate_req=1; prefer the handover socket or systemd activation",
                )
            try:
                found[channel.name] = to_store[channel.name] = sockets.bind_listener(
                    channel.host, channel.port, reuse_port=reuse_port
                )
            except OSError as exc:
                handover_path = self.settings.agent.data_dir / HANDOVER_SOCKET
                if exc.errno == errno.EADDRINUSE and handover_path.exists():
                    # Perhaps a predecessor of ours, about to serve its listeners again.
                    handed = await receive_republished(handover_path, HANDOVER_REPUBLISH_WAIT)
                    self._take_handed(handed or {}, channels, channels.keys() - found.keys(), found, to_store)
                    if channel.name in found:
                        log.info("listeners_received_by_handover", channels=[channel.name])
                        continue
                # A runtime failure (exit 1), not a configuration error: the
                # same config works once the port is free.
                error = exc.strerror or str(exc)
                raise StartupError(
                    f"channels.{channel.name}.listen: cannot listen on {channel.listen}: {error}",
                    key=f"channels[{index}].listen", error=error,
                ) from exc
        sockets.store_listeners(to_store)
        return found

    @staticmethod
    def _take_handed(handed: dict[str, socket.socket], channels: dict[str, ChannelSettings], missing: set[str],
                     found: dict[str, socket.socket], to_store: dict[str, socket.socket]) -> list[str]:
        """Keep the predecessor's listeners of ``missing`` channels that are where ours must listen.

        One bound elsewhere (the channel's ``listen`` changed in this
        version) is closed, and the channel binds its new address: the
        predecessor keeps serving the old one until it stops.
        """
        taken = []
        for name, sock in handed.items():
            channel = channels.get(name)
            if name in missing and channel is not None and sockets.same_address(sock, channel.host, channel.port):
                found[name] = to_store[name] = sock
                taken.append(name)
                continue
            if name in missing and channel is not None:
                log.info("handed_listener_not_used", channel=name, reason="listen changed",
                         listen=channel.listen)
            sock.close()
        return sorted(taken)

    def _view(self) -> RuntimeView:
        assert self.reader is not None
        reader = self.reader
        names = [c.name for c in self.settings.channels]
        partitioned = [c.name for c in self.settings.channels if c.partition_key]

        def recent_failures(limit: int) -> list[dict[str, Any]]:
            rows = reader.call_blocking(SqliteStore.recent_failures, limit)
            return [dataclasses.asdict(row) for row in rows]

        def channel_activity(channels: list[str]) -> list[dict[str, Any]]:
            rows = reader.call_blocking(SqliteStore.channel_activity, channels)
            return [dataclasses.asdict(row) for row in rows]

        return RuntimeView(
            agent_id=self.settings.agent.id,
            version=__version__,
            started_at=self.started_at,
            listeners_up=lambda: (len(self.listeners) == sum(not c.outbound for c in self.settings.channels)
                                  and all(lst.serving for lst in self.listeners)),
            db_writable=self._db_writable,
            upstream_state=self._upstream_state,
            lease_held=lambda: bool(self.dispatcher is not None and self.dispatcher.lease_held),
            stats=lambda: reader.call_blocking(SqliteStore.stats, names, partitioned),
            recent_failures=recent_failures,
            loop_age=self.heartbeat.age,
            channel_activity=channel_activity,
            server_acks=lambda ids: reader.call_blocking(SqliteStore.server_acks, ids),
            live_depth=lambda: reader.call_blocking(SqliteStore.live_depth),
            history=self.metrics.history,
            outbound=lambda: {o.channel.name: o.status() for o in self.outbound},
        )

    def _db_writable(self) -> tuple[bool, str]:
        assert self.writer is not None
        try:
            self.writer.submit(SqliteStore.probe_write).result(timeout=2.0)
        except TimeoutError:
            return False, "write probe timed out (locked or slow disk)"
        except Exception as exc:  # noqa: BLE001 - any failure means not writable
            return False, str(exc)
        failing = self.writer.intake_failing
        if failing is not None and time.monotonic() - failing[0] < INTAKE_FAILURE_SHOWN_S:
            # The probe's one small row fits where messages do not (a full disk
            # reuses WAL space for it): the messages' own commits say more.
            return False, f"intake commits fail: {failing[1]}"
        return True, "ok"

    def _upstream_state(self) -> dict[str, Any]:
        url = self.settings.server.url
        if self.dispatcher is None:
            return {"configured": bool(url), "connected": False, "url": url, "replay": None, "last_error": None,
                    "since": None}
        # "since": when the session last came up or went down (the page's "down for 3m").
        return {**self.dispatcher.upstream_state(),
                "since": rfc3339(self.dispatcher.upstream_changed_at(), millis=False)}

    async def start(self) -> None:
        s = self.settings
        self._open_database()
        assert self.writer is not None
        assert self.reader is not None
        self.relay = AckRelay(self.reader)
        ctx = IntakeContext(
            writer=self.writer,
            relay=self.relay,
            application_ack_timeout=s.server.application_ack_timeout,
            metrics=self.metrics,
        )
        socks = await self._listening_sockets()
        for index, channel in enumerate(s.channels):
            if channel.outbound:
                await self._start_outbound(index, channel, ctx)
                continue
            try:
                listener = ChannelListener(channel, socks[channel.name], ctx)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: a bad certificate or key
                error = str(exc)
                raise StartupError(f"channels.{channel.name}.tls_cert: cannot load the certificate "
                                   f"or its key: {error}", key=f"channels[{index}].tls_cert",
                                   path=str(channel.tls_cert), error=error) from exc
            await listener.start()
            self.listeners.append(listener)
            host, port = socks[channel.name].getsockname()[:2]
            log.info("listener_started", channel=channel.name, host=host, port=port, ack=channel.ack)
        self.handover = HandoverServer(
            s.agent.data_dir / HANDOVER_SOCKET, lambda: {lst.channel.name: lst.sock for lst in self.listeners}
        )
        try:
            await self.handover.start()
        except OSError as exc:
            log.warning("handover_server_unavailable", error=str(exc))
            self.handover = None
        await self._start_adoption(ctx)
        self.metrics.bind_stats(self._view().stats)
        self.tasks.append(asyncio.create_task(self._supervise(self.heartbeat.run(), "heartbeat")))
        self._start_admin()
        if s.server.url:
            from agent.runtime.dispatcher import Dispatcher  # the dispatcher pulls in websockets

            self.dispatcher = Dispatcher(s, self.writer, self.reader, self.relay, self.metrics)
            ctx.on_committed = self.dispatcher.wake
            self.tasks.append(asyncio.create_task(self._supervise(self.dispatcher.run(), "dispatcher")))
        else:
            log.warning("no_upstream_configured", hint="set [server] url; intake still queues messages")
            for channel in s.channels:
                if channel.ack == "application":
                    log.warning("application_ack_without_upstream", channel=channel.name,
                                hint="senders get AR after application_ack_timeout until [server] url is set")
        for key, words in file_warnings(s, time.time()):
            log.warning("config_warning", key=key, warning=words)
        for channel in s.channels:
            for written in channel.allowed_sources:
                network = ipaddress.ip_network(written, strict=False)
                if str(network) != written and "/" in written:
                    log.warning("allowed_source_host_bits", channel=channel.name, written=written,
                                taken_as=str(network), hint=f"write {network} for that network, or the "
                                f"address alone for one host")
            if channel.assign_sequence_numbers and channel.partition_key is not None:
                # Allowed (max_in_flight = 1), but the keys still pass each other.
                log.warning("sequence_numbers_across_partitions", channel=channel.name,
                            hint="MSH-13 follows seq per channel, but a key that waits (retrying, paused) "
                                 "lets later rows of other keys pass: the server may see MSH-13 out of order; "
                                 "leave partition_key out for the HL7 sequence number protocol")
        self.tasks.append(asyncio.create_task(self._supervise(self._maintenance(), "maintenance")))
        self.tasks.append(asyncio.create_task(self._supervise(
            audit.log_operator_actions(self.writer, self.reader), "operator_actions")))
        self.tasks.append(asyncio.create_task(self._supervise(self._watchdog(), "watchdog")))
        watch = overlap.watch_overlap(self._other_instance, grace=overlap.overlap_grace(s.agent.shutdown_budget),
                                      stopping=self.stop_requested, data_dir=s.agent.data_dir)
        self.tasks.append(asyncio.create_task(self._supervise(watch, "overlap")))
        self.notifier.ready(status=self._status_line())
        log.info(
            "agent_started",
            agent_id=s.agent.id,
            version=__version__,
            channels=[c.name for c in s.channels],
            db=s.queue.dsn_masked if s.queue.backend == "postgresql" else str(s.db_path),
            upstream=safe_url(s.server.url) if s.server.url else None,
        )

    async def _start_outbound(self, index: int, channel: Any, ctx: IntakeContext) -> None:  # noqa: ANN401
        """An outbound channel (``connect``): dial the sender, keep the connection, redial after a loss."""
        try:
            outbound = OutboundChannel(channel, ctx)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: a bad CA, certificate or key
            error = str(exc)
            key = "tls_cert" if channel.tls_cert is not None else "tls_server_ca"
            raise StartupError(f"channels.{channel.name}.{key}: cannot load the TLS files: {error}",
                               key=f"channels[{index}].{key}", error=error) from exc
        await outbound.start()
        self.outbound.append(outbound)
        log.info("outbound_channel_started", channel=channel.name, connect=channel.connect, ack=channel.ack,
                 tls=channel.tls_server_ca is not None)

    def _intakes(self) -> list[ChannelListener | OutboundChannel]:
        """Every channel's intake: listeners and outbound channels stop the same way."""
        return [*self.listeners, *self.outbound]

    def _start_admin(self) -> None:
        """Bind the admin address; when another process holds it, keep trying in the background.

        Intake matters more than metrics: an overlapping version that was not
        given its own admin address still takes messages, and binds the
        address as soon as the other process lets it go, so the survivor of
        an overlap is monitored (``health``, metrics, the page) at the usual
        address.
        """
        listen = self.settings.admin.listen
        if not listen:
            return
        admin = AdminServer(listen, self._view(), self.metrics)
        try:
            admin.start()
        except AdminListenInUse as exc:
            log.error("admin_unavailable", error=str(exc),
                      hint="bound as soon as the other process frees it; give each overlapping "
                           "version its own HL7_AGENT_ADMIN__LISTEN")
            self._admin_pending = True

            def bound(ok: bool) -> None:
                self._admin_pending = False
                if ok:
                    self.admin = admin

            task = overlap.rebind_admin(admin, listen, bound)
            self.tasks.append(asyncio.create_task(self._supervise(task, "admin")))
            return
        except ConfigError as exc:
            raise StartupError(str(exc), key="admin.listen", error=str(exc)) from exc
        self.admin = admin

    async def _other_instance(self) -> str | None:
        """Why another agent process is known to run on this queue now, or None."""
        if self.handover is not None and self.handover.superseded:
            return "the listening sockets were handed to a newer process, and this one still runs"
        if self._admin_pending:
            return f"the admin address {self.settings.admin.listen} is still held by another process"
        if self.reader is not None and self.settings.queue.backend != "postgresql":
            # One SQLite file is one host's: an unexpired lease of another holder is a process here.
            # (On PostgreSQL other hosts holding it is the design: docs/ha.md.)
            lease = await self.reader.call(SqliteStore.lease)
            mine = self.dispatcher.me.holder if self.dispatcher is not None else None
            if lease is not None and lease.holder != mine and lease.expires_at > time.time():
                return f"the dispatch lease is held by {lease.holder}"
        return None

    async def _start_adoption(self, ctx: IntakeContext) -> None:
        """Take live connections from a predecessor, and give ours to a successor (docs/operations.md)."""
        path = self.settings.agent.data_dir / adoption.ADOPT_SOCKET

        async def adopt(channel: str, sock: socket.socket, remote: str, buffered: bytes,
                        owed: adoption.Owed) -> bool:
            for listener in self.listeners:
                if listener.channel.name == channel:
                    return await listener.adopt(sock, remote, buffered, owed)
            return False

        server = adoption.AdoptionServer(path, adopt)
        try:
            await server.start()
        except OSError as exc:
            log.warning("adoption_server_unavailable", error=str(exc))
            return
        self.adoption = server

        async def hand_over(channel: str, fd: int, remote: str, buffered: bytes, owed: adoption.Owed) -> bool:
            return await adoption.hand_over(path, server.identity, channel, remote, fd, buffered, owed=owed)

        ctx.hand_over = hand_over

    async def _supervise(self, coro: Any, name: str) -> None:
        """A crashed side task stops the service instead of dying silently (procrastinate)."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("task_crashed", task=name)
            self.exit_code = 1
            self.stop_requested.set()

    exit_code = 0

    def _status_line(self) -> str:
        up = "upstream connected" if self.dispatcher is not None and self.dispatcher.connected else (
            "no upstream configured" if not self.settings.server.url else "upstream not connected")
        held = ", lease held" if self.dispatcher is not None and self.dispatcher.lease_held else ""
        dialling = f", dialling out on {len(self.outbound)}" if self.outbound else ""
        return f"listening on {len(self.listeners)} channel(s){dialling}; {up}{held}"

    async def _watchdog(self) -> None:
        """WATCHDOG=1 at half of WatchdogSec= (sd_watchdog_enabled(3)), STATUS= when it changes.

        The ping comes from this event-loop task, so a wedged loop misses it
        and systemd restarts the service. STATUS= is refreshed on its own
        cadence, which never delays a ping.
        """
        loop = asyncio.get_running_loop()
        interval = self.notifier.watchdog_interval()  # already half of WATCHDOG_USEC
        status_period = 5.0
        next_ping = next_status = loop.time()
        last_status = ""
        while True:
            now = loop.time()
            if interval and now >= next_ping:
                self.notifier.watchdog()
                next_ping = now + interval
            if now >= next_status:
                status = self._status_line()
                if status != last_status:
                    self.notifier.status(status)
                    last_status = status
                next_status = now + status_period
            wake = min(next_ping, next_status) if interval else next_status
            await asyncio.sleep(max(0.0, wake - loop.time()))

    async def _maintenance(self) -> None:
        """Retention, room for intake and a WAL that gives its space back, in every process.

        Not lease-bound. Once a second it looks (read-only) at the disk: under
        backpressure it purges delivered rows for room, hands free pages back
        to the filesystem and truncates the WAL as soon as writes pause, so
        intake resumes by itself; otherwise the retention sweep, a PASSIVE
        checkpoint every ``checkpoint_interval`` and a TRUNCATE one when idle.
        Released pages leave the file only at a complete checkpoint, so a
        release is followed by a TRUNCATE at the next pause in writes, retried
        until it completes (SQLite's own checkpoint comes only after 1000 WAL
        frames, and a release writes a handful). Every write goes through the
        writer (one batch, bounded work) and the checkpoint gives up after
        0.1 s rather than hold intake up.
        """
        assert self.writer is not None
        assert self.reader is not None
        writer, reader = self.writer, self.reader
        q = self.settings.queue
        tick = min(1.0, q.checkpoint_interval, q.retention_interval)
        last_retention = float("-inf")  # the first sweep runs at once
        last_checkpoint = last_truncate = last_optimize = time.monotonic()
        wal = self.settings.db_path.with_name(self.settings.db_path.name + "-wal")
        was_refusing: str | None = None
        shrink_owed = False  # pages released that the file has not given back yet
        if not writer.store.dialect.file_maintenance:
            await self._retention_sweeps(writer)
            return
        try:
            if await reader.call(maintenance.auto_vacuum) == db.AUTO_VACUUM_NONE:
                log.info("queue_file_keeps_free_pages",
                         hint="created before auto_vacuum: purged pages are reused, the file never "
                              "shrinks; see docs/operations.md to convert it")
        except StorageError as exc:
            log.warning("maintenance_failed", error=str(exc))
        while True:
            await asyncio.sleep(tick)
            mono = time.monotonic()
            try:
                # The measurement asks room for a short message; a longer one
                # may still be refused while it passes: that counts too.
                refusing = await reader.call(maintenance.pressure) or (
                    "intake refuses messages for room" if mono - writer.store.space.refused_at < 3 * tick
                    else None)
                if bool(refusing) != bool(was_refusing):
                    if refusing:
                        log.warning("intake_backpressure", reason=refusing)
                    else:
                        log.info("intake_backpressure_over")
                was_refusing = refusing
                if refusing or mono - last_retention >= q.retention_interval:
                    last_retention = mono
                    purged = await writer.call(maintenance.reclaim, time.time())
                    if purged:
                        log.info("retention_purged", rows=purged)
                elif await reader.call(maintenance.headroom_short):
                    # Close to the floor: delivered rows go before intake has to refuse.
                    purged = await writer.call(maintenance.purge_for_headroom)
                    if purged:
                        log.info("retention_purged", rows=purged, reason="disk headroom")
                # Free pages beyond a small slack go back to the filesystem
                # (all of them while the disk is short); bounded per tick.
                tight = bool(refusing) or await reader.call(maintenance.disk_tight)
                keep = 0 if tight else FREE_PAGE_SLACK
                if await reader.call(maintenance.free_pages) > keep:
                    released = await writer.call(maintenance.release_free_pages, keep)
                    shrink_owed = shrink_owed or released > 0
                wal_bytes = wal.stat().st_size if wal.exists() else 0
                if wal_bytes == 0:
                    shrink_owed = False  # only a complete checkpoint empties the WAL
                else:
                    # Cut the WAL to nothing at the first pause in writes when
                    # space is short, pages were released, or it grew past its
                    # regular size (a big batch, a purge, a vacuum); else once
                    # per interval. After a release, one that did not complete
                    # (a reader or the other process's writer in the way) is
                    # tried again at the next pause, not an interval later.
                    idle = writer.idle_for() >= tick
                    if idle and (tight or shrink_owed or wal_bytes > db.WAL_SIZE_LIMIT
                                 or mono - last_truncate >= q.checkpoint_interval):
                        last_truncate = last_checkpoint = mono
                        busy, _, _ = await reader.call(maintenance.checkpoint, "TRUNCATE")
                        shrink_owed = shrink_owed and bool(busy)
                    elif mono - last_checkpoint >= q.checkpoint_interval:
                        # PASSIVE never waits on readers or the other process's writer.
                        last_checkpoint = mono
                        await reader.call(maintenance.checkpoint, "PASSIVE")
                if mono - last_optimize >= 3600:
                    # Long-lived connections refresh the planner's statistics, hourly.
                    last_optimize = mono
                    await reader.call(maintenance.optimize)
                    await writer.call(maintenance.optimize)
            except (OSError, StorageError) as exc:
                log.warning("maintenance_failed", error=str(exc))

    async def _retention_sweeps(self, writer: Writer) -> None:
        """The retention sweep alone, every ``retention_interval``: a database server keeps
        its own files and disk (PostgreSQL's autovacuum, its WAL), so the rest of
        :meth:`_maintenance` is not ours there. Every host runs it; sweeps never overlap
        (each is one write transaction)."""
        while True:
            try:
                purged = await writer.call(maintenance.reclaim, time.time())
                if purged:
                    log.info("retention_purged", rows=purged)
            except StorageError as exc:
                log.warning("maintenance_failed", error=str(exc))
            await asyncio.sleep(self.settings.queue.retention_interval)

    # -- stop ----------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("shutdown_requested", signal=sig.name, budget_s=self.settings.agent.shutdown_budget)
            self.stop_requested.set()
        else:
            log.warning("fast_shutdown_requested", signal=sig.name)
            self.force_stop.set()

    async def _within(self, aw: Awaitable[object], deadline: float) -> bool:
        """Await ``aw`` until the deadline or a forced stop; True when it finished."""
        done = await unless(aw, self.force_stop, timeout=max(0.0, deadline - time.monotonic()))
        if done is not None and not done.cancelled() and done.exception() is not None:
            log.error("shutdown_step_failed", error=str(done.exception()))
        return done is not None

    async def _connections_closed(self) -> None:
        await asyncio.gather(*(lst.wait_connections_closed() for lst in self._intakes()))

    async def shutdown(self) -> None:
        s = self.settings
        budget = s.agent.shutdown_budget
        deadline = time.monotonic() + budget
        self.notifier.stopping(status="stopping: finishing messages being read")
        if self.handover is not None:
            await self.handover.close()
        if self.adoption is not None:
            # Ours stops taking connections; a successor's path is left alone,
            # and our connections are handed to it below.
            await self.adoption.close()
        for listener in self._intakes():
            listener.stop_accepting()
        for listener in self._intakes():
            listener.close_connections()
        # Connections finish the frame they are reading and their ACKs. One
        # whose sender waits for the server's application ACKs goes to the
        # successor with them at once; where none takes it, they are awaited
        # here until shortly before two thirds of the budget (the last third
        # is for the dispatcher and the database), then each is answered AR
        # "resend later" before the connection closes — never silence.
        connections_by = deadline - budget / 3
        drained = await self._within(self._connections_closed(), connections_by - min(HELD_ACK_GRACE, budget / 4))
        if not drained:
            for listener in self._intakes():
                listener.release_held_acks()
            drained = await self._within(self._connections_closed(), connections_by)
        if not drained:
            log.warning("connections_aborted_at_budget", open=sum(len(lst.connections) for lst in self._intakes()))
        for listener in self._intakes():
            listener.release_held_acks()
            listener.abort_connections()
        # Aborted connections end at once; let their tasks finish before the
        # loop is torn down (else asyncio logs callbacks on a closed loop).
        await self._within(self._connections_closed(), time.monotonic() + 1.0)
        if self.dispatcher is not None:
            await self._within(self.dispatcher.stop(deadline=deadline - 1.0, force=self.force_stop),
                               deadline - 0.5)
        await cancel_and_wait(*self.tasks)
        if self.relay is not None:
            await self.relay.close()
        if self.admin is not None:
            self.admin.stop()
        await asyncio.get_running_loop().run_in_executor(None, self._close_database)
        log.info("agent_stopped", exit_code=self.exit_code)

    def _close_database(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.reader is not None:
            # Give the WAL's space back, but never queue behind a successor's writes.
            if self.reader.store.dialect.file_maintenance:
                with contextlib.suppress(Exception):
                    self.reader.call_blocking(maintenance.checkpoint, "TRUNCATE", wait=0.5)
            self.reader.close()


async def run_agent(settings: Settings) -> int:
    agent = Agent(settings)
    agent.install_signal_handlers()
    try:
        await agent.start()
    except BaseException as exc:
        agent.exit_code = 1
        if isinstance(exc, Exception):
            log_start_failure(exc)
        await agent.shutdown()
        raise
    await agent.stop_requested.wait()
    await agent.shutdown()
    return agent.exit_code

