"""One partitioned channel's worker: up to ``max_in_flight`` rows of different keys at once.

docs/queue.md#partitioned-channels. The worker reads the channel's rows in
flight and its claimable heads (the store's ``partition_*`` queries: a head
is its key's lowest-seq live row, due, with no row of its key in flight and
its key not paused), and runs each through the same core decisions and the
same one-store-call-per-action path as the strict worker (``ChannelWorker``),
each in a task of its own. What keeps the order per key is in the SQL, and
checked again under the write lock at the claim; the worker only never
starts two rows of one key and never more than ``max_in_flight``.

Rows in flight that no task of this worker owns — left ``inflight`` by a
crash or a previous lease holder — are taken first: resent with the same id
(replay), or given up / requeued as ambiguous, before their key goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from agent.core.dispatch import (
    AwaitSession,
    ChannelPolicy,
    Claim,
    GiveUp,
    HeadDecision,
    Requeue,
    Send,
    Wait,
    decide_head,
)
from agent.core.envelope import decode_message
from agent.core.partition import PartitionKey, key_hash
from agent.core.states import State
from agent.errors import HL7Error, StorageError
from agent.runtime.channel_worker import ChannelWorker, DispatchContext, Stopping, session_facts
from agent.runtime.upstream import SessionClosed, UpstreamLink
from agent.storage.store import HeadRow, SqliteStore

__all__ = ["PartitionWorker"]


@dataclasses.dataclass(frozen=True)
class _View:
    busy: list[HeadRow]
    heads: list[HeadRow]
    paused: bool
    unkeyed: bool
    key_secret: str  # for the hash that names a key in the log (the key is patient data)


def _view_of(store: SqliteStore, channel: str, now: float, limit: int) -> _View:
    """The channel's rows in flight, its claimable heads, its pause flag, whether keys are missing."""
    return _View(
        busy=store.partition_busy(channel),
        heads=store.partition_heads(channel, now, limit),
        paused=channel in store.paused_channels(),
        unkeyed=bool(store.unkeyed_rows(channel, 1)),
        key_secret=store.key_hash_secret(),
    )


def _key_rows(store: SqliteStore, channel: str, key: PartitionKey) -> int:
    """Store the keys of live rows taken in without one (an older agent, or before partitioning)."""

    def key_of(body: bytes, encoding: str) -> str:
        try:
            return key.of(decode_message(body, encoding))
        except (HL7Error, ValueError, LookupError):
            # Undecodable: it will be given up when sent; "" keeps it in order with other such rows.
            return ""

    return store.key_unkeyed(channel, key_of)


class PartitionWorker(ChannelWorker):
    """Dispatches one partitioned channel under one tenure's epoch."""

    #: The next row is chosen per key from the view, never the channel's head.
    chains_next_head = False

    def __init__(
        self,
        ctx: DispatchContext,
        policies: tuple[ChannelPolicy, ChannelPolicy],
        epoch: int,
        link: UpstreamLink,
        wake: asyncio.Event,
        *,
        key: PartitionKey,
        idle_poll: float,
        log: Any,  # noqa: ANN401 - a structlog bound logger
    ) -> None:
        super().__init__(ctx, policies, epoch, link, wake, idle_poll=idle_poll, log=log)
        self.key = key
        #: Rows this worker is working on, by id, with their key.
        self._working: dict[str, str | None] = {}

    async def run(self) -> None:
        # The tasks live in this group: when the tenure ends (this task is
        # cancelled) they are cancelled with it; a LeaseLost in one ends it all.
        async with asyncio.TaskGroup() as group:
            await self._loop(group)

    async def _loop(self, group: asyncio.TaskGroup) -> None:
        ctx, link = self.ctx, self.link
        limit = 2 * self.running.max_in_flight + 8
        while not ctx.stopping.is_set():
            try:
                view = await ctx.reader.call(_view_of, self.name, time.time(), limit)
                if view.unkeyed:
                    await ctx.writer.call(_key_rows, self.name, self.key)
                    continue
            except StorageError as exc:
                self.log.warning("dispatch_read_failed", error=str(exc))
                await ctx.sleep(1.0)
                continue
            policy = self.paused if view.paused else self.running
            facts = session_facts(link)
            keys = set(self._working.values())
            need_session = False
            for row in [*view.busy, *view.heads]:
                if len(self._working) >= policy.max_in_flight:
                    break
                if row.id in self._working or (row.state == State.QUEUED and row.partition_key in keys):
                    continue
                decision = decide_head(row, policy, facts, time.time(), in_flight=len(self._working))
                if isinstance(decision, AwaitSession):
                    need_session = True
                    break
                if isinstance(decision, Wait):
                    continue
                self._working[row.id] = row.partition_key
                keys.add(row.partition_key)
                group.create_task(self._one(row, decision, policy, view.key_secret), name=f"dispatch-{self.name}-{row.id}")
            if need_session and not self._working:
                # Claim only with a session up: during an outage the heads stay `queued`.
                try:
                    await ctx.until_stopping(link.session())
                except (Stopping, SessionClosed):
                    return
                continue
            await self._idle(self.idle_poll)

    async def _one(self, head: HeadRow, decision: HeadDecision, policy: ChannelPolicy, key_secret: str) -> None:
        """Claim (when queued), send and settle one row: the strict worker's path, for one key."""
        ctx, link = self.ctx, self.link
        mlog = self.log.bind(id=head.id, control_id=head.control_id, seq=head.seq,
                             partition=key_hash(head.partition_key or "", key_secret))
        try:
            if isinstance(decision, Claim):
                claimed = await ctx.writer.call(SqliteStore.claim_partition_head, ctx.holder, self.epoch, head.id)
                if not claimed:
                    return
                head = dataclasses.replace(head, state=State.CLAIMED)
                decision = decide_head(head, policy, session_facts(link), time.time())
            session = link.current()
            if ctx.stopping.is_set() or session is None:
                return  # a claimed row waits in the next view (or is requeued on release)
            if isinstance(decision, Send):
                await self._send(decision, head, policy, session, mlog)
            elif isinstance(decision, (GiveUp, Requeue)):
                await self._apply(decision, mlog)
        except StorageError as exc:
            # Rows are safe where they stand; the next view shows this one again.
            self.log.warning("dispatch_storage_error", error=str(exc))
            await ctx.sleep(1.0)
        finally:
            self._working.pop(head.id, None)
            self.wake.set()
