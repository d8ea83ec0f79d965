"""One channel's worker under one lease tenure: read the head, ask ``agent.core.dispatch``, apply.

The worker decides nothing itself. It reads its channel's head, asks
``decide_head``, and applies the answer — wait, wait for a session, claim,
send, or give up — then, after a send, applies what ``on_response`` or
``on_loss`` says. Each action is exactly one store call in one commit on
the writer thread (the functions below: one transition each, with the pause
flag of ``on_reject = "pause"`` in the same commit), fenced on the tenure's
epoch (the store raises LeaseLost when the fence fails; it ends the tenure).

Strict FIFO: one row of the channel in flight, the next is not sent before
it settled (docs/protocol.md#ordering-per-channel). To spare fsyncs, the
claim and the inflight mark share one commit, and a settle carries the next
head's claim and inflight mark in its own commit when the core would send
that head at once: one commit per message while a backlog drains. A
partitioned channel runs agent.runtime.partition_worker.PartitionWorker
instead, which reuses the send and apply steps below for several rows of
different keys.

One module of about 450 lines: the store calls, the shared context and the
worker loop are one unit — each store call exists for exactly one step of
the loop, and apart they would be read side by side anyway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from agent.core.dispatch import (
    AwaitSession,
    ChannelPolicy,
    Claim,
    GiveUp,
    KeepInflight,
    Loss,
    Pause,
    Requeue,
    Send,
    SessionFacts,
    Settle,
    Wait,
    decide_head,
    on_loss,
    on_response,
    on_unsendable,
    with_attempt,
)
from agent.core.protocol import Transmit
from agent.core.states import State
from agent.errors import LeaseLost, StorageError
from agent.runtime.aio import unless, wait_event
from agent.runtime.relay import AckRelay
from agent.runtime.upstream import (
    LeaseExpired,
    Session,
    SessionClosed,
    TransmitTooLarge,
    UpstreamLink,
)
from agent.storage.store import HeadRow, SqliteStore
from agent.storage.writer import Reader, Writer

if TYPE_CHECKING:
    from agent.runtime.metrics import AgentMetrics

__all__ = ["ChannelWorker", "DispatchContext", "Stopping"]

T = TypeVar("T")

#: A server whose answers take about this long or less (a moving average) gets
#: its settles announced to the writer (Writer.expect), which then holds a
#: commit a moment for them: one commit carries every channel's settle.
QUICK_ANSWER_SECONDS = 0.005


# -- the store calls, one per action ---------------------------------------------


def _settle(store: SqliteStore, holder: str, epoch: int, a: Settle) -> bool:
    """Event.SETTLE for this attempt; with ``a.pause``, the channel's pause flag in the same commit."""
    done = store.settle(
        holder, epoch, a.id, a.attempt, a.state,
        server_status=a.response.status, server_ack=a.response.ack, app_ack=a.app_ack,
        error_code=a.error_code, error_text=a.error_text, server_reason=a.server_reason,
    )
    if done and a.pause is not None:
        _pause(store, a.pause)
    return done


def _pause(store: SqliteStore, pause: Pause) -> None:
    """``on_reject = "pause"``: the channel, or on a partitioned channel the row's key only."""
    if pause.partition is not None:
        store.pause_partition(pause.channel, pause.partition, pause.reason)
    else:
        store.pause_channel(pause.channel, pause.reason)


@dataclass(frozen=True, slots=True)
class _Next:
    """The channel's next head, claimed and marked inflight in its predecessor's settle commit."""

    head: HeadRow
    send: Send
    policy: ChannelPolicy
    attempt: int


def _settle_and_next(
    store: SqliteStore, holder: str, epoch: int, a: Settle,
    policies: tuple[ChannelPolicy, ChannelPolicy], facts: SessionFacts, now: float,
) -> tuple[bool, _Next | None]:
    """Event.SETTLE of this row and, when the core would send the next head at once, its CLAIM and SEND.

    One commit where there were three (settle, claim, inflight). The core
    decides, as the worker loop would on reading the head after the settle;
    a failure of any part fails the whole commit, as a failed settle does.
    """
    if not _settle(store, holder, epoch, a):
        return False, None
    running, paused = policies
    head, is_paused = store.channel_head_and_pause(running.name)
    policy = paused if is_paused else running
    if head is None or not isinstance(decide_head(head, policy, facts, now), Claim):
        return True, None
    claimed = dataclasses.replace(head, state=State.CLAIMED)
    send = decide_head(claimed, policy, facts, now)
    if not isinstance(send, Send):
        return True, None
    attempt = store.claim_and_send(holder, epoch, send.id, send.attempts)
    return True, None if attempt is None else _Next(claimed, send, policy, attempt)


