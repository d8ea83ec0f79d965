"""The lease-holding dispatcher: lease tenure, link lifecycle, and the channel workers.

Three jobs, each kept recognisable here. The **lease tenure**: take the
lease, renew it, and end the tenure when one of its tasks ends it — the
lease is lost, its validity lapsed by our own clock, or the server refused
our epoch. The **link lifecycle**: only the lease holder is connected
upstream; the link is opened when the lease is taken and closed before it is
released, so the server sees one session of this agent at a time, also
during an upgrade overlap. The **workers**: one
:class:`~agent.runtime.channel_worker.ChannelWorker` per channel over the
one shared session; each asks ``agent.core.dispatch`` what to do with its
head and applies the answer with one fenced store call (the store raises
LeaseLost when the epoch fence fails, which ends the tenure).

The epoch fences database writes, not the wire: before every write to the
server the link asks :class:`~agent.core.lease.LeaseValidity` whether the
last successful renewal began recently enough; if not, nothing is written,
the tenure ends (session dropped) and the lease is checked again. ``hello``
carries the epoch and the queue's id, so a server that tracks epochs refuses
a stale holder too (close code 4001: the tenure ends likewise, and the next
one waits a backoff). Docs: docs/queue.md#the-dispatch-lease,
docs/protocol.md#epoch-fencing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from agent import __version__
from agent.core.dispatch import ChannelPolicy, RetryPolicy
from agent.core.lease import LeaseValidity, lease_clock
from agent.core.protocol import max_frame_bytes
from agent.core.retry import backoff
from agent.errors import LeaseLost, StorageError
from agent.runtime.aio import cancel_and_wait, wait_event
from agent.runtime.channel_worker import ChannelWorker, DispatchContext
from agent.runtime.partition_worker import PartitionWorker
from agent.runtime.relay import AckRelay
from agent.runtime.upstream import LinkSettings, UpstreamLink, safe_url
from agent.storage.store import LeaseHolder, SqliteStore
from agent.storage.writer import Reader, Writer

if TYPE_CHECKING:
    from agent.app.config import ChannelSettings, Settings
    from agent.runtime.metrics import AgentMetrics

__all__ = ["Dispatcher", "LeaseValidity", "lease_clock"]

log = structlog.get_logger(__name__)

#: How often an idle channel looks for new rows written by another process.
IDLE_POLL_SECONDS = 0.25
#: After the server refused our epoch (close code 4001): wait this long,
#: doubling up to the cap, before the lease is taken again with a new epoch.
EPOCH_REFUSED_INITIAL = 1.0
EPOCH_REFUSED_CAP = 60.0


@dataclass
class _Tenure:
    """One lease tenure: its epoch, its clock check, and whether that check has failed."""

    epoch: int
    validity: LeaseValidity
    lapsed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class _EpochRefused(Exception):
    """Internal: the server refused this tenure's epoch (close code 4001)."""


def channel_policy(channel: ChannelSettings, settings: Settings, *, paused: bool = False) -> ChannelPolicy:
    """The core's view of a channel's settings."""
    d = settings.dispatch
    return ChannelPolicy(
        name=channel.name,
        max_attempts=channel.max_attempts,
        on_reject=channel.on_reject,
        guaranteed_delivery=channel.guaranteed_delivery,
        assign_sequence_numbers=channel.assign_sequence_numbers,
        retry=RetryPolicy(initial=d.retry_initial, cap=d.retry_cap),
        paused=paused,
        max_in_flight=channel.max_in_flight,
        partitioned=channel.partition_key is not None,
    )


