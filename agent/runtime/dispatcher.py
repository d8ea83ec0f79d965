"""The lease-holding dispatcher: per-channel FIFO over one WebSocket (SPEC 5 and 6).

One worker per channel takes the channel's head row — the lowest live seq —
and walks it queued → claimed → inflight → settled, one row at a time, so at
most one message per channel is ever in flight and order is strict. A row
waiting out its backoff stays the head and blocks its channel. Channels run
independently over the one shared session.

Only the lease holder dispatches; every write is fenced on the lease epoch
(the store raises LeaseLost when the fence fails), and ``inflight`` is
committed before the frame is written, so a crash can never hide a sent
frame as unsent. Only the lease holder is connected upstream, too: the link is
opened when the lease is taken and closed before it is released, so the
server sees one session of this agent at a time, also during an upgrade
overlap (SPEC 7: no gap, no duplicate, no reordering).

The epoch fences database writes, not the wire: a holder frozen (SIGSTOP, a
VM pause) between committing ``inflight`` and writing the frame could wake
after its successor took over and write a stale frame. So before every write
to the server the holder checks, by its own monotonic clock, that its last
successful renewal began less than 0.8 x ``lease_ttl`` ago
(:class:`LeaseValidity`); if not, nothing is written, the tenure ends (session
dropped) and the lease is checked again. ``hello`` carries the epoch and the
queue's id, so a server that tracks epochs refuses a stale holder too (close
code 4001: the tenure ends likewise, and the next one waits a backoff).

Recovery (after a crash, a response timeout or a lost connection): an
``inflight`` row is resent with the same id when the server announced
``replay``; otherwise it goes to ``failed`` for review, or back to ``queued``
on a ``guaranteed_delivery`` channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from agent import __version__
from agent.core import acks, envelope
from agent.core.protocol import (
    Transmit,
    TransmitResponse,
    classify_status,
    max_frame_bytes,
)
from agent.core.retry import attempts_exhausted, backoff, retry_delay
from agent.core.timefmt import rfc3339_utc
from agent.errors import HL7Error, LeaseLost, StorageError
from agent.runtime.aio import cancel_and_wait, unless, wait_event
from agent.runtime.relay import AckRelay
from agent.runtime.upstream import (
    LeaseExpired,
    LinkSettings,
    Session,
    SessionClosed,
    TransmitTooLarge,
    UpstreamLink,
)
from agent.storage.store import HeadRow, LeaseHolder, SqliteStore
from agent.storage.writer import Reader, Writer

if TYPE_CHECKING:
    from agent.app.config import ChannelSettings, Settings
    from agent.runtime.metrics import AgentMetrics

log = structlog.get_logger(__name__)
T = TypeVar("T")

#: How often an idle channel looks for new rows written by another process.
IDLE_POLL_SECONDS = 0.25
#: A holder writes to the server only while its last successful renewal
#: began less than this share of lease_ttl ago. A successor can take over
#: only after the full TTL has passed on the wall clock; the rest is margin
#: for a wall-clock step and for the write itself.
LEASE_WRITE_FRACTION = 0.8
#: After the server refused our epoch (close code 4001): wait this long,
#: doubling up to the cap, before the lease is taken again with a new epoch.
EPOCH_REFUSED_INITIAL = 1.0
EPOCH_REFUSED_CAP = 60.0


def lease_clock() -> float:
    """Seconds on CLOCK_BOOTTIME where there is one, else the monotonic clock.

    Both never go back and ignore wall-clock steps; BOOTTIME also counts the
    time the host was suspended, which is time a successor may have used.
    """
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is not None:
        return time.clock_gettime(boottime)
    return time.monotonic()


class LeaseValidity:
    """Whether this process may still write to the server under its lease, by its own clock.

    Pure: ``renewed(started_at)`` after each successful take or renewal, with
    the clock read *before* that transaction began (so the age is never
    under-counted); ``valid()`` before each write.
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = lease_clock) -> None:
        self.limit = ttl * LEASE_WRITE_FRACTION
        self.clock = clock
        self._since: float | None = None

    def renewed(self, started_at: float) -> None:
        if self._since is None or started_at > self._since:
            self._since = started_at

    def age(self) -> float | None:
        """Seconds since the last successful renewal began; None before the first."""
        return None if self._since is None else self.clock() - self._since

    def valid(self) -> bool:
        age = self.age()
        return age is not None and age < self.limit


@dataclass
class _Tenure:
    """One lease tenure: its epoch, its clock check, and whether that check has failed."""

    epoch: int
    validity: LeaseValidity
    lapsed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@dataclass