def _give_up(store: SqliteStore, holder: str, epoch: int, a: GiveUp) -> bool:
    """Event.GIVE_UP; with ``a.pause``, the channel's pause flag in the same commit."""
    done = store.fail_live(holder, epoch, a.id, a.attempt, a.state,
                           error_code=a.error_code, error_text=a.error_text, app_ack=a.app_ack,
                           server_reason=a.server_reason)
    if done and a.pause is not None:
        _pause(store, a.pause)
    return done


# -- what every worker shares ------------------------------------------------------


class Stopping(Exception):
    """Internal: the dispatcher was asked to stop while a worker waited."""


@dataclass
class DispatchContext:
    """What the dispatcher lends its workers: the store threads, the stop signal, the sinks."""

    writer: Writer
    reader: Reader
    holder: str
    stopping: asyncio.Event
    response_timeout: float
    metrics: AgentMetrics | None
    relay: AckRelay | None
    #: Rows between their inflight commit and their settle (stop() waits for them).
    sending: set[str] = field(default_factory=set)
    #: Put-backs that must outlive a torn-down tenure (shielded).
    background: set[asyncio.Task[None]] = field(default_factory=set)
    #: Moving average of the server's answer time, seconds (starts slow: no hold until measured).
    answer_seconds: float = 1.0

    def answered_in(self, seconds: float) -> None:
        """One answer's time (or a timeout's) into the moving average."""
        self.answer_seconds += 0.1 * (seconds - self.answer_seconds)

    async def sleep(self, seconds: float) -> None:
        """Sleep unless stopping; never asyncio.wait_for (see agent.runtime.aio).

        A worker or the heartbeat cancelled by its TaskGroup must never lose
        that cancellation here.
        """
        await wait_event(self.stopping, max(0.0, seconds))

    async def until_stopping(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless stop() comes first (then raise Stopping)."""
        done = await unless(aw, self.stopping)
        if done is None:
            raise Stopping
        return done.result()


def session_facts(link: UpstreamLink) -> SessionFacts:
    session = link.current()
    return SessionFacts(up=True, replay=session.replay) if session is not None else SessionFacts(up=False)


class ChannelWorker:
    """Dispatches one channel under one tenure's epoch, over that tenure's link."""

    #: A settle also claims and marks inflight the channel's next head (strict FIFO only).
    chains_next_head = True

    def __init__(
        self,
        ctx: DispatchContext,
        policies: tuple[ChannelPolicy, ChannelPolicy],
        epoch: int,
        link: UpstreamLink,
        wake: asyncio.Event,
        *,
        idle_poll: float,
        log: Any,
    ) -> None:
        self.ctx = ctx
        self.running, self.paused = policies
        self.name = self.running.name
        self.epoch = epoch
        self.link = link
        self.wake = wake
        self.idle_poll = idle_poll
        self.log = log.bind(channel=self.name)

    async def _idle(self, seconds: float) -> None:
        """Wait for new rows (in-process wake-up, else poll: another process may take intake)."""
        # Not asyncio.wait_for: on Python 3.11 a wake-up in the same loop turn
        # as the TaskGroup's cancellation (the tenure ending) returned normally
        # and the worker kept the tenure alive while the queue stayed idle.
        await wait_event(self.wake, max(0.0, seconds))
        self.wake.clear()

    async def run(self) -> None:
        ctx, link = self.ctx, self.link
        while not ctx.stopping.is_set():
            try:
                head, paused = await ctx.reader.call(SqliteStore.channel_head_and_pause, self.name)
            except StorageError as exc:
                self.log.warning("dispatch_read_failed", error=str(exc))
                await ctx.sleep(1.0)
                continue
            policy = self.paused if paused else self.running
            decision = decide_head(head, policy, session_facts(link), time.time())
            claim_too = False
            if isinstance(decision, Claim) and head is not None:
                # What the core does with the head once claimed: a Send (the
                # session is up) commits the claim and the inflight mark
                # together; anything else claims alone and looks again.
                head = dataclasses.replace(head, state=State.CLAIMED)
                then = decide_head(head, policy, session_facts(link), time.time())
                if isinstance(then, Send):
                    decision, claim_too = then, True
                else:
                    try:
                        claimed = await ctx.writer.call(SqliteStore.claim, ctx.holder, self.epoch, decision.id)
                    except StorageError as exc:
                        self.log.warning("dispatch_claim_failed", error=str(exc))
                        await ctx.sleep(1.0)
                        continue
                    if not claimed:
                        continue
                    decision = then
            if isinstance(decision, Wait):
                until = decision.until
                await self._idle(self.idle_poll if until is None else until - time.time())
                continue
            if isinstance(decision, AwaitSession):
                # Claim only with a session up: during an outage the head stays
                # `queued` (what an operator expects to see), not `claimed`.
                try:
                    await ctx.until_stopping(link.session())
                except (Stopping, SessionClosed):
                    # Stopping, or this tenure's link was closed (stop() closes it
                    # before the lease goes): a claimed head is requeued on release.
                    return
                continue  # the head may have changed while we waited
            session = link.current()
            if ctx.stopping.is_set() or head is None or session is None:
                continue
            mlog = self.log.bind(id=head.id, control_id=head.control_id, seq=head.seq)
            try:
                if isinstance(decision, Send):
                    await self._send(decision, head, policy, session, mlog, claim=claim_too)
                elif isinstance(decision, (GiveUp, Requeue)):
                    # A head that cannot be sent: undecodable, or ambiguous
                    # (given up, or requeued on guaranteed delivery).
                    await self._apply(decision, mlog)
            except StorageError as exc:
                # A busy or failing disk must not kill dispatch: rows are safe
                # where they stand; look at the head again shortly.
                self.log.warning("dispatch_storage_error", error=str(exc))
                await ctx.sleep(1.0)

    async def _send(self, send: Send, head: HeadRow, policy: ChannelPolicy, session: Session, mlog: Any,
                    *, claim: bool = False) -> None:
        """Commit inflight (``claim``: with the claim), write the frame, apply what the answer means."""
        ctx = self.ctx
        ctx.sending.add(head.id)
        try:
            if claim:
                attempt = await ctx.writer.call(SqliteStore.claim_and_send, ctx.holder, self.epoch, send.id,
                                                send.attempts)
                if attempt is None:
                    return  # the row changed since it was read (an operator): look again
            else:
                attempt = await ctx.writer.call(
                    SqliteStore.mark_inflight, ctx.holder, self.epoch, send.id, send.from_state, send.attempts
                )
            while True:
                action: Settle | Requeue | GiveUp | KeepInflight
                if session.closed:
                    # The session ended while inflight was being committed: the
                    # frame was provably never written, so this is no ambiguous row.
                    action = on_loss(head, attempt, Loss.NOT_WRITTEN, policy, replay=session.replay)
                else:
                    action = await self._exchange(with_attempt(send, attempt), head, policy, session, mlog)
                # Only the strict worker chains the channel's next head into a settle:
                # a partitioned channel's next row is chosen per key (PartitionWorker).
                follow = (None if not self.chains_next_head or ctx.stopping.is_set() or session.closed
                          else session)
                nxt = await self._apply(action, mlog, follow=follow)
                if nxt is None:
                    return
                # The next head's inflight mark was committed with this settle:
                # it is in flight before this row leaves ``sending``.
                ctx.sending.add(nxt.head.id)
                ctx.sending.discard(head.id)
                head, send, policy, attempt = nxt.head, nxt.send, nxt.policy, nxt.attempt
                mlog = self.log.bind(id=head.id, control_id=head.control_id, seq=head.seq)
        finally:
            ctx.sending.discard(head.id)

    async def _exchange(
        self, transmit: Transmit, head: HeadRow, policy: ChannelPolicy, session: Session, mlog: Any,
    ) -> Settle | Requeue | GiveUp | KeepInflight:
        """Write one transmit and wait for its answer: what the core says to do about it."""
        attempt = transmit.attempt
        ctx = self.ctx
        started = time.monotonic()
        # A quick server's answer is moments away: the writer may hold the
        # commit under way for the settle (submitted with no await after this).
        # Only where the channel's next message waits for this settle: a
        # partitioned channel's other keys go on meanwhile, and with many rows
        # in flight a settle is nearly always announced, so every commit would wait.
        announced = self.chains_next_head and ctx.answer_seconds <= QUICK_ANSWER_SECONDS
        if announced:
            ctx.writer.expect()
        try:
            try:
                # asyncio.timeout, not wait_for: transmit() must start in this very
                # step, so the closed check before still holds when it checks again
                # and writes (wait_for would schedule it as a task, a loop turn later).
                async with asyncio.timeout(ctx.response_timeout):
                    response = await session.transmit(transmit)
            finally:
                if announced:
                    ctx.writer.expected_done()
        except TimeoutError:
            ctx.answered_in(ctx.response_timeout)  # a server that stopped answering is no quick one
            mlog.warning("transmit_response_timeout", attempt=attempt)
            return on_loss(head, attempt, Loss.RESPONSE_TIMEOUT, policy, replay=session.replay)
        except TransmitTooLarge as exc:
            return on_unsendable(head, attempt, str(exc), policy)
        except LeaseExpired as exc:
            # Provably not written. Shielded: the tenure is being torn down
            # around this worker, and the put-back must not be cancelled.
            unsent = on_loss(head, attempt, Loss.LEASE_UNPROVEN, policy, replay=session.replay)
            assert isinstance(unsent, Requeue)
            put_back = asyncio.create_task(self._put_back_unsent(unsent, mlog))
            self.ctx.background.add(put_back)
            put_back.add_done_callback(self.ctx.background.discard)
            await asyncio.shield(put_back)
            raise LeaseLost(str(exc)) from exc
        except SessionClosed as exc:
            if exc.too_big and exc.victim == head.id:
                return on_unsendable(head, attempt, "server closed with 1009: message too big", policy)
            mlog.info("transmit_interrupted", attempt=attempt, code=exc.code)
            return on_loss(head, attempt, Loss.CONNECTION_LOST, policy, replay=session.replay)
        took = time.monotonic() - started
        ctx.answered_in(took)
        if ctx.metrics is not None:
            ctx.metrics.observe_dispatch_latency(self.name, took)
        return on_response(head, attempt, response, policy, time.time())

    async def _put_back_unsent(self, action: Requeue, mlog: Any) -> None:
        """Back to the head if the lease still stands (the write is fenced).

        If the lease moved, the row stays ``inflight`` for the successor's
        recovery: it cannot know the frame was never written.
        """
        try:
            await self._apply(action, mlog)
        except LeaseLost:
            mlog.info("transmit_not_sent_lease_moved", attempt=action.attempt)
        except StorageError as exc:
            mlog.warning("transmit_not_sent_requeue_failed", attempt=action.attempt, error=str(exc))

    async def _apply(self, action: Settle | Requeue | GiveUp | KeepInflight, mlog: Any,
                     *, follow: Session | None = None) -> _Next | None:
        """One action, one store call (one commit); then its log line, metrics and relay.

        ``follow``: a Settle also claims and marks inflight the channel's next
        head in the same commit when the core sends it at once over this
        session (the answer: that row, to be written next).
        """
        if isinstance(action, KeepInflight):
            return None  # resent with the same id when the worker finds it at the head
        for before in action.notes:
            before.write(mlog)
        ctx, epoch = self.ctx, self.epoch
        nxt: _Next | None = None
        if isinstance(action, Settle) and follow is not None:
            facts = SessionFacts(up=True, replay=follow.replay)
            done, nxt = await ctx.writer.call(_settle_and_next, ctx.holder, epoch, action,
                                              (self.running, self.paused), facts, time.time())
        elif isinstance(action, Settle):
            done = await ctx.writer.call(_settle, ctx.holder, epoch, action)
        elif isinstance(action, GiveUp):
            done = await ctx.writer.call(_give_up, ctx.holder, epoch, action)
        else:
            done = await ctx.writer.call(
                SqliteStore.requeue, ctx.holder, epoch, action.id, action.attempt, action.next_attempt_at,
                server_status=action.server_status, error_code=action.error_code, error_text=action.error_text,
                server_reason=action.server_reason,
            )
        note = action.note if done else action.stale
        if note is not None:
            note.write(mlog)
        if done and not isinstance(action, Requeue):
            if ctx.metrics is not None:
                ctx.metrics.message_settled(self.name, action.state)
            if action.app_ack is not None and ctx.relay is not None:
                ctx.relay.settled(action.id, action.app_ack)
        return nxt