class Dispatcher:
    """Holds (or waits for) the lease and runs the channel workers."""

    def __init__(
        self,
        settings: Settings,
        writer: Writer,
        reader: Reader,
        relay: AckRelay | None,
        metrics: AgentMetrics | None = None,
        *,
        link_factory: Callable[[int, Callable[[], bool]], UpstreamLink] | None = None,
    ) -> None:
        self.settings = settings
        self.writer = writer
        self.reader = reader
        self.relay = relay
        self.metrics = metrics
        self.me = LeaseHolder.for_this_process(settings.agent.id)
        self.epoch: int | None = None
        #: The queue database's UUID, sent in hello (read when dispatch starts).
        self.queue_id: str | None = None
        self.lease_held = False
        self.stopping = asyncio.Event()
        self._wake: dict[str, asyncio.Event] = {c.name: asyncio.Event() for c in settings.channels}
        #: Per channel: its policy while running and while paused.
        self._policies = {c.name: (channel_policy(c, settings), channel_policy(c, settings, paused=True))
                          for c in settings.channels}
        self._ctx = DispatchContext(
            writer=writer, reader=reader, holder=self.me.holder, stopping=self.stopping,
            response_timeout=settings.server.response_timeout, metrics=metrics, relay=relay,
        )
        # Read once at start, as before: a broken token_file fails the start, not a takeover.
        self._token = settings.server.token_value()
        self._link_factory = link_factory or self._new_link
        self.link: UpstreamLink | None = None
        self._link_task: asyncio.Task[None] | None = None
        self._link_lock = asyncio.Lock()
        #: Set while no lease tenure runs (stop() waits for it before releasing).
        self._tenure_over = asyncio.Event()
        self._tenure_over.set()
        self._refused_delays = backoff(EPOCH_REFUSED_INITIAL, 2.0, EPOCH_REFUSED_CAP)
        #: Wall-clock time the upstream session last came up or went down (start: down).
        self._upstream_changed_at = time.time()
        self.log = log.bind(holder=self.me.holder)

    # -- status --------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.connected

    def upstream_state(self) -> dict[str, Any]:
        link = self.link
        session = link.current() if link is not None else None
        return {
            "configured": True,
            "connected": session is not None,
            "url": safe_url(self.settings.server.url) if self.settings.server.url else None,
            "replay": session.replay if session is not None else None,
            "last_error": link.last_error if link is not None else None,
        }

    def upstream_changed_at(self) -> float:
        """Since when (Unix seconds) the upstream has been as ``upstream_state()`` says: up or down.

        Before the first session it is the dispatcher's start. Safe from any thread (a float read).
        """
        return self._upstream_changed_at

    def wake(self, channel: str) -> None:
        """Intake in this process committed a row for ``channel``."""
        event = self._wake.get(channel)
        if event is not None:
            event.set()

    def _connected_changed(self, up: bool) -> None:
        self._upstream_changed_at = time.time()
        if self.metrics is not None:
            self.metrics.set_upstream_connected(up)
        if up:
            for event in self._wake.values():
                event.set()

    # -- the link --------------------------------------------------------------

    def _new_link(self, epoch: int, write_allowed: Callable[[], bool]) -> UpstreamLink:
        """One link per lease tenure (an UpstreamLink is not restartable after close)."""
        server = self.settings.server
        largest = max((c.max_message_bytes for c in self.settings.channels), default=1_048_576)
        return UpstreamLink(
            LinkSettings(
                url=server.url or "",
                token=self._token,
                token_source=server.token_value if server.token_file is not None else None,
                agent_id=self.settings.agent.id,
                version=__version__,
                connect_timeout=server.connect_timeout,
                ping_interval=server.ping_interval,
                ping_timeout=server.ping_interval,  # a pong slower than a ping period means a dead link
                max_frame_bytes=max_frame_bytes(largest),
                proxy=server.proxy,
                ca_file=str(server.ca_file) if server.ca_file else None,
                client_cert=str(server.client_cert) if server.client_cert else None,
                client_key=str(server.client_key) if server.client_key else None,
                epoch=epoch,
                queue_id=self.queue_id,
            ),
            on_connected_change=self._connected_changed,
            write_allowed=write_allowed,
        )

    def _open_link(self, tenure: _Tenure) -> UpstreamLink:
        link = self._link_factory(tenure.epoch, self._write_guard(tenure))
        self.link = link
        self._link_task = asyncio.create_task(link.run(), name="upstream-link")
        return link

    async def _close_link(self, within: float | None = None) -> None:
        """Close the upstream session (if any; dropped after ``within`` s) and wait until it is gone; idempotent."""
        async with self._link_lock:
            link, task = self.link, self._link_task
            self._link_task = None
            if link is not None:
                await link.close(within)
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self.link is link:
                self.link = None

    # -- the lease tenure ----------------------------------------------------------

    async def run(self) -> None:
        d = self.settings.dispatch
        try:
            while not self.stopping.is_set():
                started = lease_clock()
                try:
                    if self.queue_id is None:
                        self.queue_id = await self.reader.call(SqliteStore.queue_id)
                    # A read first: a standby takes the write lock only when the lease is takeable.
                    takeable = await self.reader.call(SqliteStore.lease_takeable, self.me)
                    epoch = (await self.writer.call(SqliteStore.try_acquire_lease, self.me, d.lease_ttl)
                             if takeable else None)
                except StorageError as exc:
                    # A locked or failing database must not stop the daemon:
                    # intake goes on answering; dispatch tries again.
                    self.log.warning("lease_acquire_failed", error=str(exc))
                    await self._ctx.sleep(d.lease_acquire_interval)
                    continue
                if epoch is None:
                    await self._ctx.sleep(d.lease_acquire_interval)
                    continue
                tenure = _Tenure(epoch, LeaseValidity(d.lease_ttl, lease_clock))
                tenure.validity.renewed(started)
                self.epoch = epoch
                self._set_lease_held(True)
                self._tenure_over.clear()
                self.log.info("lease_acquired", epoch=epoch)
                link = self._open_link(tenure)
                lost = refused = False
                try:
                    recovered = await self.writer.call(SqliteStore.recover_claimed, self.me.holder, epoch)
                    if recovered:
                        self.log.info("claimed_rows_requeued", rows=recovered)
                    await self._dispatch_under_lease(tenure, link)
                except* LeaseLost as group:
                    lost = True
                    self.log.warning("lease_lost", epoch=epoch, reason=str(group.exceptions[0]))
                except* _EpochRefused:
                    lost = refused = True
                except* StorageError as group:
                    # Keep the lease row as it is (we take it back at once,
                    # holder == us) and start a fresh tenure after a pause.
                    lost = True
                    self.log.warning("dispatch_tenure_failed", epoch=epoch,
                                     error="; ".join(str(e) for e in group.exceptions))
                    await self._ctx.sleep(d.lease_acquire_interval)
                finally:
                    # The session goes before the lease: a successor never
                    # overlaps with us on the server.
                    await self._close_link()
                    if not lost and self.stopping.is_set():
                        await self._release(epoch)
                    self._set_lease_held(False)
                    self._tenure_over.set()
                if refused:
                    # Another process of this agent dispatches under a newer
                    # epoch (or the server saw one this queue never had: a
                    # restored backup). Check the lease again, not at once.
                    delay = next(self._refused_delays)
                    self.log.warning("dispatch_paused_epoch_refused", epoch=epoch, retry_in_s=round(delay, 2))
                    await self._ctx.sleep(delay)
                else:
                    self._refused_delays = backoff(EPOCH_REFUSED_INITIAL, 2.0, EPOCH_REFUSED_CAP)
        finally:
            await self._close_link()
            self._tenure_over.set()

    async def _release(self, epoch: int) -> None:
        """Requeue our claimed rows and free the lease, so a peer takes over at once."""
        holder = self.me.holder
        with contextlib.suppress(Exception):
            await self.writer.call(SqliteStore.recover_claimed, holder, epoch)
        with contextlib.suppress(Exception):
            if await self.writer.call(SqliteStore.release_lease, holder, epoch):
                self.log.info("lease_released", epoch=epoch)

    def _set_lease_held(self, held: bool) -> None:
        self.lease_held = held
        if self.metrics is not None:
            self.metrics.set_lease_held(held)

    async def _dispatch_under_lease(self, tenure: _Tenure, link: UpstreamLink) -> None:
        epoch = tenure.epoch
        async with asyncio.TaskGroup() as group:
            group.create_task(self._heartbeat(tenure), name="lease-heartbeat")
            group.create_task(self._watch_tenure(tenure, link), name="lease-watch")
            for channel in self.settings.channels:
                worker = self._worker(channel, epoch, link)
                group.create_task(worker.run(), name=f"dispatch-{channel.name}")

    def _worker(self, channel: ChannelSettings, epoch: int, link: UpstreamLink) -> ChannelWorker:
        """The strict worker, or the partitioned one for a channel with ``partition_key``."""
        args = (self._ctx, self._policies[channel.name], epoch, link, self._wake[channel.name])
        key = channel.partition
        if key is not None:
            return PartitionWorker(*args, key=key, idle_poll=IDLE_POLL_SECONDS, log=self.log)
        return ChannelWorker(*args, idle_poll=IDLE_POLL_SECONDS, log=self.log)

    async def _heartbeat(self, tenure: _Tenure) -> None:
        d = self.settings.dispatch
        epoch = tenure.epoch
        while not self.stopping.is_set():
            await self._ctx.sleep(d.lease_heartbeat)
            if self.stopping.is_set():
                return
            started = tenure.validity.clock()
            try:
                await self.writer.call(SqliteStore.renew_lease, self.me.holder, epoch, d.lease_ttl)
                tenure.validity.renewed(started)
            except StorageError as exc:
                # Fencing keeps rows safe either way; stop before the lease
                # could have expired under us.
                self.log.warning("lease_renew_failed", error=str(exc))
                age = tenure.validity.age()
                if age is None or age > d.lease_ttl - d.lease_heartbeat:
                    raise LeaseLost("could not renew the lease before its expiry") from exc

    def _write_guard(self, tenure: _Tenure) -> Callable[[], bool]:
        """The check the link makes before every write to the server (see the module docstring)."""

        def allowed() -> bool:
            if tenure.validity.valid():
                return True
            if not tenure.lapsed.is_set():
                tenure.lapsed.set()
                age = tenure.validity.age()
                self.log.warning(
                    "lease_validity_lapsed",
                    epoch=tenure.epoch,
                    since_renewal_s=None if age is None else round(age, 3),
                    limit_s=round(tenure.validity.limit, 3),
                    hint="this process was stalled or could not renew its lease: it writes "
                    "nothing to the server and checks the lease again",
                )
            return False

        return allowed

    async def _watch_tenure(self, tenure: _Tenure, link: UpstreamLink) -> None:
        """End the tenure when its write guard failed or the server refused its epoch."""
        waiters = [asyncio.ensure_future(e.wait()) for e in (tenure.lapsed, link.refused, self.stopping)]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(*waiters)
        if self.stopping.is_set():
            return
        if link.refused.is_set():
            raise _EpochRefused
        raise LeaseLost(f"lease not proven valid: not renewed within {tenure.validity.limit:.1f} s")

    async def stop(self, deadline: float, force: asyncio.Event | None = None) -> None:
        """Stop claiming, let in-flight transmits settle until ``deadline``, release the lease."""
        self.stopping.set()
        for event in self._wake.values():
            event.set()
        budget_end = min(deadline, time.monotonic() + self.settings.server.response_timeout)
        # Several workers settle concurrently; a short poll of the shared set is
        # simpler than one event per row and bounded by budget_end.
        while self._ctx.sending and time.monotonic() < budget_end and not (force and force.is_set()):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if self._ctx.sending:
            self.log.warning("inflight_unanswered_at_stop", rows=len(self._ctx.sending))
        # Unanswered transmits now fail with SessionClosed and their workers
        # recover the rows (docs/queue.md#recovery); then run() releases the lease.
        await self._close_link(within=max(0.1, deadline - time.monotonic()))
        if not (force and force.is_set()):
            await wait_event(self._tenure_over, max(0.1, deadline - time.monotonic()))
        epoch = self.epoch
        if self.lease_held and epoch is not None:
            await self._release(epoch)
        self._set_lease_held(False)
