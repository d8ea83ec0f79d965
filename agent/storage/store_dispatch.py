"""Dispatch: the lease, the channel head, and the fenced transitions of a row.

Every transition is a guarded UPDATE (docs/queue.md#transitions) named after
its :class:`~agent.core.states.Event` and checked by row count; every
dispatch write is fenced on the lease epoch (docs/queue.md#fencing), so a
process that lost the lease cannot change a row even before it notices.
"""

from __future__ import annotations

import json
from typing import Any

from agent.core.states import Event, State
from agent.errors import LeaseLost, StorageError
from agent.storage.liveness import LeaseHolder, holder_provably_dead
from agent.storage.rows import ChannelFlags, HeadRow, Lease, LeaseRow
from agent.storage.store_base import StoreBase


class DispatchQueries(StoreBase):
    """The dispatch half of the store: lease tenure, heads, transitions, pause flags."""

    # -- lease ---------------------------------------------------------------

    def lease_row(self) -> LeaseRow | None:
        """The lease row as stored (for display: the last holder stays named after a release)."""
        return self._row(LeaseRow, "lease_row")

    def lease(self) -> Lease | None:
        row = self.lease_row()
        if row is None or row.holder is None:
            return None
        return Lease(holder=row.holder, epoch=int(row.epoch), expires_at=float(row.expires_at or 0))

    @staticmethod
    def _takeable(row: LeaseRow, me: LeaseHolder, now: float) -> bool:
        """Free, expired, ours already, or held by a provably dead process."""
        free = row.holder is None or row.expires_at is None or float(row.expires_at) <= now
        return free or row.holder == me.holder or holder_provably_dead(
            row.holder_pid, row.holder_boot, row.holder_pidns, row.holder_start
        )

    def lease_takeable(self, me: LeaseHolder) -> bool:
        """Read-only: whether :meth:`try_acquire_lease` would take the lease now.

        A standby polls this on the reader and opens a write transaction (the
        write lock) only when the answer is yes, so waiting for the lease costs
        the other processes' writes nothing.
        """
        row = self.lease_row()
        return row is not None and self._takeable(row, me, self._lease_now())

    def try_acquire_lease(self, me: LeaseHolder, ttl: float) -> int | None:
        """Take the lease when free, expired, or its holder is provably dead; the new epoch."""
        now = self._lease_now()
        row = self.lease_row()
        assert row is not None
        if not self._takeable(row, me, now):
            return None
        taken = self._scalar(
            "lease_take",
            holder=me.holder,
            pid=me.pid,
            boot=me.boot_id,
            pidns=me.pidns,
            start=me.start_ticks,
            expires_at=now + ttl,
            now=now,
            seen_epoch=row.epoch,
        )
        return int(taken) if taken is not None else None

    def queue_id(self) -> str | None:
        """The UUID this queue got when it was created (or first opened by this version)."""
        found = self._scalar("queue_id")
        return str(found) if found is not None else None

    def renew_lease(self, holder: str, epoch: int, ttl: float) -> None:
        now = self._lease_now()
        cur = self._exec("lease_renew", holder=holder, epoch=epoch, expires_at=now + ttl, now=now)
        if cur.rowcount != 1:
            raise LeaseLost(f"lease epoch {epoch} is no longer held by {holder}")

    def release_lease(self, holder: str, epoch: int) -> bool:
        return int(self._exec("lease_release", holder=holder, epoch=epoch).rowcount) == 1

    def _check_fence(self, holder: str, epoch: int) -> None:
        if self._scalar("lease_fence", holder=holder, epoch=epoch) is None:
            raise LeaseLost(f"lease epoch {epoch} is no longer held by {holder}")

    def recover_claimed(self, holder: str, epoch: int) -> int:
        """Event.RECOVER after taking the lease: claimed rows were provably not sent → queued."""
        ids = [str(r[0]) for r in self._exec("claimed_ids")]
        moved = 0
        if ids:
            moved = int(self._exec(self._query_for(Event.RECOVER, "recover_claimed"), ids=json.dumps(ids),
                                   holder=holder, epoch=epoch, now=self.clock()).rowcount)
        self._check_fence(holder, epoch)
        return moved

    # -- transitions -----------------------------------------------------------

    def _transition(self, event: Event, name: str, holder: str, epoch: int, message_id: str,
                    **params: Any) -> bool:
        """One fenced, guarded state change: True when the row moved.

        Zero rows means the guard did not match (another attempt, another
        state) — or the fence failed, which raises LeaseLost. An application
        ACK settled with the row is also kept with its dedupe key, for replay.
        """
        cur = self._exec(self._query_for(event, name), holder=holder, epoch=epoch, id=message_id,
                         now=self.clock(), **params)
        if cur.rowcount == 0:
            self._check_fence(holder, epoch)
            return False
        app_ack = params.get("app_ack")
        if app_ack is not None:
            self._exec("dedupe_set_app_ack", message_id=message_id, app_ack=app_ack)
        return True

    def channel_head(self, channel: str) -> HeadRow | None:
        """The channel's lowest-seq live row (docs/queue.md#ordering-and-seq)."""
        return self.channel_head_and_pause(channel)[0]

    def channel_head_and_pause(self, channel: str) -> tuple[HeadRow | None, bool]:
        """The channel's head and its durable pause flag, in one statement (False without a head)."""
        found = self._fetch_one("channel_head", channel=channel)
        if found is None:
            return None, False
        columns = dict(found)
        paused = bool(columns.pop("channel_paused"))
        return HeadRow(**columns), paused

    def claim(self, holder: str, epoch: int, message_id: str) -> bool:
        """Event.CLAIM: the queued head, once due, becomes claimed (provably not sent)."""
        return self._transition(Event.CLAIM, "claim", holder, epoch, message_id)

    def claim_and_send(self, holder: str, epoch: int, message_id: str, attempts: int) -> int | None:
        """Event.CLAIM_AND_SEND: the due, queued head straight to inflight; the new attempt number.

        For a head written at once: one statement where CLAIM and SEND take
        two, and the same commit as with two. None when the row is no longer
        a due, queued row with ``attempts`` sends (an operator moved it).
        """
        row = self._exec(self._query_for(Event.CLAIM_AND_SEND, "claim_and_send"), holder=holder, epoch=epoch,
                         id=message_id, attempts=attempts, now=self.clock()).fetchone()
        if row is None:
            self._check_fence(holder, epoch)
            return None
        return int(row[0])

    def mark_inflight(self, holder: str, epoch: int, message_id: str, from_state: str, attempts: int) -> int:
        """Event.SEND (a claimed row) or RESEND (``from_state`` inflight): the new attempt number.

        Committed *before* the frame is written (docs/queue.md#claim-and-send).
        A head read as ``queued`` was claimed since, so it is sent as claimed.
        """
        if from_state == State.INFLIGHT:
            name = self._query_for(Event.RESEND, "resend")
        else:
            name = self._query_for(Event.SEND, "send")
        row = self._exec(name, holder=holder, epoch=epoch, id=message_id, attempts=attempts,
                         now=self.clock()).fetchone()
        if row is None:
            self._check_fence(holder, epoch)
            raise StorageError(f"row {message_id} was not {from_state} at attempt {attempts}")
        return int(row[0])

    def settle(
        self,
        holder: str,
        epoch: int,
        message_id: str,
        attempt: int,
        state: str,
        *,
        server_status: int | None,
        server_ack: str | None,
        app_ack: bytes | None = None,
        error_code: str | None = None,
        error_text: str | None = None,
        server_reason: str | None = None,
    ) -> bool:
        """Event.SETTLE: inflight → processed/rejected/failed for exactly this attempt.

        ``server_reason``: the receiving system's own words for its answer
        (agent.core.acks.server_reason of its ACK), stored with the row.
        """
        if state not in Event.SETTLE.targets:
            raise ValueError(f"cannot settle into {str(state)!r}")
        return self._transition(
            Event.SETTLE, "settle", holder, epoch, message_id, attempt=attempt, state=state,
            server_status=server_status, server_ack=server_ack, app_ack=app_ack,
            error_code=error_code, error_text=error_text, server_reason=server_reason,
        )

    def requeue(
        self, holder: str, epoch: int, message_id: str, attempt: int, next_attempt_at: float,
        *, server_status: int | None = None, error_code: str | None = None, error_text: str | None = None,
        server_reason: str | None = None,
    ) -> bool:
        """Event.RETRY: inflight/claimed → queued with a backoff; the row stays the channel head.

        ``server_status``/``server_reason`` describe this attempt's answer (None: there was none).
        """
        return self._transition(
            Event.RETRY, "requeue", holder, epoch, message_id, attempt=attempt,
            next_attempt_at=next_attempt_at, server_status=server_status, error_code=error_code,
            error_text=error_text, server_reason=server_reason,
        )

    def fail_live(
        self, holder: str, epoch: int, message_id: str, attempt: int, state: str,
        *, error_code: str, error_text: str, app_ack: bytes | None = None,
        server_reason: str | None = None,
    ) -> bool:
        """Event.GIVE_UP: a live row straight to failed/rejected (ambiguous, too big, attempts spent).

        ``server_reason`` when a server answer ended it (the last one, at
        ``max_attempts``); None keeps what the row had.
        """
        if state not in Event.GIVE_UP.targets:
            raise ValueError(f"fail_live cannot set {str(state)!r}")
        return self._transition(
            Event.GIVE_UP, "fail_live", holder, epoch, message_id, attempt=attempt, state=state,
            error_code=error_code, error_text=error_text, app_ack=app_ack,
            server_reason=server_reason,
        )

    # -- channels ------------------------------------------------------------

    def pause_channel(self, channel: str, reason: str) -> None:
        self._exec("channel_pause", channel=channel, now=self.clock(), reason=reason)

    def resume_channel(self, channel: str) -> int:
        """Clear the channel's pause flag and, on a partitioned channel, every key's pause: how many keys."""
        self._exec("channel_resume", channel=channel)
        return max(0, int(self._exec("partition_resume_all", channel=channel).rowcount))

    def paused_channels(self) -> set[str]:
        return {str(r[0]) for r in self._exec("paused_channels")}

    def channel_flags(self) -> list[ChannelFlags]:
        """Every channel's durable row (seq counter, pause flag), by name."""
        return self._rows(ChannelFlags, "channel_flags")