class _InFlight:
    message_id: str
    size: int
    session: Session


class _Stopping(Exception):
    """Internal: the dispatcher was asked to stop while a worker waited."""


class _EpochRefused(Exception):
    """Internal: the server refused this tenure's epoch (close code 4001)."""


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
        self._inflight: dict[str, _InFlight] = {}
        # Keyed by the session object itself: an id() could be reused by a later session.
        self._too_big_victims: weakref.WeakKeyDictionary[Session, str | None] = weakref.WeakKeyDictionary()
        self._sending: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
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
        self.log = log.bind(holder=self.me.holder)

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

    async def _close_link(self) -> None:
        """Close the upstream session (if any) and wait until it is gone; idempotent."""
        async with self._link_lock:
            link, task = self.link, self._link_task
            self._link_task = None
            if link is not None:
                await link.close()
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self.link is link:
                self.link = None

    # -- status --------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.connected

    def _connected_changed(self, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.set_upstream_connected(up)
        if up:
            for event in self._wake.values():
                event.set()

    def upstream_state(self) -> dict[str, Any]:
        link = self.link
        session = link.current() if link is not None else None
        return {
            "configured": True,
            "connected": session is not None,
            "url": self.settings.server.url,
            "replay": session.replay if session is not None else None,
            "last_error": link.last_error if link is not None else None,
        }

    def wake(self, channel: str) -> None:
        """Intake in this process committed a row for ``channel``."""
        event = self._wake.get(channel)
        if event is not None:
            event.set()

    # -- lease loop ----------------------------------------------------------

    async def run(self) -> None:
        d = self.settings.dispatch
        try:
            while not self.stopping.is_set():
                started = lease_clock()
                try:
                    if self.queue_id is None:
                        self.queue_id = await self.reader.run(lambda s: s.queue_id())
                    # A read first: a standby takes the write lock only when the lease is takeable.
                    takeable = await self.reader.call(SqliteStore.lease_takeable, self.me)
                    epoch = (await self._store(lambda s: s.try_acquire_lease(self.me, d.lease_ttl))
                             if takeable else None)
                except StorageError as exc:
                    # A locked or failing database must not stop the daemon:
                    # intake goes on answering; dispatch tries again.
                    self.log.warning("lease_acquire_failed", error=str(exc))
                    await self._sleep(d.lease_acquire_interval)
                    continue
                if epoch is None:
                    await self._sleep(d.lease_acquire_interval)
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
                    recovered = await self._store(lambda s: s.recover_claimed(self.me.holder, epoch))  # noqa: B023 - run before the loop moves on
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
                    await self._sleep(d.lease_acquire_interval)
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
                    await self._sleep(delay)
                else:
                    self._refused_delays = backoff(EPOCH_REFUSED_INITIAL, 2.0, EPOCH_REFUSED_CAP)
        finally:
            await self._close_link()
            self._tenure_over.set()

    async def _release(self, epoch: int) -> None:
        """Requeue our claimed rows and free the lease, so a peer takes over at once."""
        with contextlib.suppress(Exception):
            await self._store(lambda s: s.recover_claimed(self.me.holder, epoch))
        with contextlib.suppress(Exception):
            released = await self._store(lambda s: s.release_lease(self.me.holder, epoch))
            if released:
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
                group.create_task(self._channel_worker(channel, epoch, link), name=f"dispatch-{channel.name}")

    async def _heartbeat(self, tenure: _Tenure) -> None:
        d = self.settings.dispatch
        epoch = tenure.epoch
        while not self.stopping.is_set():
            await self._sleep(d.lease_heartbeat)
            if self.stopping.is_set():
                return
            started = tenure.validity.clock()
            try:
                await self._store(lambda s: s.renew_lease(self.me.holder, epoch, d.lease_ttl))
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
        while self._sending and time.monotonic() < budget_end and not (force and force.is_set()):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if self._sending:
            self.log.warning("inflight_unanswered_at_stop", rows=len(self._sending))
        # Unanswered transmits now fail with SessionClosed and get SPEC 6's
        # recovery from their workers; then run() releases the lease.
        await self._close_link()
        if not (force and force.is_set()):
            await wait_event(self._tenure_over, max(0.1, deadline - time.monotonic()))
        epoch = self.epoch
        if self.lease_held and epoch is not None:
            await self._release(epoch)
        self._set_lease_held(False)

    # -- helpers -------------------------------------------------------------

    async def _store(self, fn: Callable[[SqliteStore], T]) -> T:
        return await self.writer.run(fn)

    async def _sleep(self, seconds: float) -> None:
        # Not asyncio.wait_for (see agent.runtime.aio): a worker or the heartbeat
        # cancelled by its TaskGroup must never lose that cancellation here.
        await wait_event(self.stopping, max(0.0, seconds))

    async def _until_stopping(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless stop() comes first (then raise _Stopping)."""
        done = await unless(aw, self.stopping)
        if done is None:
            raise _Stopping
        return done.result()

    async def _idle(self, channel: str, seconds: float) -> None:
        """Wait for new rows (in-process wake-up, else poll: another process may take intake)."""
        event = self._wake[channel]
        # Not asyncio.wait_for: on Python 3.11 a wake-up in the same loop turn
        # as the TaskGroup's cancellation (the tenure ending) returned normally
        # and the worker kept the tenure alive while the queue stayed idle.
        await wait_event(event, seconds)
        event.clear()

    # -- the channel worker --------------------------------------------------

    async def _channel_worker(self, channel: ChannelSettings, epoch: int, link: UpstreamLink) -> None:
        wlog = self.log.bind(channel=channel.name)
        name = channel.name
        while not self.stopping.is_set():
            try:
                head, paused = await self.reader.run(
                    lambda s: (s.channel_head(name), name in s.paused_channels())
                )
            except StorageError as exc:
                wlog.warning("dispatch_read_failed", error=str(exc))
                await self._sleep(1.0)
                continue
            if head is None:
                await self._idle(name, IDLE_POLL_SECONDS)
                continue
            if paused and head.state == "queued":
                await self._idle(name, 1.0)
                continue
            now = time.time()
            if head.state == "queued" and head.next_attempt_at > now:
                await self._idle(name, min(head.next_attempt_at - now, 1.0))
                continue
            if link.current() is None:
                # Claim only with a session up: during an outage the head stays
                # `queued` (what an operator expects to see), not `claimed`.
                try:
                    await self._until_stopping(link.session())
                except (_Stopping, SessionClosed):
                    return
                continue  # the head may have changed while we waited
            if head.state == "queued":
                try:
                    claimed = await self._store(lambda s: s.claim(self.me.holder, epoch, head.id))  # noqa: B023 - awaited in this iteration
                except StorageError as exc:
                    if isinstance(exc, LeaseLost):
                        raise
                    wlog.warning("dispatch_claim_failed", error=str(exc))
                    await self._sleep(1.0)
                    continue
                if not claimed:
                    continue
            try:
                session = await self._until_stopping(link.session())
            except (_Stopping, SessionClosed):
                # Stopping, or this tenure's link was closed (stop() closes it
                # before the lease goes): the claimed head is requeued on release.
                return
            if self.stopping.is_set():
                return
            try:
                await self._dispatch_head(channel, epoch, head, session, wlog)
            except StorageError as exc:
                if isinstance(exc, LeaseLost):
                    raise
                # A busy or failing disk must not kill dispatch: rows are safe
                # where they stand; look at the head again shortly.
                wlog.warning("dispatch_storage_error", error=str(exc))
                await self._sleep(1.0)

    def _transmit_for(self, channel: ChannelSettings, head: HeadRow, attempt: int) -> Transmit:
        text = envelope.decode_message(head.body, head.encoding)
        if channel.assign_sequence_numbers:
            # SPEC 5: MSH-13 of the forwarded text is seq; the stored bytes stay as received.
            text = envelope.set_msh_field(text, 13, str(head.seq))
        return Transmit(
            id=head.id,
            channel=head.channel,
            control_id=head.control_id,
            message_type=head.message_type,
            seq=head.seq,
            attempt=attempt,
            received_at=rfc3339_utc(datetime.fromtimestamp(head.received_at, UTC)),
            remote=head.remote,
            body=text,
            encoding=head.encoding,
        )

    async def _dispatch_head(
        self, channel: ChannelSettings, epoch: int, head: HeadRow, session: Session, wlog: Any
    ) -> None:
        holder = self.me.holder
        mlog = wlog.bind(id=head.id, control_id=head.control_id, seq=head.seq)
        if head.state == "inflight" and not session.replay:
            # An inflight row we cannot prove unsent and the server cannot dedupe.
            await self._ambiguous(channel, epoch, head, head.attempts, "server does not replay", mlog)
            return
        try:
            probe = self._transmit_for(channel, head, head.attempts + 1)
        except (HL7Error, ValueError, LookupError) as exc:
            await self._give_up(channel, epoch, head, head.attempts, "rejected", "102",
                                f"stored message cannot be decoded as {head.encoding}: {exc}", mlog)
            return
        self._sending.add(head.id)
        try:
            attempt = await self._store(
                lambda s: s.mark_inflight(holder, epoch, head.id, head.state, head.attempts)
            )
        except BaseException:
            self._sending.discard(head.id)
            raise
        transmit = dataclasses.replace(probe, attempt=attempt)
        if session.closed:
            # The session ended while inflight was being committed: the frame
            # was provably never written, so this is no ambiguous row (SPEC 6
            # fails those only on a non-replaying server). Back to the head.
            self._sending.discard(head.id)
            if await self._store(
                lambda s: s.requeue(holder, epoch, head.id, attempt, 0.0, error_code="not_sent",
                                    error_text="session closed before the frame was written")
            ):
                mlog.info("transmit_not_sent_session_closed", attempt=attempt)
            return
        self._inflight[head.id] = _InFlight(head.id, len(transmit.body.encode()), session)
        started = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: transmit() must start in this very
            # step, so the closed check above still holds when it checks again
            # and writes (wait_for would schedule it as a task, a loop turn later).
            async with asyncio.timeout(self.settings.server.response_timeout):
                response = await session.transmit(transmit)
        except TimeoutError:
            mlog.warning("transmit_response_timeout", attempt=attempt)
            await self._recover_after_loss(channel, epoch, head, attempt, session, "response timeout", mlog)
            return
        except TransmitTooLarge as exc:
            await self._give_up(channel, epoch, head, attempt, "rejected", "207", str(exc), mlog)
            return
        except LeaseExpired as exc:
            # Provably not written. Shielded: the tenure is being torn down
            # around this worker, and the put-back must not be cancelled.
            put_back = asyncio.create_task(self._put_back_unsent(epoch, head, attempt, mlog))
            self._background.add(put_back)
            put_back.add_done_callback(self._background.discard)
            await asyncio.shield(put_back)
            raise LeaseLost(str(exc)) from exc
        except SessionClosed as exc:
            if exc.too_big and self._too_big_victim(session) == head.id:
                await self._give_up(channel, epoch, head, attempt, "rejected", "207",
                                    "server closed with 1009: message too big", mlog)
                return
            mlog.info("transmit_interrupted", attempt=attempt, code=exc.code)
            await self._recover_after_loss(channel, epoch, head, attempt, session, "connection lost", mlog)
            return
        finally:
            self._sending.discard(head.id)
            self._inflight.pop(head.id, None)
        if self.metrics is not None:
            self.metrics.observe_dispatch_latency(channel.name, time.monotonic() - started)
        await self._settle_response(channel, epoch, head, attempt, response, mlog)

    async def _put_back_unsent(self, epoch: int, head: HeadRow, attempt: int, mlog: Any) -> None:
        """Back to the head if the lease still stands (the write is fenced).

        If the lease moved, the row stays ``inflight`` for the successor's
        recovery: it cannot know the frame was never written.
        """
        try:
            if await self._store(
                lambda s: s.requeue(self.me.holder, epoch, head.id, attempt, 0.0, error_code="not_sent",
                                    error_text="lease not proven valid before the write")
            ):
                mlog.info("transmit_not_sent_lease_unproven", attempt=attempt)
        except LeaseLost:
            mlog.info("transmit_not_sent_lease_moved", attempt=attempt)
        except StorageError as exc:
            mlog.warning("transmit_not_sent_requeue_failed", attempt=attempt, error=str(exc))

    def _too_big_victim(self, session: Session) -> str | None:
        """SPEC 5: a 1009 close rejects the largest transmit in flight on that session."""
        if session not in self._too_big_victims:
            candidates = [f for f in self._inflight.values() if f.session is session]
            victim = max(candidates, key=lambda f: f.size).message_id if candidates else None
            self._too_big_victims[session] = victim
        return self._too_big_victims[session]

    async def _recover_after_loss(
        self, channel: ChannelSettings, epoch: int, head: HeadRow, attempt: int,
        session: Session, why: str, mlog: Any,
    ) -> None:
        """SPEC 6 recovery for a row whose answer will not come for this attempt.

        With a replaying server the row simply stays ``inflight``: the worker
        finds it at the head again and resends it with the same id (on this
        session after a timeout, on the next one after a lost connection).
        """
        if not session.replay:
            await self._ambiguous(channel, epoch, head, attempt, f"{why}; server does not replay", mlog)

    async def _ambiguous(
        self, channel: ChannelSettings, epoch: int, head: HeadRow, attempt: int, why: str, mlog: Any
    ) -> None:
        if channel.guaranteed_delivery:
            ok = await self._store(
                lambda s: s.requeue(self.me.holder, epoch, head.id, attempt, 0.0,
                                    error_code="ambiguous", error_text=f"requeued (guaranteed delivery): {why}")
            )
            if ok:
                mlog.warning("inflight_requeued_guaranteed", reason=why)
            return
        await self._give_up(channel, epoch, head, attempt, "failed", "ambiguous",
                            f"delivery unknown: {why}", mlog)

    async def _give_up(
        self, channel: ChannelSettings, epoch: int, head: HeadRow, attempt: int, state: str,
        code: str, text: str, mlog: Any,
    ) -> None:
        app_ack = self._app_ack_for(head, 500, None) if head.ack_mode != "commit" else None

        def apply(s: SqliteStore) -> bool:
            done = s.fail_live(self.me.holder, epoch, head.id, attempt, state,
                               error_code=code, error_text=text, app_ack=app_ack)
            if done and channel.on_reject == "pause":
                s.pause_channel(channel.name, f"{state} row {head.id}: {text}")
            return done

        if await self._store(apply):
            mlog.warning("message_" + state, error_code=code, reason=text)
            self._settled(channel, head, state, app_ack)

    def _settled(self, channel: ChannelSettings, head: HeadRow, state: str, app_ack: bytes | None) -> None:
        if self.metrics is not None:
            self.metrics.message_settled(channel.name, state)
        if app_ack is not None and self.relay is not None:
            self.relay.settled(head.id, app_ack)

    def _app_ack_for(self, head: HeadRow, status: int, ack_text: str | None) -> bytes | None:
        """The application ACK the source is owed, in its own character set; never raises.

        Whatever a stored row holds (an older version stored any codec Python
        knows, ``idna`` included), the row must still settle: an exception here
        would end the dispatcher and leave the row inflight, resent and failing
        at every restart. A row whose ACK cannot be built settles without one.
        """
        try:
            if ack_text:
                return acks.relayed_ack(ack_text, head.encoding)
            try:
                inbound = envelope.read_msh(head.body)
            except HL7Error:
                return None
            return acks.app_ack_from_status(inbound, status, head.encoding)
        except Exception as exc:  # noqa: BLE001 - one row's ACK must never stop dispatch
            self.log.error("application_ack_unbuildable", id=head.id, channel=head.channel,
                           error_type=type(exc).__name__)
            return None

    async def _settle_response(
        self, channel: ChannelSettings, epoch: int, head: HeadRow, attempt: int,
        response: TransmitResponse, mlog: Any,
    ) -> None:
        holder = self.me.holder
        kind = classify_status(response.status)
        if kind == "transient":
            used = attempt - head.redrive_base
            if attempts_exhausted(used, channel.max_attempts):
                await self._give_up(channel, epoch, head, attempt, "failed", str(response.status),
                                    f"max_attempts {channel.max_attempts} reached; last status "
                                    f"{response.status}", mlog)
                return
            d = self.settings.dispatch
            delay = retry_delay(used, initial=d.retry_initial, cap=d.retry_cap)
            await self._store(
                lambda s: s.requeue(holder, epoch, head.id, attempt, time.time() + delay,
                                    server_status=response.status, error_code=str(response.status),
                                    error_text=f"transient status {response.status}; retry in {delay:.1f}s")
            )
            mlog.info("transmit_retry_scheduled", status=response.status, attempt=attempt, delay_s=round(delay, 2))
            return
        state = "processed" if kind == "processed" else "rejected"
        app_ack = self._app_ack_for(head, response.status, response.ack) if head.ack_mode != "commit" else None

        def apply(s: SqliteStore) -> bool:
            done = s.settle(
                holder, epoch, head.id, attempt, state,
                server_status=response.status, server_ack=response.ack, app_ack=app_ack,
                error_code=None if state == "processed" else str(response.status),
                error_text=None if state == "processed" else f"rejected by server (status {response.status})",
            )
            if done and state == "rejected" and channel.on_reject == "pause":
                s.pause_channel(channel.name, f"rejected row {head.id} (status {response.status})")
            return done

        if await self._store(apply):
            (mlog.info if state == "processed" else mlog.warning)(
                "message_" + state, status=response.status, attempt=attempt
            )
            self._settled(channel, head, state, app_ack)
        else:
            mlog.info("stale_settle_ignored", attempt=attempt)
